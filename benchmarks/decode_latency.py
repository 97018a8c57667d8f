"""Batch-1 decode time per token on the Qwen3-0.6B shape (random bf16 weights), graphs vs eager.

One request, `--input-len` prompt tokens, `--output-len` new tokens, greedy, EOS ignored. The
decode time per token excludes the first token (prefill): (wall - time to first token) /
(output_len - 1). The weights-only floor is the time to read the weights once at the card's peak HBM bandwidth.
Engines in turn (`--modes`): CUDA graphs; graphs with plain launches (no programmatic dependent
launch: `core_runner/triton_utils.pdl_launch`); graphs with the K/V write in a launch
of its own (`triton_attn.FUSED_KV_WRITE` off: not in the rotary launch); graphs with every product through
cuBLAS (the skinny GEMM kernel off, and with it the norms and activations it fuses); eager.
`--rounds` runs the list that many times, alternating, and keeps each mode's best.

    python benchmarks/decode_latency.py --input-len 128 --output-len 512
    python benchmarks/decode_latency.py --modes graphs,no-pdl --rounds 3

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from throughput import hbm_bandwidth, qwen3_06b_config


# mode: (enforce_eager, skinny GEMM on, dependent launches, K/V written by the rotary launch)
MODES = {
    "graphs": (False, True, True, True),
    "no-pdl": (False, True, False, True),
    "own-kv-write": (False, True, True, False),
    "cublas": (False, False, True, True),
    "eager": (True, True, True, True),
}


def measure(model_dir: str, args: argparse.Namespace, mode: str) -> tuple[float, float]:
    from slotrunner import LLM, SamplingParams
    from slotrunner.core_runner import triton_utils
    from slotrunner.core_runner.attention import triton_attn
    from slotrunner.models.layers import skinny_gemm

    enforce_eager, skinny_gemm.ENABLED, triton_utils.PDL, triton_attn.FUSED_KV_WRITE = MODES[mode]

    llm = LLM(model_dir, device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=4096,
              max_num_seqs=8, enforce_eager=enforce_eager)
    prompt = {"prompt_token_ids": list(range(1000, 1000 + args.input_len))}
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    best_ttft, best_tpot = float("inf"), float("inf")
    engine = llm.engine
    for rep in range(args.repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        first = None
        engine.add_request(f"r{rep}", prompt, SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True))
        while engine.has_unfinished_requests():
            outs = engine.step()
            if first is None and outs:
                first = time.perf_counter() - t0
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        best_ttft = min(best_ttft, first)
        best_tpot = min(best_tpot, (wall - first) / (args.output_len - 1))
    del llm
    gc.collect()  # the engine's reference cycles hold its GPU memory until collected
    torch.cuda.empty_cache()
    return best_ttft, best_tpot


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="graphs,no-pdl,cublas,eager", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--rounds", type=int, default=1, help="run the modes this many times, alternating")
    args = p.parse_args()
    modes = args.modes.split(",")
    assert set(modes) <= set(MODES), f"modes: {', '.join(MODES)}"
    cfg = qwen3_06b_config()
    h, i, v, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    qkvo = h * (16 + 2 * 8) * 128 + 16 * 128 * h
    bandwidth, bandwidth_name = hbm_bandwidth()
    floor_ms = 1e3 * 2 * (L * (qkvo + 3 * h * i) + v * h) / bandwidth
    best = {m: (float("inf"), float("inf")) for m in modes}
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        for _ in range(args.rounds):
            for mode in modes:
                ttft, tpot = measure(d, args, mode)
                best[mode] = (min(best[mode][0], ttft), min(best[mode][1], tpot))
    rows = [(m, *best[m]) for m in modes]
    print(f"batch-1 decode, Qwen3-0.6B shape, bf16, {torch.cuda.get_device_name()}, {args.input_len} in / "
          f"{args.output_len} out, best of {args.repeats} x {args.rounds}; weights-only floor {floor_ms:.3f} ms/token at {bandwidth_name}")
    print(f"{'mode':<14} {'TTFT ms':>9} {'ms/token':>9}")
    for name, ttft, tpot in rows:
        print(f"{name:<14} {1e3 * ttft:>9.2f} {1e3 * tpot:>9.3f}")


if __name__ == "__main__":
    main()
