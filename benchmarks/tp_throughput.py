"""Tensor parallelism: throughput and batch-1 latency at TP=1 and TP=2, in one process run.

GPU (the default): a Llama-3-8B-shaped model (32 layers, hidden 4096, 32 heads / 8 KV heads,
head_dim 128, MLP 14336, vocab 128256, untied) with random bf16 weights (`load_format="dummy"`;
each rank draws its own shard, so TP=1 and TP=2 hold different random weights and their tokens
are not compared), on two GPUs of one host:

- the bench workload (TARGETS.md): 256 requests, input and output lengths each uniform in
  [100, 1024] (seeded), random token ids, EOS ignored; output tokens / wall seconds, prefill
  included;
- batch 1: one request of 128 prompt tokens; time per output token after the first
  ((time for N tokens - time for 1 token) / (N - 1)).

Goals (issue #20): TP=2 throughput >= 1.7x TP=1, batch-1 time per token at TP=2 <= 0.65x TP=1.
What bounds TP=2 is the all-reduces: two per layer plus the embedding's and the logits'
gather, 2 * num_layers + 2 per step; the script prints that count beside each figure.

`--tiny`: a tiny Llama saved to a temporary directory, run on the CPU in float32 (two gloo
processes), a small workload; the greedy tokens of TP=1 and TP=2 are compared (same weights).

    python benchmarks/tp_throughput.py                 # GPU, needs 2 GPUs
    python benchmarks/tp_throughput.py --tiny          # CPU smoke run
    python benchmarks/tp_throughput.py --num-requests 64 --tp 2

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from contextlib import contextmanager

import numpy as np


def llama3_8b_config() -> dict:
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        hidden_act="silu", attention_bias=False, mlp_bias=False, torch_dtype="bfloat16", bos_token_id=128000,
        eos_token_id=128001,
    )  # fmt: skip


def workload(n: int, seed: int, lo: int, hi: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    """The bench workload's draw (benchmarks/throughput.py), with ids below `vocab`."""
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(lo, hi + 1, n)
    out_lens = rng.integers(lo, hi + 1, n)
    return [rng.integers(0, vocab, k).tolist() for k in in_lens], [int(x) for x in out_lens]


def model_dir(args: argparse.Namespace, work: str) -> str:
    if args.tiny:  # real (saved) random weights: TP=1 and TP=2 must agree token for token
        from slotrunner.conformance import build_case
        from slotrunner.registry import tiny_config

        build_case(tiny_config("LlamaForCausalLM", tie_word_embeddings=False, max_position_embeddings=256), work)
        return work
    with open(f"{work}/config.json", "w") as f:
        json.dump(llama3_8b_config(), f)
    return work


def run(directory: str, tp: int, prompts, out_lens, args) -> dict:
    from slotrunner import LLM, SamplingParams

    device = "cpu" if args.tiny else "cuda"
    engine = dict(device=device, dtype="float32" if args.tiny else "bfloat16", max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, load_format="auto" if args.tiny else "dummy")  # fmt: skip
    if args.tiny:
        engine["num_kv_blocks"] = 256
    t0 = time.perf_counter()
    llm = LLM(directory, tensor_parallel_size=tp, **engine)
    startup = time.perf_counter() - t0
    import torch

    threads = torch.get_num_threads()  # on CPU each of the tp ranks takes 1/tp of the threads
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], greedy(8), use_tqdm=False)  # warm-up
    sync()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy(m) for m in out_lens], use_tqdm=False)
    sync()
    wall = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    one = {"prompt_token_ids": prompts[0][: args.batch1_prompt]}
    times = {}
    for n in (1, args.batch1_tokens):
        sync()
        t = time.perf_counter()
        with collective_timer(args.tiny and tp > 1) as spent:
            llm.generate(one, greedy(n), use_tqdm=False)
        sync()
        times[n] = time.perf_counter() - t
    per_token = (times[args.batch1_tokens] - times[1]) / (args.batch1_tokens - 1)
    # Batch 1 makes one step per token: the collectives' share of a decode step (CPU: host-timed).
    collective_ms = spent["s"] * 1e3 / args.batch1_tokens if spent else None
    ids = [list(o.outputs[0].token_ids) for o in outs]
    layers = llm.engine.runner.model.args.num_layers
    llm.close()
    del llm
    from slotrunner.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    return dict(tp=tp, out_tokens=n_out, wall_s=round(wall, 3), tokens_per_s=round(n_out / wall, 1),
                batch1_ms_per_token=round(per_token * 1e3, 3), collectives_per_step=0 if tp == 1 else 2 * layers + 2,
                batch1_collective_ms_per_step=None if collective_ms is None else round(collective_ms, 3),
                startup_s=round(startup, 1), cpu_threads_per_rank=threads if args.tiny else None, ids=ids)  # fmt: skip


@contextmanager
def collective_timer(on: bool):
    """Wall time rank 0 spends in the group's collectives and the step broadcast while inside.
    Only where collectives run on the host (gloo, `--tiny`): on GPUs NCCL calls return before
    the transfer ends and CUDA graphs replay without calling them (use a profiler there)."""
    if not on:
        yield {}
        return
    from slotrunner.core_runner.distributed.parallel_state import TensorParallelGroup

    spent = {"s": 0.0}
    originals = {name: getattr(TensorParallelGroup, name) for name in ("all_reduce", "all_gather", "broadcast_step")}

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent["s"] += time.perf_counter() - t

        return wrapper

    for name, fn in originals.items():
        setattr(TensorParallelGroup, name, timed(fn))
    try:
        yield spent
    finally:
        for name, fn in originals.items():
            setattr(TensorParallelGroup, name, fn)


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a tiny Llama on the CPU (two gloo processes)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes to run")
    p.add_argument("--num-requests", type=int, default=None, help="default 256 (GPU), 16 (--tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--batch1-prompt", type=int, default=None, help="batch-1 prompt tokens; default 128 (GPU), 16 (--tiny)")
    p.add_argument("--batch1-tokens", type=int, default=None, help="batch-1 output tokens; default 128 (GPU), 32 (--tiny)")
    args = p.parse_args()
    lo, hi = (8, 48) if args.tiny else (100, 1024)
    args.num_requests = args.num_requests or (16 if args.tiny else 256)
    args.batch1_prompt = args.batch1_prompt or (16 if args.tiny else 128)
    args.batch1_tokens = args.batch1_tokens or (32 if args.tiny else 128)
    args.max_model_len = 2 * hi + 16
    with tempfile.TemporaryDirectory(prefix="slotrunner-tp-bench-") as work:
        directory = model_dir(args, work)
        vocab = 1000 if args.tiny else llama3_8b_config()["vocab_size"]
        prompts, out_lens = workload(args.num_requests, args.seed, lo, hi, vocab)
        shape = "tiny Llama, CPU float32" if args.tiny else "Llama-3-8B shape, random bf16"
        print(f"{args.num_requests} requests, in/out lengths uniform in [{lo}, {hi}]; {shape}", flush=True)
        results = [run(directory, tp, prompts, out_lens, args) for tp in args.tp]
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k != "ids"}), flush=True)
    base = results[0]
    for r in results[1:]:
        same = "n/a (random dummy weights per rank)" if not args.tiny else r["ids"] == base["ids"]
        print(f"TP={r['tp']} vs TP={base['tp']}: throughput x{r['tokens_per_s'] / base['tokens_per_s']:.2f}, batch-1 "
              f"time per token x{r['batch1_ms_per_token'] / base['batch1_ms_per_token']:.2f}, greedy ids equal: {same}")


if __name__ == "__main__":
    main()
