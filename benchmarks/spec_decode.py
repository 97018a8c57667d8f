"""Speculative decoding (n-gram or draft-model drafts): time per output token with and without it.

Prompts ask the model to repeat or lightly edit a given passage (code, prose, a list): the
output copies long spans of the prompt, which is what prompt lookup proposes. Per batch size it
runs the same prompts greedy, EOS ignored, exactly `--max-tokens` tokens each, once without and
once with `speculative_config={"method": "ngram", ...}`, and prints the wall time per output
token (ms/token: wall time x batch size / tokens, i.e. the latency each request sees per
token), the speedup, the acceptance rate (accepted / proposed drafts, from
RequestOutput.metrics), the mean tokens per decode step of a request, and whether the token ids
are identical (they must be: verification is exact).

    python benchmarks/spec_decode.py                      # CPU: SmolLM2-135M (LLM()), batch 1 and 16
    python benchmarks/spec_decode.py --batch-sizes 1 --num-speculative-tokens 8 --repeats 3   # CPU, long drafts
    python benchmarks/spec_decode.py --qwen3-shape        # GPU: Qwen3-0.6B shape, random weights
    python benchmarks/spec_decode.py --draft-model PATH   # a draft model instead of prompt lookup
    python benchmarks/spec_decode.py --qwen3-shape --steady-prompts 8   # GPU: nearly every draft accepted
    python benchmarks/spec_decode.py --qwen3-shape --draft-model other --keep-gate   # GPU: steady cost of a useless draft

`--qwen3-shape` builds a random-weight model of Qwen3-0.6B's shape (as benchmarks/throughput.py
does); random weights do not copy their prompt, so there it measures the cost of verification
(acceptance near 0) unless `--model` names a real checkpoint. Its greedy output does fall into a
cycle after a while: runs of one repeated token, which prompt lookup predicts, and switches
between runs, which it cannot (about 60% of drafts accepted over 128 tokens). `--prime-tokens N`
appends to each prompt the target's own greedy continuation of N tokens (made untimed, before
both arms run): the timed output continues text the prompt holds, as a copy task does for a
real model (65.6% accepted in the runs recorded: the continuation switches runs as often).
`--steady-prompts P` serves P x batch candidate prompts greedy (untimed) and times the batch
whose outputs switch token least: the case where nearly every draft is accepted, which shows
what a verifying step costs against the tokens it yields.

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import statistics
import time

PASSAGE = (
    "def merge_sorted(a, b):\n"
    "    result = []\n"
    "    i = j = 0\n"
    "    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n"
    "            result.append(a[i])\n"
    "            i += 1\n"
    "        else:\n"
    "            result.append(b[j])\n"
    "            j += 1\n"
    "    result.extend(a[i:])\n"
    "    result.extend(b[j:])\n"
    "    return result\n"
)
PROSE = (
    "The old lighthouse stood at the end of the pier, its white paint peeling in long strips. "
    "Every evening the keeper climbed the ninety-two steps, lit the lamp, and wrote the weather "
    "in a small blue notebook. Ships passed far out at sea, and none of them knew his name."
)
TASKS = (
    f"Repeat the following code exactly, without any comment:\n\n{PASSAGE}",
    f"Rename the function merge_sorted to merge_lists in this code and print the whole code:\n\n{PASSAGE}",
    f"Copy this paragraph word for word:\n\n{PROSE}",
    f"Rewrite this paragraph replacing 'keeper' with 'watchman', changing nothing else:\n\n{PROSE}",
)


def build_prompts(llm, batch_size: int) -> list[dict]:
    tok = llm.engine.tokenizer
    prompts = []
    for i in range(batch_size):
        task = TASKS[i % len(TASKS)]
        if tok is None:
            prompts.append({"prompt_token_ids": [(7 * i + j) % 1000 + 3 for j in range(64)]})
            continue
        ids = tok.apply_chat_template([{"role": "user", "content": task}], add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        prompts.append({"prompt_token_ids": list(ids)})
    return prompts


def primed(llm, prompts: list[dict], num_tokens: int) -> list[dict]:
    """Each prompt followed by the model's own greedy continuation of `num_tokens` tokens."""
    outs = greedy(llm, prompts, num_tokens)
    return [{"prompt_token_ids": list(p["prompt_token_ids"]) + list(o)} for p, o in zip(prompts, outs)]


def greedy(llm, prompts: list[dict], num_tokens: int) -> list[list[int]]:
    """Each prompt's greedy output of `num_tokens` tokens (EOS ignored), served untimed."""
    from slotrunner import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def steady(llm, batch_size: int, pool: int, max_tokens: int) -> tuple[list[dict], list[int]]:
    """Of `pool` x `batch_size` candidate prompts (synthetic ids: a model without a tokenizer),
    the `batch_size` whose greedy outputs of `max_tokens` tokens switch token least, and their
    switch counts. Chosen by what the model outputs, so that prompt lookup's drafts are nearly all
    right: the timed figure is then what verification costs per token it yields."""
    if llm.engine.tokenizer is not None:
        raise SystemExit("--steady-prompts picks among synthetic prompts: a model without a tokenizer (--qwen3-shape)")
    candidates = build_prompts(llm, pool * batch_size)
    switches = [sum(a != b for a, b in zip(ids, ids[1:])) for ids in greedy(llm, candidates, max_tokens)]
    best = sorted(range(len(candidates)), key=lambda i: (switches[i], i))[:batch_size]
    return [candidates[i] for i in best], [switches[i] for i in best]


ALWAYS_DRAFT = False  # --always-draft (main sets it)


def new_gate(method: str):
    """A fresh draft gate for a speculating run; with --always-draft one that schedules drafts on
    every step (what a step with drafts costs, whatever they are worth), measuring as usual."""
    from slotrunner.core_runner.engine.draft_gate import DraftGate

    gate = DraftGate(method)
    if ALWAYS_DRAFT:
        gate.want_drafts = lambda: True
    return gate


def run(llm, prompts, max_tokens: int, method: str | None = None, warm: bool = True, keep_gate: bool = False):
    """Serve `prompts` once untimed (unless not `warm`: an engine that served them already), then
    time them. The untimed run compiles every kernel the timed one meets (Triton compiles on
    first use: verification rows of 1 + k tokens, the speculator's kernels), which a short
    warm-up never reaches; the draft gate then starts anew -- unless `keep_gate`: then a fresh
    gate learns on the untimed run and the timed ones go on with what it learned, as an engine
    serving a stream of such requests would (the gate's probes only, not its first measurements)."""
    from slotrunner import SamplingParams
    from slotrunner.core_runner.triton_utils import compiles_counted

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if method is not None and keep_gate and warm:
        llm.engine.scheduler.draft_gate = new_gate(method)
    if warm:
        llm.generate(prompts, params, use_tqdm=False)
    if method is not None and not keep_gate:
        llm.engine.scheduler.draft_gate = new_gate(method)
    with compiles_counted() as compiled:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    if compiled:  # the timed run met a kernel variant the untimed one did not: its figure includes the compile
        print(f"      the timed run compiled {len(compiled)} Triton kernel(s) in {sum(t for _, t in compiled):.2f} s: "
              + ", ".join(sorted({name for name, _ in compiled})))
    return outs, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--qwen3-shape", action="store_true", help="random-weight Qwen3-0.6B shape (GPU)")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=3)
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument(
        "--draft-model", default=None,
        help="speculate with this draft model (method draft_model); 'same': the target itself; 'other': the target's "
             "shape with other random weights (--qwen3-shape), whose drafts are about never accepted: the overhead",
    )  # fmt: skip
    parser.add_argument(
        "--draft-layers", type=int, default=None,
        help="with --draft-model other: its depth (default the target's 28). A draft model is smaller than its target in "
             "use; at the target's own size its eager prompt prefill alone costs what the target's does",
    )  # fmt: skip
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--prime-tokens", type=int, default=0,
        help="append to each prompt the target's own greedy continuation of this many tokens: the output then "
             "continues text in the prompt (with --qwen3-shape it switches runs as often as without: see --steady-prompts)",
    )  # fmt: skip
    parser.add_argument(
        "--steady-prompts", type=int, default=0, metavar="P",
        help="time, of P x batch synthetic prompts served untimed, those whose greedy outputs switch token least "
             "(--qwen3-shape: the case where nearly every draft is accepted)",
    )  # fmt: skip
    parser.add_argument(
        "--keep-gate", action="store_true",
        help="the timed runs go on with the draft gate the untimed run trained (steady serving), not a fresh one (each run pays for its first measurements)",
    )  # fmt: skip
    parser.add_argument(
        "--always-draft", action="store_true",
        help="every step carries drafts, the draft gate aside: what a step with drafts costs (with --phases: where "
             "it goes), however few are accepted",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="timed runs of each arm, alternating (the table shows the medians): a host's speed moves between runs",
    )  # fmt: skip
    parser.add_argument(
        "--phases", action="store_true",
        help="after each speculating run, run it again timing the engine's phases per step (schedule, forward launch, "
             "sampling launch, wait for the tokens, scheduler update, output processing) and, on CUDA, the GPU's "
             "kernel time per step under the torch profiler",
    )  # fmt: skip
    args = parser.parse_args()
    global ALWAYS_DRAFT
    ALWAYS_DRAFT = args.always_draft

    from slotrunner import LLM

    model = args.model
    if args.qwen3_shape and model is None:
        model = qwen3_shape_dir()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
    }
    # Both engines schedule as the device's default does (async on CUDA: the steps without drafts
    # overlap, those with drafts are processed before the next is scheduled).
    common = dict(device=args.device, max_model_len=1024, max_num_seqs=32, enable_prefix_caching=False)
    base = LLM(model, **common)
    if args.draft_model is not None:
        # "same": a draft sharing the target's weights proposes the target's own greedy tokens
        # (every draft of a greedy request accepted: the upper bound of the method).
        # "other": the same shape with other weights (drafts about never accepted: the overhead).
        draft = args.draft_model
        if draft == "same":
            draft = base.config.model
        elif draft == "other":
            draft = qwen3_shape_dir(seed=1, num_layers=args.draft_layers or 28)
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": args.num_speculative_tokens}
    fast = LLM(model, speculative_config=spec, **common)
    print(f"model={model or 'SmolLM2-135M-Instruct'} device={base.config.device} dtype={base.config.dtype} "
          f"k={args.num_speculative_tokens} " + (f"draft={args.draft_model}{'' if args.draft_layers is None else f' ({args.draft_layers} layers)'} " if args.draft_model else
          f"n={args.prompt_lookup_min}..{args.prompt_lookup_max} ") + f"max_tokens={args.max_tokens}"
          + (f" prompts primed with {args.prime_tokens} tokens of the target's own output" if args.prime_tokens else "")
          + (f" steady prompts (the fewest switches of {args.steady_prompts} x batch)" if args.steady_prompts else ""))
    print(f"{'batch':>5} {'base ms/tok':>11} {'spec ms/tok':>11} {'base tok/s':>10} {'spec tok/s':>10} {'speedup':>7} "
          f"{'accept':>6} {'tok/step':>8} identical")
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        prompts = build_prompts(base, b)
        if args.steady_prompts:
            prompts, switches = steady(base, b, args.steady_prompts, args.max_tokens)
            print(f"      {b} of {args.steady_prompts * b} prompts, whose outputs switch token {sum(switches)} times in all "
                  f"({switches[:8]}{' ...' if b > 8 else ''})")
        if args.prime_tokens:
            prompts = primed(base, prompts, args.prime_tokens)
        # Each timed run starts with a fresh draft gate (core_runner/engine/draft_gate.py): it
        # measures the cost of steps with and without drafts at this batch size (--keep-gate:
        # one gate per batch size, trained on the untimed run).
        ref, t_base = run(base, prompts, args.max_tokens)
        got, t_spec = run(fast, prompts, args.max_tokens, spec["method"], keep_gate=args.keep_gate)
        if args.repeats > 1:  # the two arms alternate, so a change in the host's speed hits both alike
            walls = {"base": [t_base], "spec": [t_spec]}
            for _ in range(args.repeats - 1):
                walls["base"].append(run(base, prompts, args.max_tokens, warm=False)[1])
                walls["spec"].append(run(fast, prompts, args.max_tokens, spec["method"], warm=False, keep_gate=args.keep_gate)[1])
            t_base, t_spec = statistics.median(walls["base"]), statistics.median(walls["spec"])
            ratios = sorted(b_ / s_ for b_, s_ in zip(walls["base"], walls["spec"]))
            print(f"      {args.repeats} runs of each: medians below; speedup of each pair {ratios[0]:.2f}x-{ratios[-1]:.2f}x")
        tokens = sum(len(o.outputs[0].token_ids) for o in ref)
        drafts = sum(o.metrics.num_draft_tokens for o in got)
        accepted = sum(o.metrics.num_accepted_tokens for o in got)
        decode_tokens = tokens - b  # the first token of each request comes from its prefill
        steps = decode_tokens - accepted  # decode steps summed over requests
        same = all(a.outputs[0].token_ids == c.outputs[0].token_ids for a, c in zip(ref, got))
        per_tok = lambda wall: 1000 * wall * b / tokens  # noqa: E731 - ms per token each request sees
        print(
            f"{b:>5} {per_tok(t_base):>11.2f} {per_tok(t_spec):>11.2f} {tokens / t_base:>10.1f} {tokens / t_spec:>10.1f} "
            f"{t_base / t_spec:>6.2f}x "
            f"{accepted / max(drafts, 1):>6.1%} {decode_tokens / max(steps, 1):>8.2f} {same}"
        )
        gate = fast.engine.scheduler.draft_gate
        print("      draft gate, ms per token (decaying: the last steps weigh most): "
              + ", ".join(f"{'with' if k else 'without'} drafts {1000 * v:.1f}" for k, v in gate.costs.items())
              + "; steps measured and their mean ms: "
              + ", ".join(f"{'with' if k else 'without'} {n} x {1000 * t / max(n, 1):.2f}" for k, (t, n) in gate.totals.items()))
        if args.phases:
            for name, llm, method in (("base", base, None), ("spec", fast, spec["method"])):
                print(f"      {name} phases, ms per step: {phase_times(llm, prompts, args.max_tokens, method, name)}")


def phase_times(llm, prompts, max_tokens: int, method: str | None, name: str = "") -> str:
    """One more timed run with the engine's phases timed per step (host clock), and the GPU's
    kernel time per step from a second run under the torch profiler (CUDA only)."""
    import collections

    import torch

    from slotrunner.core_runner.runner import async_output, model_runner

    engine = llm.engine
    runner = engine.runner
    totals: dict[str, float] = collections.defaultdict(float)
    each: dict[str, list[float]] = collections.defaultdict(list)  # every call's seconds: medians, past the pauses
    steps = [0]
    starts: list[float] = []  # each schedule()'s start: a step's period is the gap to the next
    wrapped = [
        (engine.scheduler, "schedule"), (engine.scheduler, "update"), (runner, "execute_model"),
        (runner, "sample_tokens"), (engine, "_process"), (async_output.AsyncOutput, "get"),
    ]  # fmt: skip
    # Parts of execute_model and sample_tokens (shown after "|": each is inside one of the above).
    parts_of_steps = [
        (runner, "_update_states"), (model_runner, "prepare_inputs"), (runner.model, "compute_logits"),
        (runner, "_sample"), (model_runner, "verify_and_update"), (model_runner, "post_update"),
        (async_output.AsyncOutput, "__init__"),
    ]  # fmt: skip
    if runner.cuda_graphs is not None:
        parts_of_steps.append((runner.cuda_graphs, "run"))
    if runner.speculator is not None:
        parts_of_steps.append((runner.speculator, "propose"))
    wrapped += parts_of_steps

    def timed(name, fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                totals[name] += time.perf_counter() - t0
                each[name].append(time.perf_counter() - t0)
                if name == "schedule":
                    steps[0] += 1
                    starts.append(t0)

        return call

    originals = [(owner, attr, getattr(owner, attr)) for owner, attr in wrapped]
    for owner, attr, fn in originals:
        setattr(owner, attr, timed(attr, fn))
    try:
        _, wall = run(llm, prompts, max_tokens, method)
        totals.clear()
        each.clear()
        steps[0] = 0
        starts.clear()
        t0 = time.perf_counter()
        run(llm, prompts, max_tokens, method)  # two generate() calls: every figure covers both
        wall = time.perf_counter() - t0
    finally:
        for owner, attr, fn in originals:  # the class's own method back; instances drop their wrapper
            if isinstance(owner, type) or type(owner).__name__ == "module":
                setattr(owner, attr, fn)
            else:
                delattr(owner, attr)
    n = max(steps[0], 1)
    # get() runs inside _process's caller (_settle) and update inside _process: shown apart.
    totals["_process"] -= totals["update"]
    inner = {attr for _, attr, in parts_of_steps}
    parts = [f"{steps[0]} steps, wall {1000 * wall / n:.3f}"] + [
        f"{k} {1000 * v / n:.3f}" for k, v in totals.items() if k not in inner
    ]
    parts += ["| " + ", ".join(f"{k} {1000 * v / n:.3f}" for k, v in totals.items() if k in inner)]
    parts += ["| medians of a call: " + ", ".join(f"{k} {1000 * statistics.median(v):.3f}" for k, v in each.items())]
    if len(starts) > 2:  # slow steps (a pause, a compile, an allocation) weigh on the means above
        import numpy as np

        gaps = 1000 * np.diff(np.asarray(starts))
        p50 = float(np.median(gaps))
        parts.append(
            f"| step period median {p50:.3f}, p90 {np.percentile(gaps, 90):.3f}, max {gaps.max():.3f}, "
            f"time over 3x the median {float(np.clip(gaps - 3 * p50, 0, None).sum()):.1f} ms"
        )
    if method is not None:  # where the speculating step's host time goes, by function (cProfile inflates it)
        import cProfile
        import pstats

        host = cProfile.Profile()
        host.runcall(run, llm, prompts, max_tokens, method)
        print(f"      --- host profile of the {name} run's two generate() calls ({steps[0]} steps before), by own time")
        pstats.Stats(host).sort_stats("tottime").print_stats(30)
    if torch.cuda.is_available():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run(llm, prompts, max_tokens, method)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels = sum(e.self_device_time_total for e in events) / 1e3  # ms, both generate() calls of run()
        parts.append(f"GPU kernels {kernels / n:.3f}")
        # Where the host waits or pays the driver: the CUDA runtime calls of one more run, by
        # total host time (a call that blocks on earlier GPU work shows as a long one).
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            run(llm, prompts, max_tokens, method)
            torch.cuda.synchronize()
        calls = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cu")]
        by_name: dict[str, list[float]] = collections.defaultdict(list)
        for e in calls:
            by_name[e.name].append(e.cpu_time_total / 1e3)  # ms
        top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
        print(f"      --- {name} run, CUDA runtime calls per step (host ms: total / count / longest)")
        for call, ms in top:
            print(f"         {call:<40} {sum(ms) / n:8.3f} {len(ms) / n:6.1f} {max(ms):8.3f}")
    return ", ".join(parts)


def qwen3_shape_dir(seed: int = 0, num_layers: int = 28) -> str:
    """A random-weight checkpoint of Qwen3-0.6B's shape (benchmarks/throughput.py's workload), or
    of its first `num_layers` layers' depth."""
    import tempfile

    from transformers import Qwen3Config

    from slotrunner.conformance import build_case

    config = Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=num_layers, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True,
        torch_dtype="bfloat16", architectures=["Qwen3ForCausalLM"],
    )
    directory = tempfile.mkdtemp(prefix="qwen3_shape_")
    build_case(config, directory, seed=seed)
    return directory


if __name__ == "__main__":
    main()
