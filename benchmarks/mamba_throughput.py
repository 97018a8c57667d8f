"""Recurrent-hybrid throughput: slotrunner vs transformers `generate`, same random weights.

`--shape bamba` (default): a Bamba-shaped hybrid (Mamba2 mixers with attention every 4th layer,
411M params at 24 layers). `--shape qwen3-next`: a Qwen3-Next-shaped hybrid at reduced depth and
expert count (gated delta-net layers with gated full attention every 4th layer, a routed MoE of
64 experts top-10 plus a shared expert in every layer). `--shape llama`: a pure decoder with the
Bamba shape's hidden size, depth and MLP, the yardstick for the hybrid's decode step. Random
bf16 weights; random prompts; greedy, EOS ignored; output tokens / wall seconds, prefill
included.

    python benchmarks/mamba_throughput.py --device cuda --num-requests 64 --input-len 256 --output-len 256
    python benchmarks/mamba_throughput.py --shape qwen3-next --layers 12
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time

import torch

from throughput import warm_up  # the workload's shapes once, untimed


def model_config(args: argparse.Namespace):
    from transformers import BambaConfig, LlamaConfig, Qwen3NextConfig

    n = args.layers
    if args.shape == "llama":
        return LlamaConfig(
            vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=n, num_attention_heads=16,
            num_key_value_heads=8, max_position_embeddings=4096, tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"],
        )
    if args.shape == "qwen3-next":
        return Qwen3NextConfig(
            vocab_size=151936, hidden_size=2048, num_hidden_layers=n, num_attention_heads=16, num_key_value_heads=2,
            head_dim=256, layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)],
            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=10, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, intermediate_size=5632, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[], max_position_embeddings=4096, tie_word_embeddings=False,
            architectures=["Qwen3NextForCausalLM"],
        )
    return BambaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=n,
        num_attention_heads=16, num_key_value_heads=8, attn_layer_indices=list(range(3, n, 4)),
        mamba_n_heads=32, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=256, max_position_embeddings=4096, tie_word_embeddings=False,
        architectures=["BambaForCausalLM"],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=("bamba", "qwen3-next", "llama"), default="bamba")
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM

    from slotrunner import LLM, SamplingParams

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 32000, (args.num_requests, args.input_len), generator=g)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(model_config(args), dtype=dtype)
        hf.save_pretrained(d)
        params_m = sum(p.numel() for p in hf.parameters()) / 1e6
        llm = LLM(d, device=args.device, max_model_len=args.input_len + args.output_len + 8,
                  max_num_seqs=args.num_requests, max_num_batched_tokens=8192)
        sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        reqs = [{"prompt_token_ids": r.tolist()} for r in prompts]
        warm_up(llm, reqs)
        sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        outs = llm.generate(reqs, sp, use_tqdm=False)
        sync()
        ours = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append(("slotrunner", ours, n_out / ours))
        print(f"{args.shape} shape, {args.layers} layers, {params_m:.0f}M params, {dtype}, {args.device}; "
              f"{args.num_requests} requests x {args.input_len} in / {args.output_len} out, greedy")
        print(f"{'system':<24} {'seconds':>9} {'out tok/s':>11}")
        print(f"{'slotrunner':<24} {ours:>9.2f} {n_out / ours:>11.0f}", flush=True)  # before the peer, which may be slow
        del llm
        gc.collect()  # the engine's reference cycles hold its GPU memory until collected
        if not args.skip_hf:
            hf = hf.to(args.device).eval()
            ids = prompts.to(args.device)
            with torch.no_grad():
                hf.generate(ids[:2], max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
                sync()
                t = time.perf_counter()
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                                  min_new_tokens=args.output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
                sync()
            hf_s = time.perf_counter() - t
            rows.append(("transformers generate", hf_s, (out.shape[1] - args.input_len) * args.num_requests / hf_s))
            print(f"{'transformers generate':<24} {hf_s:>9.2f} {rows[-1][2]:>11.0f}")
            print(f"slotrunner / transformers: {rows[0][2] / rows[-1][2]:.2f}x")


if __name__ == "__main__":
    main()
