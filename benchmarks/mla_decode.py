"""Multi-head latent attention: cache bytes per token, and absorbed vs expanded decode.

1. Cache: the models built on the meta device (no memory) at DeepSeek-V3's shape (transformers'
   `DeepseekV3Config()` defaults: 61 layers, 128 heads, latent 512 + rope 64) and V2-Lite's
   (27 layers, 16 heads): bytes per token of the latent cache as the runner sizes it
   (`kv_bytes_per_block`), against K and V per head.
2. Decode: one query token per row over `--seq-len` cached tokens at V2-Lite's attention shape;
   the absorbed form (`mla_decode`: the Triton kernel on a GPU, its torch reference on CPU)
   against expanding every cached latent into per-head K/V (what prefill does). Both outputs
   are checked equal first.

    python benchmarks/mla_decode.py --rows 4 --seq-len 2048 --threads 1
    python benchmarks/mla_decode.py --rows 64 --seq-len 640 --kernel-splits 1,2,4,8,0 --repeats 200
    python benchmarks/mla_decode.py --rows 64 --seq-len 640 --kernel-splits 0 --cache-dtype bf16,fp8 --tile-n 16,32 --warps 4,8

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import time

import torch


def cache_bytes_per_token() -> None:
    import transformers

    from slotrunner.core_runner.runner.kv_cache import cache_layers, kv_bytes_per_block
    from slotrunner.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

    v2_lite = transformers.DeepseekV2Config(
        num_hidden_layers=27, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
        num_experts_per_tok=6, first_k_dense_replace=1,
    )  # fmt: skip
    for cls, c in ((DeepseekV3ForCausalLM, transformers.DeepseekV3Config()), (DeepseekV2ForCausalLM, v2_lite)):
        with torch.device("meta"):
            model = cls(c)
        latent = kv_bytes_per_block(model, 16, torch.bfloat16) // 16
        per_head = len(cache_layers(model)) * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * 2
        print(f"{cls.__name__}: {latent} B/token (bf16 latent cache) vs {per_head} B/token as K/V per head: {per_head / latent:.1f}x")


def decode(rows: int, seq_len: int, device: torch.device, repeats: int) -> None:
    from slotrunner.models.layers.mla_decode import mla_decode

    heads, rank, rope, nope, v, block = 16, 512, 64, 128, 128, 16
    gen = torch.Generator().manual_seed(0)
    num_blocks = rows * seq_len // block
    cache = torch.randn(num_blocks, block, rank + rope, generator=gen).to(device)
    block_tables = torch.randperm(num_blocks, generator=gen).view(rows, -1).int().to(device)
    seq_lens = torch.full((rows,), seq_len, dtype=torch.int32, device=device)
    w = (torch.randn(heads, nope + v, rank, generator=gen) * 0.05).to(device)
    q_nope = torch.randn(rows, heads, nope, generator=gen).to(device)
    q_pe = torch.randn(rows, heads, rope, generator=gen).to(device)
    scale = (nope + rope) ** -0.5

    def absorbed() -> torch.Tensor:
        q_lat = torch.einsum("thn,hnc->thc", q_nope, w[:, :nope])
        return torch.einsum("thc,hvc->thv", mla_decode(q_lat, q_pe, cache, block_tables, seq_lens, scale), w[:, nope:])

    def expanded() -> torch.Tensor:
        flat, pos, out = cache.view(-1, rank + rope), torch.arange(seq_len, device=device), []
        for i in range(rows):
            entries = flat[block_tables[i, pos // block].long() * block + pos % block]
            kv = torch.einsum("sc,hdc->hsd", entries[:, :rank], w)
            k = torch.cat([kv[..., :nope], entries[None, :, rank:].expand(heads, -1, -1)], dim=-1)
            q = torch.cat([q_nope[i], q_pe[i]], dim=-1)[:, None]
            out.append((torch.softmax(q @ k.transpose(1, 2) * scale, -1) @ kv[..., nope:])[:, 0])
        return torch.stack(out)

    torch.testing.assert_close(absorbed(), expanded(), atol=1e-3, rtol=1e-3)
    for f in (absorbed, expanded):
        f()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            f()
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"decode {f.__name__}: {(time.perf_counter() - start) / repeats * 1e3:.2f} ms "
              f"({rows} rows x {seq_len} cached tokens, {heads} heads, {device.type})")  # fmt: skip


def kernel_splits(
    rows: int, seq_len: int, device: torch.device, splits: list[int], repeats: int, warps: list[int], stages: list[int],
    tile_ns: list[int], cache_dtypes: list[str],
) -> None:
    """The decode kernel alone with bf16 queries at V2-Lite's attention shape, per cache dtype
    (bf16, or fp8: float8 e4m3), split count (0: the launch's own choice, `decode_splits`), key
    tile (0: the launch's default), warps and pipeline stages: microseconds a launch and the latent
    bytes read a second."""
    from slotrunner.core_runner.attention.backend import to_cache_dtype
    from slotrunner.models.layers.mla_decode import decode_splits, mla_decode

    heads, rank, rope, block = 16, 512, 64, 16
    gen = torch.Generator().manual_seed(0)
    num_blocks = rows * (-(-seq_len // block))
    cache16 = torch.randn(num_blocks, block, rank + rope, generator=gen).to(device, torch.bfloat16)
    block_tables = torch.randperm(num_blocks, generator=gen).view(rows, -1).int().to(device)
    seq_lens = torch.full((rows,), seq_len, dtype=torch.int32, device=device)
    q_lat = torch.randn(rows, heads, rank, generator=gen).to(device, torch.bfloat16)
    q_pe = torch.randn(rows, heads, rope, generator=gen).to(device, torch.bfloat16)
    for name, n, tile_n, w, st in [(c, n, t, w, st) for c in cache_dtypes for n in splits for t in tile_ns for w in warps for st in stages]:
        cache = cache16 if name == "bf16" else to_cache_dtype(cache16, torch.float8_e4m3fn)
        want = mla_decode(q_lat, q_pe, cache, block_tables, seq_lens, 0.07, splits=1)
        latent_bytes = rows * seq_len * (rank + rope) * cache.element_size()
        tiles = dict(splits=n or None, num_warps=w, num_stages=st, **({"tile_n": tile_n} if tile_n else {}))
        got = mla_decode(q_lat, q_pe, cache, block_tables, seq_lens, 0.07, **tiles)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        def launches() -> None:
            for _ in range(20):
                mla_decode(q_lat, q_pe, cache, block_tables, seq_lens, 0.07, **tiles)

        run = launches
        if device.type == "cuda":  # replayed from a graph: the GPU's time, not the host's launches
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                launches()
            run = graph.replay
            run()
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(max(1, repeats // 20)):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / (20 * max(1, repeats // 20))
        label = f"{n}" if n else f"auto ({decode_splits(rows, 1, device)})"
        tile_label = tile_n or "32 (default)"
        print(f"mla_decode kernel, {name} cache, {rows} rows x {seq_len} tokens, splits {label}, tile {tile_label}, "
              f"{w} warps, {st} stages: {seconds * 1e6:.1f} us, "
              f"{latent_bytes / seconds / 1e12:.2f} TB/s of latents")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kernel-splits", help="comma-separated split counts (0: the launch's own choice): time the "
                        "bf16 decode kernel alone for each, instead of the comparisons above")
    parser.add_argument("--warps", default="4", help="with --kernel-splits: comma-separated warp counts")
    parser.add_argument("--stages", default="3", help="with --kernel-splits: comma-separated pipeline stages")
    parser.add_argument("--tile-n", default="0", help="with --kernel-splits: comma-separated key tiles (0: the launch's own)")
    parser.add_argument("--cache-dtype", default="bf16", help="with --kernel-splits: comma-separated cache dtypes, bf16 / fp8")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kernel_splits:
        splits = [int(n) for n in args.kernel_splits.split(",")]
        warps, stages = [int(n) for n in args.warps.split(",")], [int(n) for n in args.stages.split(",")]
        tile_ns, cache_dtypes = [int(n) for n in args.tile_n.split(",")], args.cache_dtype.split(",")
        return kernel_splits(args.rows, args.seq_len, torch.device(args.device), splits, args.repeats, warps, stages, tile_ns, cache_dtypes)
    cache_bytes_per_token()
    decode(args.rows, args.seq_len, torch.device(args.device), args.repeats)


if __name__ == "__main__":
    main()
