"""Prefix caching on a shared-prefix workload: caching on vs off, in the same process run.

The workload (TARGETS.md): N requests sharing one system prompt of P tokens, each followed by
100-400 unique tokens (seeded), O output tokens each, EOS ignored, random token ids. On a GPU
the model is the bench workload's Qwen3-0.6B shape with random bf16 weights; on a CPU a tiny
Llama, or with `--model bamba` a tiny Bamba (Mamba2 mixers with attention at one layer in four:
its hits also restore a recurrent-state checkpoint), the shape printed. Reported per setting:
wall time, output tokens/s, mean time to first token, and the prefix-cache hit rate (prompt
tokens served from the cache / prompt tokens).

TTFT is measured the way an offline user sees it: all requests are submitted at once, and a
request's first token is the first engine step that returns output for it.

    python benchmarks/prefix_caching.py                          # GPU: 256 x (2000 + 100..400) / 128
    python benchmarks/prefix_caching.py --device cpu --num-requests 16 --prefix-len 256 --max-tokens 16
    python benchmarks/prefix_caching.py --device cpu --model bamba --num-requests 16 --prefix-len 512 --max-tokens 16

This is a benchmark, not a test: it asserts nothing about speed. It does check that both
settings generate the same tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def tiny_llama_config() -> dict:
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=4096, hidden_size=256,
        intermediate_size=704, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True, torch_dtype="float32",
        bos_token_id=1, eos_token_id=2,
    )


def tiny_bamba_config() -> dict:
    """The tiny Llama's width and vocabulary as a Bamba: 3 Mamba2 layers and 1 attention layer."""
    from transformers import BambaConfig

    cfg = BambaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4, attn_layer_indices=[2],
        num_attention_heads=8, num_key_value_heads=4, mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=64, mamba_chunk_size=64, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ).to_dict()
    return cfg | dict(architectures=["BambaForCausalLM"], torch_dtype="float32")


def workload(n: int, prefix_len: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, vocab, prefix_len).tolist()
    return [prefix + rng.integers(3, vocab, int(k)).tolist() for k in rng.integers(lo, hi + 1, n)]


def run(model_dir: str, prompts: list[list[int]], args, caching: bool, cascade: bool = True) -> dict:
    from slotrunner import LLM, SamplingParams

    kwargs = dict(device=args.device, load_format="dummy", max_model_len=args.prefix_len + args.max_unique + args.max_tokens + 16,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  enable_prefix_caching=caching, disable_cascade_attn=not cascade)
    if args.device == "cuda":
        kwargs["dtype"] = "bfloat16"
    llm = LLM(model_dir, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    # Warm-up over the workload's shapes (long prefills, then a prefix hit: every kernel
    # compiled before the clock starts), with other tokens; the cache is emptied after it.
    warm = workload(2, args.prefix_len, args.max_unique, args.max_unique, max(map(max, prompts)) + 1, args.seed + 1)
    for p in warm:
        llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    llm.reset_prefix_cache()
    engine = llm.engine
    shared_steps = []  # decode steps that read the shared prefix once for all rows
    engine.runner.add_step_observer(lambda batch, _: shared_steps.append(batch.shared_prefix_len > 0))
    ids = [f"bench-{i}" for i in range(len(prompts))]
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    first: dict[str, float] = {}
    done: dict[str, object] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            now = time.perf_counter()
            if out.outputs[0].token_ids:
                if out.request_id not in first:
                    first[out.request_id] = now - t0
                    prefill_steps = steps  # the step that gave the last request its first token
            if out.finished:
                done[out.request_id] = out
    sync()
    wall = time.perf_counter() - t0
    outs = [done[r] for r in ids]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    row = dict(caching=caching, cascade=cascade, shared_steps=sum(shared_steps), wall_s=wall, out_tokens=n_out, tok_s=n_out / wall,
               mean_ttft_s=float(np.mean([first[r] for r in ids])),
               hit_rate=cached / sum(len(p) for p in prompts),
               all_first_s=max(first.values()), prefill_steps=prefill_steps, steps=steps,
               tokens=[o.outputs[0].token_ids for o in outs])
    del llm, engine
    gc.collect()  # the engine's reference cycles hold its GPU memory until collected
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=["llama", "bamba"], default="llama", help="the CPU model's family (tiny shapes)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prefix-len", type=int, default=2000)
    p.add_argument("--min-unique", type=int, default=100)
    p.add_argument("--max-unique", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()

    if args.device == "cuda":
        from throughput import qwen3_06b_config  # the bench workload's model shape

        cfg = qwen3_06b_config()
    else:
        cfg = tiny_bamba_config() if args.model == "bamba" else tiny_llama_config()
    prompts = workload(args.num_requests, args.prefix_len, args.min_unique, args.max_unique, cfg["vocab_size"], args.seed)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"shared-prefix workload: {args.num_requests} requests x ({args.prefix_len} shared + "
          f"{args.min_unique}..{args.max_unique} unique tokens), {args.max_tokens} out; {cfg['architectures'][0]} "
          f"{cfg['num_hidden_layers']} layers x {cfg['hidden_size']}, {where}, torch {torch.__version__}")
    print(f"{'prefix caching':<22} {'seconds':>9} {'out tok/s':>10} {'mean TTFT s':>12} {'hit rate':>9} "
          f"{'last TTFT s':>11} {'steps to it':>11} {'steps':>6} {'shared-prefix steps':>20}", flush=True)
    # On a GPU, also caching on with every row reading the shared prefix itself (the attention
    # backend's shared-prefix launch off: disable_cascade_attn); the CPU backends have no such launch.
    settings = [("off", False, True), ("on", True, True)] + ([("on, no shared launch", True, False)] if args.device == "cuda" else [])
    rows = []
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        for name, caching, cascade in settings:
            row = run(d, prompts, args, caching, cascade)
            rows.append(row)
            print(f"{name:<22} {row['wall_s']:>9.2f} {row['tok_s']:>10.0f} "
                  f"{row['mean_ttft_s']:>12.3f} {row['hit_rate']:>9.1%} {row['all_first_s']:>11.3f} "
                  f"{row['prefill_steps']:>11} {row['steps']:>6} {row['shared_steps']:>20}", flush=True)
    off, on = rows[:2]
    print(f"caching on: {on['tok_s'] / off['tok_s']:.2f}x throughput, {off['mean_ttft_s'] / on['mean_ttft_s']:.2f}x lower mean TTFT")
    if len(rows) > 2:
        print(f"the shared-prefix launch: {on['tok_s'] / rows[2]['tok_s']:.2f}x throughput of caching on without it")
    same = sum(a == b for a, b in zip(off["tokens"], on["tokens"]))
    print(f"generated tokens identical with caching on and off: {same}/{len(prompts)} requests")
    if len(rows) > 2:
        same = sum(a == b for a, b in zip(rows[2]["tokens"], on["tokens"]))
        print(f"generated tokens identical with and without the shared-prefix launch: {same}/{len(prompts)} requests")
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in rows], indent=1))


if __name__ == "__main__":
    main()
