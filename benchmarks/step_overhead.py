"""Host time per decode step, with the model forward replaced by a no-op (CPU or GPU).

Everything a step does besides the model runs as usual: scheduling, slot bookkeeping, input
staging and preparation, logits of a small vocabulary, sampling, the output copy and the update
of the scheduler and the outputs. Requests are all in decode (short prompts, EOS ignored), so
each step has exactly `batch` rows. Steps run eagerly: a CUDA-graph replay would replace the
model call, which is what is cut out here.

    python benchmarks/step_overhead.py --device cuda --batch-sizes 1,8,64,256,512
    python benchmarks/step_overhead.py --device cpu
    OMP_NUM_THREADS=1 python benchmarks/step_overhead.py --device cpu --clock thread --profile 30

`--clock thread` counts the CPU time of the main thread instead of wall time: on a shared
machine other work then moves the figures less (on a GPU it hides time spent waiting for it).
`--profile N` prints the N functions with the most own time over the timed steps (cProfile;
its overhead inflates the step times printed beside it).

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

# A small Qwen3-shaped config: only its sizes matter (the forward never runs).
CONFIG = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=1024, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
)


def measure(
    model_dir: str, device: str, batch: int, steps: int, clock=time.perf_counter, profile: cProfile.Profile | None = None
) -> dict[str, float]:
    from slotrunner import LLM, SamplingParams

    llm = LLM(model_dir, device=device, dtype="float32", load_format="dummy", max_model_len=1024,
              max_num_seqs=batch, max_num_batched_tokens=max(2048, 8 * batch), enforce_eager=True)
    engine, runner = llm.engine, llm.engine.runner
    hidden = torch.zeros(runner.config.max_num_batched_tokens, CONFIG["hidden_size"], device=device)
    runner.model.forward = lambda input_ids, positions, inputs_embeds=None, **kw: hidden[: input_ids.shape[0]]
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 50, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": [1 + (i + j) % 1000 for j in range(8)]}, sp)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(5):  # prefill, then warm decode steps
        engine.step()
    parts: dict[str, list[float]] = {"schedule": [], "prepare+forward": [], "sample+copy": [], "update": [], "total": []}
    if profile is not None:
        profile.enable()
    for _ in range(steps):
        sync()
        t0 = clock()
        sched = engine.scheduler.schedule()
        t1 = clock()
        runner.execute_model(sched)
        t2 = clock()
        out = runner.sample_tokens().get()
        t3 = clock()
        engine._process(sched, out, final_only=True)  # scheduler update + output processing
        t4 = clock()
        assert len(sched.num_scheduled_tokens) == batch and all(n == 1 for n in sched.num_scheduled_tokens.values())
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
            parts[k].append(1e3 * v)
    if profile is not None:
        profile.disable()
    return {k: statistics.median(v) for k, v in parts.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-sizes", default="1,8,32,64,128,256,512")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--clock", choices=("wall", "thread"), default="wall", help="thread: CPU time of the main thread")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print the N functions with the most own time, per batch size")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    rows = []
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(CONFIG))
        for b in sizes:
            profile = cProfile.Profile() if args.profile else None
            rows.append(dict(batch=b, **measure(d, args.device, b, args.steps, clock, profile)))
            if profile is not None:
                print(f"--- batch {b}: {args.steps} steps")
                pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    what = "CPU time of the main thread" if args.clock == "thread" else "wall time"
    print(f"host time per decode step, model forward replaced by a no-op; {name}, {what}, median of {args.steps} steps, ms")
    print(f"{'batch':>6} {'total':>8} {'schedule':>9} {'prepare':>9} {'sample':>8} {'update':>8}")
    for r in rows:
        print(f"{r['batch']:>6} {r['total']:>8.3f} {r['schedule']:>9.3f} {r['prepare+forward']:>9.3f} "
              f"{r['sample+copy']:>8.3f} {r['update']:>8.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
