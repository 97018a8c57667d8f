"""KV-cache groups on vs off: how many 8K-token requests one KV budget holds at once.

For a Gemma-3-12B-shaped and a GPT-OSS-20B-shaped model (the published configs' attention
shapes, built on the meta device: no weights, no memory), the engine's own code sizes the KV
cache in a fixed budget (`default_num_kv_blocks` over the model's KV-cache groups,
`kv_cache_layout`), and the engine's `Scheduler` with its `BlockManager` then runs a workload
of requests that each reach 8K tokens (a prompt of 8192 - O tokens, O output tokens), with a
stand-in for the model that samples one token per finished row. What is measured is the most
requests decoding at once (their whole prompt in the cache), the preemptions it took, and the
blocks: nothing here is a formula of the saving, only the engine's accounting at work.

    python benchmarks/kv_cache_groups.py                  # both shapes, 16 GiB of bf16 KV, 8K context
    python benchmarks/kv_cache_groups.py --budget-gib 40 --context 32768
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

GEMMA3_12B = dict(  # google/gemma-3-12b-it's text config: 5 sliding (1024) : 1 full
    architecture="Gemma3ForCausalLM", config_class="Gemma3TextConfig", vocab_size=262208, hidden_size=3840,
    intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
    query_pre_attn_scalar=256, sliding_window=1024,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)],
)
GPT_OSS_20B = dict(  # openai/gpt-oss-20b: sliding (128) and full layers alternating
    architecture="GptOssForCausalLM", config_class="GptOssConfig", vocab_size=201088, hidden_size=2880,
    intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
    num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
    layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
)
SHAPES = {"Gemma-3-12B": GEMMA3_12B, "GPT-OSS-20B": GPT_OSS_20B}


def meta_model(shape: dict) -> torch.nn.Module:
    """The registered model class built from the shape's config on the meta device."""
    import transformers

    from slotrunner.registry import resolve

    fields = {k: v for k, v in shape.items() if k not in ("architecture", "config_class")}
    config = getattr(transformers, shape["config_class"])(max_position_embeddings=131072, **fields)
    arch = resolve(config, shape["architecture"])
    with torch.device("meta"):
        return arch.model_cls(config)


def sized_config(model: torch.nn.Module, hybrid: bool, args: argparse.Namespace):
    """The engine's config for this model with the KV cache sized as the engine builder sizes it."""
    from slotrunner.builder import default_num_kv_blocks
    from slotrunner.core_runner.config import EngineConfig
    from slotrunner.core_runner.runner.kv_cache import kv_cache_layout

    config = EngineConfig(
        model="meta", device=torch.device("cpu"), dtype=torch.bfloat16, max_model_len=args.context,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, block_size=16,
        num_kv_blocks=None, vocab_size=1000, enable_prefix_caching=True, kv_cache_windows=kv_cache_layout(model, hybrid).windows,
    )  # fmt: skip
    num_blocks = default_num_kv_blocks(model, config, kv_cache_memory_bytes=int(args.budget_gib * 2**30))
    return dataclasses.replace(config, num_kv_blocks=num_blocks)


def measure(model: torch.nn.Module, hybrid: bool, args: argparse.Namespace, num_requests: int) -> dict:
    from slotrunner.core_runner.engine.request import Request
    from slotrunner.core_runner.engine.scheduler import Scheduler
    from slotrunner.core_runner.runner.kv_cache import kv_cache_layout
    from slotrunner.core_runner.runner.outputs import ModelRunnerOutput
    from slotrunner.sampling_params import SamplingParams

    layout = kv_cache_layout(model, hybrid)
    config = sized_config(model, hybrid, args)
    num_blocks = config.num_kv_blocks
    sched = Scheduler(config, prefix_caching=True)
    prompt_len = args.context - args.output_len
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(num_requests):
        tokens = [3 + (i * 7919 + k) % 997 for k in range(prompt_len)]  # distinct prompts: no prefix hits
        sched.add_request(Request(f"r{i}", tokens, params, eos_token_ids=(), arrival=i, seed=i))
    most_decoding, most_running, steps, start = 0, 0, 0, time.perf_counter()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        # The model's stand-in: a row whose step reaches its last known token samples one.
        req_ids = list(out.num_scheduled_tokens)
        rows = [sched._requests.get(r) for r in req_ids]
        sampled = [[7] if r is not None and r.num_computed_tokens >= r.num_tokens else [] for r in rows]
        sched.update(out, ModelRunnerOutput(req_ids, sampled))
        decoding = sum(r.num_computed_tokens >= len(r.prompt_token_ids) for r in sched.running)
        most_decoding, most_running = max(most_decoding, decoding), max(most_running, len(sched.running))
        steps += 1
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    return dict(
        groups=len(layout.groups), tensors=layout.num_tensors, num_blocks=num_blocks,
        block_mib=layout.bytes_per_block(16, torch.bfloat16) / 2**20, decoding=most_decoding, running=most_running,
        preemptions=sched.num_preemptions, steps=steps, seconds=time.perf_counter() - start,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-gib", type=float, default=16.0, help="KV-cache budget (bf16)")
    p.add_argument("--context", type=int, default=8192, help="tokens each request reaches (prompt + output)")
    # Long enough that requests live far longer than the ~4 steps each takes to prefill: then the
    # number at once is bound by the KV cache, not by how fast the step budget admits them.
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--num-requests", type=int, default=None, help="default: twice what the cache can hold")
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = p.parse_args()
    print(f"KV budget {args.budget_gib:g} GiB bf16, block_size 16, {args.context}-token requests "
          f"({args.context - args.output_len} prompt + {args.output_len} out), {args.max_num_batched_tokens}-token steps")  # fmt: skip
    print("| model shape | KV-cache groups | groups x tensors | blocks | MiB / block | most decoding at once "
          "| preemptions | steps |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name in args.shapes:
        model = meta_model(SHAPES[name])
        results = {}
        # Enough requests to fill either cache twice over (a request holds at least its
        # full-attention blocks, context / 16 of them).
        num_requests = args.num_requests or max(8, 2 * sized_config(model, True, args).num_kv_blocks // (args.context // 16))
        for hybrid in (False, True):
            r = results[hybrid] = measure(model, hybrid, args, num_requests)
            print(f"| {name} | {'on' if hybrid else 'off'} | {r['groups']} x {r['tensors']} | {r['num_blocks']} | "
                  f"{r['block_mib']:.2f} | {r['decoding']} | {r['preemptions']} | {r['steps']} |", flush=True)  # fmt: skip
        print(f"<!-- {name}: groups on hold {results[True]['decoding'] / results[False]['decoding']:.2f}x the requests -->")


if __name__ == "__main__":
    main()
