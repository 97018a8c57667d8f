"""GPU throughput of a mixture-of-experts model: slotrunner vs transformers `generate`.

The workload: 64 requests of 512 random prompt tokens, 256 output tokens each (EOS ignored),
on the Qwen3-30B-A3B shape (48 layers, hidden 2048, 32 heads / 4 KV heads, head_dim 128, 128
experts of 768, top-8 renormalised, QK-norm, vocab 151936) with random bf16 weights (about
61 GB: one H200 holds it, one system at a time). Metric: output tokens / wall seconds, prefill
included. slotrunner's experts run the fused MoE kernel (models/layers/fused_moe.py: two
grouped GEMMs per layer, decode steps replayed from CUDA graphs); transformers runs static
batches of `--hf-batch` requests, left-padded.

    python benchmarks/moe_throughput.py                         # both systems
    python benchmarks/moe_throughput.py --peers none            # slotrunner alone
    python benchmarks/moe_throughput.py --num-layers 8          # a shallower model, same layer shape
    python benchmarks/moe_throughput.py --shape deepseek-v2-lite  # MLA + 64 experts top-6, 27 layers
    python benchmarks/moe_throughput.py --peers none --router reference  # the router as separate torch launches
    python benchmarks/moe_throughput.py --peers none --full-warm-up  # the whole run once untimed first
    python benchmarks/moe_throughput.py --shape deepseek-v2-lite --peers none --kv-cache-dtype fp8

The last line printed counts the Triton kernels compiled inside the timed run (entries added to
Triton's kernel cache): a variant that the two-token warm-up never met is compiled there,
seconds of the run where the cache is cold (DeepSeek-V2-Lite on one H100 took 4.09 s in a
call whose earlier steps had served the same workload, and 6.62 s in one where they had not).

This is a benchmark, not a test: it asserts nothing about speed.
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

from throughput import compiled_since, hbm_bandwidth, triton_cache_entries, warm_up  # the workload's shapes once, untimed


def qwen3_30b_a3b_config(num_layers: int) -> dict:
    return dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=num_layers, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
        torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645,
    )  # fmt: skip


def deepseek_v2_lite_config(num_layers: int) -> dict:
    """DeepSeek-V2-Lite: multi-head latent attention (no q LoRA, latent 512 + rotary 64), the
    first layer dense, then 64 routed experts of 1408 top-6 plus 2 shared experts; YaRN."""
    return dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
        intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=num_layers, num_attention_heads=16,
        num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, head_dim=64, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy", n_group=1, topk_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=dict(type="yarn", rope_type="yarn", factor=40.0, beta_fast=32, beta_slow=1,
        mscale=0.707, mscale_all_dim=0.707, original_max_position_embeddings=4096), tie_word_embeddings=False,
        hidden_act="silu", attention_bias=False, torch_dtype="bfloat16", bos_token_id=100000, eos_token_id=100001,
    )  # fmt: skip


SHAPES = {"qwen3-30b-a3b": (qwen3_30b_a3b_config, 48), "deepseek-v2-lite": (deepseek_v2_lite_config, 27)}


def workload(n: int, in_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 100000, in_len).tolist() for _ in range(n)]


def decode_step_bytes(model: torch.nn.Module, batch: int) -> float:
    """Bytes a decode step of `batch` rows must read at least once: every weight outside the
    experts, plus the experts the batch is expected to route to (uniform routing: each of E
    experts is missed by one row's top-k with probability 1 - k/E). The embedding table is read
    per token, not whole: left out."""
    from slotrunner.models.layers.moe import SparseMoE

    total = 0.0
    for name, prm in model.named_parameters():
        if "embed" not in name:
            total += prm.numel() * prm.element_size()
    for m in model.modules():
        if isinstance(m, SparseMoE):
            e, k = m.gate.spec.num_experts, m.gate.spec.top_k
            expert_bytes = sum(p.numel() * p.element_size() for p in m.experts.parameters())
            total -= expert_bytes * (1 - k / e) ** batch  # the experts no row routes to
    return total


def run_slotrunner(model_dir: str, prompts: list[list[int]], out_len: int, args) -> dict:
    from slotrunner import LLM, SamplingParams
    from slotrunner.core_runner.triton_utils import compiles_counted

    t0 = time.perf_counter()
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=len(prompts[0]) + out_len + 8,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    warm_up(llm, [{"prompt_token_ids": p} for p in prompts], params if args.full_warm_up else None)
    step_bytes = decode_step_bytes(llm.engine.runner.model, len(prompts))
    torch.cuda.synchronize()
    compiled, keys = triton_cache_entries(), []
    with compiles_counted(keys) as variants:  # new variants of this process, whether or not the disk cache had them
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    compiled = compiled_since(compiled)
    for key in keys:
        print(f"  variant first launched inside the timed run: {key}"[:1200], flush=True)
    if variants:
        print(f"  {len(variants)} variants, {sum(t for _, t in variants):.2f} s to compile or load", flush=True)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == out_len * len(prompts), f"generated {n_out} tokens, requested {out_len * len(prompts)}"
    del llm
    gc.collect()  # the engine's reference cycles hold its GPU memory until collected
    torch.cuda.empty_cache()
    return dict(system="slotrunner", wall_s=wall, out_tokens=n_out, startup_s=startup, step_bytes=step_bytes,
                compiled_in_run=compiled)  # fmt: skip


def run_hf_generate(cfg: dict, prompts: list[list[int]], out_len: int, batch: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()
    t = time.perf_counter()
    for s in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[s : s + batch], device="cuda")  # equal lengths: no padding
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len, min_new_tokens=out_len,
                           do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    torch.cuda.synchronize()
    return dict(system=f"transformers generate (batch {batch})", wall_s=time.perf_counter() - t,
                out_tokens=out_len * len(prompts))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--num-layers", type=int, default=None, help="default: the shape's own depth")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's) or fp8 (e4m3; MLA: the latent cache)")
    p.add_argument("--full-warm-up", action="store_true",
                   help="warm up on the whole run, not two tokens a request: every step shape of the run compiled before it")
    p.add_argument("--peers", default="generate", help="generate, or none")
    p.add_argument("--hf-batch", type=int, default=64)
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--router", choices=("one-launch", "reference"), default="one-launch",
                   help="reference: the router's linear and select_experts as separate torch launches (moe_router.ONE_LAUNCH off)")
    args = p.parse_args()
    if args.router == "reference":
        from slotrunner.models.layers import moe_router

        moe_router.ONE_LAUNCH = False

    prompts = workload(args.num_requests, args.input_len, args.seed)
    make_config, depth = SHAPES[args.shape]
    args.num_layers = args.num_layers or depth
    cfg = make_config(args.num_layers)
    print(f"MoE workload: {args.num_requests} requests x {args.input_len} in / {args.output_len} out; {args.shape} "
          f"shape, {args.num_layers} layers, bf16, {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print(f"{'system':<36} {'seconds':>9} {'out tok/s':>10} {'slotrunner x':>13}", flush=True)
    rows = []

    def report(row: dict) -> None:
        row["tok_s"] = row["out_tokens"] / row["wall_s"]
        rows.append(row)
        print(f"{row['system']:<36} {row['wall_s']:>9.2f} {row['tok_s']:>10.0f} {rows[0]['tok_s'] / row['tok_s']:>13.2f}",
              flush=True)  # fmt: skip

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        report(run_slotrunner(d, prompts, args.output_len, args))
    ours = rows[0]
    bandwidth, bandwidth_name = hbm_bandwidth()
    floor = ours["step_bytes"] * args.output_len / bandwidth
    print(f"slotrunner engine start-up incl. graph capture {ours['startup_s']:.1f} s; decode floor (weights and active "
          f"experts read once a step, {ours['step_bytes'] / 1e9:.1f} GB, {args.output_len} steps at {bandwidth_name}) "
          f"{floor:.2f} s = {100 * floor / ours['wall_s']:.0f}% of wall; Triton kernels compiled inside the timed run: "
          f"{len(ours['compiled_in_run'])} {ours['compiled_in_run']}", flush=True)  # fmt: skip
    if args.peers == "generate":
        try:
            report(run_hf_generate(cfg, prompts, args.output_len, args.hf_batch))
        except Exception as e:  # a peer's API change must not hide our figure
            print(f"generate: failed: {type(e).__name__}: {e}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
