"""Host time per decode step, with the model forward replaced by a no-op (CPU or GPU).

Everything a step does besides the model runs as usual: scheduling, slot bookkeeping, input
staging and preparation, logits of a small vocabulary, sampling, the output copy and the update
of the scheduler and the outputs. Requests are all in decode (short prompts, EOS ignored), so
each step has exactly `batch` rows. Steps run eagerly: a CUDA-graph replay would replace the
model call, which is what is cut out here. Prompt i has `--prompt-len` + (i mod block size)
tokens, so that as in a real batch each step some rows fill a KV block -- grow, register it in
the prefix cache, commit a block-table row -- and others do not (`--lockstep`: equal prompts, so
every row crosses a block boundary in the same step, one step in block-size, and the median step
crosses none: RESULTS.md's figures up to 2026-12-06 were taken so). `--ngram K` turns on n-gram
speculation with K drafts a step: the no-op forward makes greedy decoding repeat one token, so
every draft is accepted and each step carries K + 1 tokens a row (the draft gate is told to keep
drafts on).

    python benchmarks/step_overhead.py --device cuda --batch-sizes 1,8,64,256,512
    python benchmarks/step_overhead.py --device cuda --batch-sizes 1,256 --prompt-len 1000
    python benchmarks/step_overhead.py --device cuda --batch-sizes 1,256 --prompt-len 1000 --pipelined
    python benchmarks/step_overhead.py --device cpu --count-ops 10 --temperature 0.8
    python benchmarks/step_overhead.py --device cuda --batch-sizes 1,16 --ngram 4 --count-ops 5
    OMP_NUM_THREADS=1 python benchmarks/step_overhead.py --device cpu --clock thread --profile 30

`--clock thread` counts the CPU time of the main thread instead of wall time: on a shared
machine other work then moves the figures less (on a GPU it hides time spent waiting for it).
`--profile N` prints the N functions with the most own time over the timed steps (cProfile;
its overhead inflates the step times printed beside it).

`--gc-ab` measures each batch size twice more, Python's garbage collector off and then on (its
collections run inside whatever step allocates past the threshold; cProfile charges them to the
function that allocated). `--profile-sort cumulative` and `--profile-callees REGEX` show where a
function's time goes below it.

`--pipelined` times the engine's own loop instead (`LLMEngine.step`, async scheduling): each step
schedules and launches step N+1, then waits for step N's tokens (launched a step earlier) and
processes them. Its step is the period of that loop, and `wait` is the part of it spent blocked on
the device (events synchronized: the output copy's, rarely the staging copy's): `host` = `total` -
`wait` is the host's own time per step. `output` is `AsyncOutput.get`, its wait included.
The default mode runs the parts of one step in order and waits for its tokens at once, so its
`sample` holds the device's round trip too (the logits, the sampling launches, the copy back).

`--line-profile` times every line of the step's host functions (`LINE_PROFILED`, or the dotted
names given) with line_profiler, where it is installed: its overhead inflates the step, not the
lines' ranking.

`--count-ops N` counts, over N more steps after the timed ones, what the host dispatches per step
(median), by the step's parts: `calls`, torch calls made from Python (functions and tensor
methods; reads of shape, dtype, strides and the like left out), each costing host time on any
device and on a GPU mostly a kernel launch or a copy; `aten`, the operators they reach (device
work; on a CPU the host->device copies are no-ops and do not show); `kernels`, Triton launches on
a GPU -- on a CPU the torch reference that stands in for each Triton kernel counts as one launch
and the torch calls inside it are left out, so the CPU's figures match the GPU's path.
`--list-ops` prints the calls of one counted step by name.

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib
import json
import pstats
import statistics
import tempfile
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# A small Qwen3-shaped config: only its sizes matter (the forward never runs).
CONFIG = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=1024, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
)


# Tensor metadata reads: no dispatch to a kernel, left out of `calls`.
_METADATA = frozenset({"__get__", "dim", "size", "stride", "numel", "is_contiguous", "data_ptr", "__len__", "element_size",
                       "storage_offset", "__hash__", "__eq__", "__bool__", "__index__", "__int__"})


class OpCounter:
    """Counts torch calls, aten operators and kernel launches (see the module docstring)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.aten: Counter[str] = Counter()
        self.kernels: Counter[str] = Counter()
        self._inside_kernel = 0
        counter = self

        class _Calls(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", str(func))
                if not counter._inside_kernel and name not in _METADATA:
                    counter.calls[name] += 1
                return func(*args, **(kwargs or {}))

        class _Aten(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not counter._inside_kernel:
                    counter.aten[func.__name__] += 1
                return func(*args, **(kwargs or {}))

        self._modes = (_Calls(), _Aten())

    def kernel(self, name: str, launch):
        def counted(*args, **kwargs):
            self.kernels[name] += 1
            self._inside_kernel += 1
            try:
                return launch(*args, **kwargs)
            finally:
                self._inside_kernel -= 1

        return counted

    @contextmanager
    def counting(self) -> Iterator[None]:
        with self._modes[0], self._modes[1]:
            yield

    def totals(self) -> tuple[int, int, int]:
        return sum(self.calls.values()), sum(self.aten.values()), sum(self.kernels.values())


@contextmanager
def kernels_counted_by(counter: OpCounter) -> Iterator[None]:
    """Route every Triton launch, and every torch reference that stands in for a Triton kernel
    (`op_ref` beside `_op_kernel`, STYLE.md), through `counter.kernel`."""
    patched = []
    for mod in [m for n, m in sys.modules.items() if n.startswith("slotrunner") and m is not None]:
        for name, fn in list(vars(mod).items()):
            if name.endswith("_ref") and callable(fn) and f"_{name[:-4]}_kernel" in vars(mod):
                patched.append((mod, name, fn))
                setattr(mod, name, counter.kernel(name[:-4], fn))
    launchers = []  # compiled kernels, and kernels the Triton interpreter runs (TRITON_INTERPRET=1)
    for module, cls in (("triton.runtime.jit", "JITFunction"), ("triton.runtime.interpreter", "InterpretedFunction")):
        try:
            launcher = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError):
            continue
        run = launcher.run
        launcher.run = lambda fn, *a, _run=run, **kw: (
            _run(fn, *a, **kw) if counter._inside_kernel else counter.kernel(fn.__name__, lambda: _run(fn, *a, **kw))()
        )
        launchers.append((launcher, run))
    # A kernel launched again through CachedLaunch's compiled path never reaches JITFunction.run:
    # count it here (its first launch, through Triton's dispatch, counts once too).
    from slotrunner.core_runner.triton_utils import CachedLaunch

    cached_launch = CachedLaunch._launch
    CachedLaunch._launch = lambda self, grid, args, kwargs: counter.kernel(
        self.fn.__name__, lambda: cached_launch(self, grid, args, kwargs)
    )()
    try:
        yield
    finally:
        for mod, name, fn in patched:
            setattr(mod, name, fn)
        for launcher, run in launchers:
            launcher.run = run
        CachedLaunch._launch = cached_launch


PARTS = ("schedule", "prepare+forward", "sample+copy", "update")
# The functions of a decode step's host path, for --line-profile.
LINE_PROFILED = (
    "slotrunner.core_runner.engine.engine.LLMEngine._step",
    "slotrunner.core_runner.engine.scheduler.Scheduler.schedule",
    "slotrunner.core_runner.runner.model_runner.ModelRunner.execute_model",
    "slotrunner.core_runner.runner.model_runner.ModelRunner._update_states",
    "slotrunner.core_runner.runner.prepare_inputs.prepare_inputs",
    "slotrunner.core_runner.runner.input_buffers.InputBuffers.stage",
    "slotrunner.core_runner.runner.input_kernels.build_step_inputs",
    "slotrunner.core_runner.runner.model_runner.ModelRunner.sample_tokens",
    "slotrunner.core_runner.runner.model_runner.ModelRunner._sample",
    "slotrunner.core_runner.sample.sampler.Sampler.__call__",
    "slotrunner.core_runner.runner.prepare_inputs.post_update",
    "slotrunner.core_runner.runner.async_output.AsyncOutput.__init__",
    "slotrunner.core_runner.engine.engine.LLMEngine._process",
    "slotrunner.core_runner.engine.scheduler.Scheduler.update",
)


def line_profiler_for(names: tuple[str, ...]):
    """A line_profiler.LineProfiler over the functions named by dotted path (module, then
    attributes); None where line_profiler is not installed."""
    try:
        from line_profiler import LineProfiler
    except ImportError:
        print("--line-profile: line_profiler is not installed (pip install line_profiler); skipped")
        return None
    lp = LineProfiler()
    for name in names:
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for attr in parts[i:]:
                obj = getattr(obj, attr)
            lp.add_function(obj)
            break
        else:
            raise ValueError(f"--line-profile: cannot import {name!r}")
    return lp


def one_step(engine, runner, batch: int, part: Callable[[str], object], query_len: int = 1) -> None:
    """One engine step as `LLMEngine.step` runs it, each part inside `part(name)` (a context)."""
    with part("schedule"):
        sched = engine.scheduler.schedule()
    with part("prepare+forward"):
        runner.execute_model(sched)
    with part("sample+copy"):
        out = runner.sample_tokens().get()
    with part("update"):
        engine._process(sched, out, final_only=True)  # scheduler update + output processing
    assert len(sched.num_scheduled_tokens) == batch and all(n == query_len for n in sched.num_scheduled_tokens.values())


def pipelined_steps(engine, runner, batch: int, steps: int, timed, parts: dict[str, list[float]], clock,
                    query_len: int = 1) -> None:
    """`steps` steps of the engine's own loop (async scheduling), each part timed by wrapping the
    method that does it: `LLMEngine.step` calls them in its order, not this function."""
    from slotrunner.core_runner.runner.async_output import AsyncOutput

    wrapped = []

    def wrap(obj, name: str, part: str, check=None):
        method = getattr(obj, name)

        def timed_call(*args, **kwargs):
            with timed(part):
                out = method(*args, **kwargs)
            if check is not None:
                check(out)
            return out

        setattr(obj, name, timed_call)
        wrapped.append((obj, name, method))

    def whole_batch(out) -> None:  # every step carries the whole batch, each row query_len tokens
        assert len(out.num_scheduled_tokens) == batch and set(out.num_scheduled_tokens.values()) == {query_len}

    wrap(engine.scheduler, "schedule", "schedule", whole_batch)
    wrap(runner, "execute_model", "prepare+forward")
    wrap(runner, "sample_tokens", "sample+copy")
    wrap(engine, "_process", "update")
    wrap(AsyncOutput, "get", "output")  # the wait for the copy's event (timed in "wait" too), then the host lists
    if torch.cuda.is_available():  # every wait of a step on the device: the output copy's, the staging copy's
        wrap(torch.cuda.Event, "synchronize", "wait")
    try:
        engine.step(final_only=True)  # the first timed step settles an untimed one: start with one in flight
        for k in parts:
            parts[k].clear()
        for _ in range(steps):
            t0 = clock()
            engine.step(final_only=True)
            parts["total"].append(1e3 * (clock() - t0))
            parts["wait"] += [0.0] * (len(parts["total"]) - len(parts["wait"]))  # a step that waited on nothing
    finally:
        for obj, name, method in wrapped:
            if isinstance(obj, type):
                setattr(obj, name, method)
            else:
                del obj.__dict__[name]
    parts["host"] = [t - w for t, w in zip(parts["total"], parts["wait"])]


def measure(
    model_dir: str, device: str, batch: int, steps: int, clock=time.perf_counter, profile: cProfile.Profile | None = None,
    count_steps: int = 0, list_ops: bool = False, temperature: float = 0.0, ngram: int = 0, prompt_len: int = 8,
    lockstep: bool = False, pipelined: bool = False,
) -> dict[str, float]:
    from slotrunner import LLM, SamplingParams

    # The no-op forward makes every logit equal, so greedy decoding emits token 0 forever: with
    # prompts of 0s the n-gram speculator's drafts are all accepted, every step carries k.
    spec = {"method": "ngram", "num_speculative_tokens": ngram, "prompt_lookup_min": 1, "prompt_lookup_max": 3} if ngram else None
    # Room for every step's tokens (with drafts, 1 + ngram a step): a request that hits the
    # length limit finishes, and the batch would shrink under the measurement.
    # Rows whose prompt is in decode while later prompts prefill (chunked, long prompts) take tokens then too.
    budget = max(2048, 8 * batch)
    max_tokens = (steps + count_steps + 50) * (1 + ngram) + 2 * -(-batch * prompt_len // budget)
    max_model_len = max(1024, prompt_len + 16 + max_tokens)
    # Async scheduling on either device (a GPU's default), so that a CPU run takes the GPU's
    # scheduler path: synchronous scheduling also checks each row's token count in update().
    llm = LLM(model_dir, device=device, dtype="float32", load_format="dummy", max_model_len=max_model_len,
              max_num_seqs=batch, max_num_batched_tokens=budget, enforce_eager=True, speculative_config=spec,
              async_scheduling=True)
    engine, runner = llm.engine, llm.engine.runner
    if ngram:  # every step carries drafts: the gate's probes of going without are left out
        engine.scheduler.draft_gate.want_drafts = lambda: True
    hidden = torch.zeros(runner.config.max_num_batched_tokens, CONFIG["hidden_size"], device=device)
    runner.model.forward = lambda input_ids, positions, inputs_embeds=None, **kw: hidden[: input_ids.shape[0]]
    block_size = llm.config.block_size
    for i in range(batch):  # temperature > 0: seeded sampling (Gumbel noise keyed on each request's seed)
        sp = SamplingParams(temperature=temperature, seed=i if temperature else None, ignore_eos=True,
                            max_tokens=max_tokens)
        n = prompt_len + (0 if lockstep else i % block_size)  # staggered: rows fill blocks in different steps
        prompt = [0] * n if ngram else [1 + (i + j) % 1000 for j in range(n)]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, sp)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sched = engine.scheduler
    while sched.num_waiting or any(r.num_computed_tokens < len(r.prompt_token_ids) for r in sched.running):
        engine.step()  # prefill, in chunks of the step's budget
    for _ in range(5):  # warm decode steps
        engine.step()
    parts: dict[str, list[float]] = {k: [] for k in PARTS + ("total",) + (("wait", "output") if pipelined else ())}

    @contextmanager
    def timed(name: str) -> Iterator[None]:
        t0 = clock()
        yield
        parts[name].append(1e3 * (clock() - t0))

    if profile is not None:
        profile.enable()
    if pipelined:
        pipelined_steps(engine, runner, batch, steps, timed, parts, clock, 1 + ngram)
    else:
        for _ in range(steps):
            sync()
            t0 = clock()
            one_step(engine, runner, batch, timed, 1 + ngram)
            parts["total"].append(1e3 * (clock() - t0))
    if profile is not None:
        profile.disable()
    result = {k: statistics.median(v) for k, v in parts.items()}
    counts: dict[str, list[tuple[int, int, int]]] = {k: [] for k in PARTS + ("total",)}
    for i in range(count_steps):
        step_counters = {k: OpCounter() for k in PARTS}

        @contextmanager
        def counted(name: str) -> Iterator[None]:
            c = step_counters[name]
            with kernels_counted_by(c), c.counting():
                yield

        one_step(engine, runner, batch, counted, 1 + ngram)
        for k, c in step_counters.items():
            counts[k].append(c.totals())
        counts["total"].append(tuple(sum(c.totals()[j] for c in step_counters.values()) for j in range(3)))
        if list_ops and i == 0:
            for k, c in step_counters.items():
                print(f"--- batch {batch}, {k}: calls {dict(c.calls.most_common())}")
                print(f"    kernels {dict(c.kernels)}")
    for k, v in counts.items():
        if v:
            result[f"{k} ops"] = tuple(int(statistics.median(x[j] for x in v)) for j in range(3))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-sizes", default="1,8,32,64,128,256,512")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--clock", choices=("wall", "thread"), default="wall", help="thread: CPU time of the main thread")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print the N functions with the most own time, per batch size")
    p.add_argument("--profile-sort", default="tottime", help="with --profile: pstats sort key (tottime, cumulative, ...)")
    p.add_argument("--profile-callees", metavar="REGEX", default="",
                   help="with --profile: also list what the functions matching REGEX call, and who calls them")
    p.add_argument("--line-profile", nargs="?", const=",".join(LINE_PROFILED), default="", metavar="NAMES",
                   help="time each line of the step's host functions (line_profiler; comma-separated dotted names, default LINE_PROFILED)")
    p.add_argument("--gc-ab", action="store_true",
                   help="each batch size twice more: Python's garbage collector off (gc.disable after a collect), then on")
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: seeded sampling at this temperature (default greedy)")
    p.add_argument("--count-ops", type=int, default=0, metavar="N", help="count torch calls, aten ops and kernels over N more steps")
    p.add_argument("--list-ops", action="store_true", help="with --count-ops: print one counted step's calls by name")
    p.add_argument("--ngram", type=int, default=0, metavar="K", help="n-gram speculation with K drafts a step, all accepted")
    p.add_argument("--prompt-len", type=int, default=8, metavar="N",
                   help="tokens a prompt, plus the row's index modulo the block size unless --lockstep")
    p.add_argument("--lockstep", action="store_true",
                   help="every prompt exactly --prompt-len tokens: all rows cross block boundaries in the same step")
    p.add_argument("--pipelined", action="store_true",
                   help="time the engine's own loop (LLMEngine.step, async scheduling): a step's period, and its wait on the device apart")
    p.add_argument("--triton-dispatch", action="store_true", help="launch every Triton kernel through Triton's own dispatch (no CachedLaunch)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.triton_dispatch:
        from slotrunner.core_runner import triton_utils

        triton_utils.CACHED_LAUNCH = False
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    rows = []
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(CONFIG))
        for b in sizes:
            profile = cProfile.Profile() if args.profile else None
            if args.line_profile:
                profile = line_profiler_for(tuple(args.line_profile.split(",")))
            rows.append(dict(batch=b, **measure(d, args.device, b, args.steps, clock, profile, args.count_ops, args.list_ops,
                                                args.temperature, args.ngram, args.prompt_len, args.lockstep,
                                                args.pipelined)))
            if profile is not None and args.line_profile:
                print(f"--- batch {b}: {args.steps} steps, line by line (us)")
                profile.print_stats(output_unit=1e-6, stripzeros=True)
            elif profile is not None:
                print(f"--- batch {b}: {args.steps} steps")
                stats = pstats.Stats(profile).sort_stats(args.profile_sort)
                stats.print_stats(args.profile)
                if args.profile_callees:
                    stats.print_callees(args.profile_callees)
                    stats.print_callers(args.profile_callees)
            for collector in ("off", "on") if args.gc_ab else ():
                if collector == "off":
                    gc.collect()
                    gc.disable()
                try:
                    r = measure(d, args.device, b, args.steps, clock, None, 0, False, args.temperature, args.ngram,
                                args.prompt_len, args.lockstep, args.pipelined)
                finally:
                    gc.enable()
                rows.append(dict(batch=f"{b} gc {collector}", **r))
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    what = "CPU time of the main thread" if args.clock == "thread" else "wall time"
    sampling = f"seeded sampling at temperature {args.temperature}" if args.temperature else "greedy"
    if args.ngram:
        sampling += f", n-gram speculation with {args.ngram} drafts a step, all accepted"
    if args.triton_dispatch:
        sampling += ", Triton kernels through Triton's dispatch"
    prompts = f"{args.prompt_len}-token prompts" if args.lockstep else f"prompts of {args.prompt_len} + (row mod block size) tokens"
    loop = "the engine's loop (async scheduling, a step's tokens processed in the next step)" if args.pipelined else "one step's parts in order"
    print(f"host time per decode step, model forward replaced by a no-op; {name}, {what}, {sampling}, "
          f"{prompts}, {loop}, median of {args.steps} steps, ms")
    extra = ("host", "wait", "output") if args.pipelined else ()
    print(f"{'batch':>10} {'total':>8} {'schedule':>9} {'prepare':>9} {'sample':>8} {'update':>8}" + "".join(f" {k:>8}" for k in extra))
    for r in rows:
        print(f"{r['batch']:>10} {r['total']:>8.3f} {r['schedule']:>9.3f} {r['prepare+forward']:>9.3f} "
              f"{r['sample+copy']:>8.3f} {r['update']:>8.3f}" + "".join(f" {r[k]:>8.3f}" for k in extra))
    if args.count_ops:
        print(f"per decode step, median of {args.count_ops} steps: torch calls / aten ops / kernels")
        print(f"{'batch':>6} {'total':>14} {'schedule':>14} {'prepare':>14} {'sample':>14} {'update':>14}")
        for r in (r for r in rows if "total ops" in r):
            print(f"{r['batch']:>6}" + "".join(f" {'/'.join(map(str, r[k + ' ops'])):>14}" for k in ("total",) + PARTS))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
