"""Peak extra memory and time of prompt logprobs, by prompt length.

For each prompt length, two fresh processes prefill the same random prompt through a model with
a large vocabulary: one without prompt logprobs, one with `prompt_logprobs=5`. The difference in
peak memory (GPU: torch's peak allocation; CPU: the process's peak RSS) is the extra memory that
prompt logprobs cost. A full [prompt_len, vocab] log-softmax would grow linearly (32K x 32K
floats = 4 GiB); the chunked computation should stay flat.

    python benchmarks/prompt_logprobs_memory.py                      # CPU, 2K..32K, vocab 32768
    python benchmarks/prompt_logprobs_memory.py --device cuda --vocab 151936
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def child(args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig

    from slotrunner import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        LlamaConfig(
            vocab_size=args.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=args.length + 16,
            architectures=["LlamaForCausalLM"],
        ).save_pretrained(d)
        llm = LLM(d, device=args.device, dtype="float32", load_format="dummy", max_model_len=args.length + 8,
                  max_num_seqs=1, max_num_batched_tokens=args.budget, num_kv_blocks=(args.length + 64) // 16 + 1)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, args.vocab, (args.length,), generator=g).tolist()
        sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5 if args.with_logprobs else None)
        if args.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.max_memory_allocated()
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if args.with_logprobs:
            assert len(out.prompt_logprobs) == args.length and out.prompt_logprobs[0] is None
        peak_mb = (
            (torch.cuda.max_memory_allocated() - base) / 2**20
            if args.device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        )
        print(json.dumps({"peak_mb": peak_mb, "seconds": seconds, "rss_before_mb": rss_before / 1024}))


def run_child(args: argparse.Namespace, length: int, with_logprobs: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", "--length", str(length), "--vocab", str(args.vocab), "--device",
           args.device, "--budget", str(args.budget), "--threads", str(args.threads)]
    if with_logprobs:
        cmd.append("--with-logprobs")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--device", default="cpu")
    p.add_argument("--budget", type=int, default=1024, help="max_num_batched_tokens (chunked prefill)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--with-logprobs", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    full_gib = lambda n: n * args.vocab * 4 / 2**30  # noqa: E731 - what one fp32 [n, vocab] matrix costs
    print(f"prompt logprobs (k=5), vocab {args.vocab}, {args.device}, chunked prefill budget {args.budget}")
    print(f"{'prompt':>8} {'base peak MB':>13} {'with MB':>9} {'extra MB':>9} {'full matrix MB':>15} {'base s':>8} {'with s':>8}")
    for length in [int(x) for x in args.lengths.split(",")]:
        base = run_child(args, length, False)
        with_lp = run_child(args, length, True)
        extra = with_lp["peak_mb"] - base["peak_mb"]
        print(f"{length:>8} {base['peak_mb']:>13.0f} {with_lp['peak_mb']:>9.0f} {extra:>9.0f} "
              f"{full_gib(length) * 1024:>15.0f} {base['seconds']:>8.2f} {with_lp['seconds']:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
