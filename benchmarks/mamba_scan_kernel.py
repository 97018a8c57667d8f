"""The Mamba2 chunked-scan prefill kernel alone, on the Bamba shape's prefill step.

32 rows of 256 tokens (one 8192-token prefill step), 32 heads of 64, state 128, one group, bf16
inputs, float32 state: the kernel's time per call (median of CUDA-event timings) for each
tl.dot precision and warp count, its error against the float32 reference, and the FLOP rate
it reaches (the chunk products it must do).

    python benchmarks/mamba_scan_kernel.py

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import torch

from slotrunner.models.layers.mamba.ssd_chunk_scan import MAX_KERNEL_CHUNK, ssd_chunk_scan_varlen, ssd_chunk_scan_varlen_ref


def main() -> None:
    import triton.testing

    rows, length, heads, head_dim, state, chunk = 32, 256, 32, 64, 128, 256
    n = rows * length
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to("cuda", torch.bfloat16)

    x, dt, B, C = randn(n, heads, head_dim), randn(n, heads) - 1.0, randn(n, 1, state), randn(n, 1, state)
    A = (-torch.rand(heads, generator=g) * 4 - 0.1).cuda()
    D, dt_bias = torch.randn(heads, generator=g).cuda(), (torch.randn(heads, generator=g) * 0.5).cuda()
    qsl = (torch.arange(rows + 1, dtype=torch.int32) * length).cuda()
    slots = torch.arange(rows, dtype=torch.int64).cuda()
    init = torch.zeros(rows, dtype=torch.bool).cuda()
    state0 = torch.zeros(rows, heads, head_dim, state, device="cuda")
    ref_state = state0.clone()
    ref = ssd_chunk_scan_varlen_ref(x, dt, A, B, C, chunk, ref_state, qsl, slots, init, D, dt_bias)
    L = MAX_KERNEL_CHUNK
    # Per (row, head, chunk of L): C B^T [L, L, N], its product with x [L, L, P], C s^T [L, N, P], x^T B [L, P, N].
    flop = 2 * rows * (length // L) * heads * (L * L * state + L * L * head_dim + 2 * L * state * head_dim)
    print(f"SSD chunk scan, {rows} rows x {length} tokens, {heads} heads x {head_dim}, state {state}, bf16, "
          f"{torch.cuda.get_device_name()}; {flop / 1e9:.1f} GFLOP a call")
    print(f"{'precision':>9} {'warps':>5} {'ms':>8} {'TFLOP/s':>8} {'out err':>9} {'state err':>9}")
    for precision, warps in (("ieee", 4), ("ieee", 8), ("tf32", 4), ("tf32", 8)):
        st = state0.clone()

        def call():
            return ssd_chunk_scan_varlen(x, dt, A, B, C, chunk, st, qsl, slots, init, D, dt_bias,
                                         dot_precision=precision, num_warps=warps)  # fmt: skip

        out = call()
        out_err = float((out.float() - ref.float()).abs().max() / (1 + ref.float().abs().max()))
        state_err = float((st - ref_state).abs().max() / (1 + ref_state.abs().max()))
        ms = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
        print(f"{precision:>9} {warps:>5} {ms:>8.3f} {flop / ms / 1e9:>8.1f} {out_err:>9.2e} {state_err:>9.2e}")


if __name__ == "__main__":
    main()
