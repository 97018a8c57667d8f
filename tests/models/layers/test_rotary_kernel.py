"""The rotary kernel (RoPE on q and k in place, optionally after Qwen3's per-head q/k RMSNorm)
computes its torch reference, and a Qwen3 model's logits do not move when the kernels replace it.

Guards against: partial rotary rotating or normalizing the wrong channels (the pass-through tail
must count in the norm but stay unrotated), a head_dim that is not a power of two (80), heads
past the first block of the grid (12 q heads), positions beyond the first rows of the cos/sin
table read from the wrong row, q/k as strided views of the fused qkv buffer (v must stay
untouched), q and k swapping norm weights or eps, rounding points that differ from
`rms_norm_ref` + `_rotate` (bf16 results would drift from transformers; Gemma3's unit-offset
norm rounds once, after 1 + w), and the CPU path of `norm_and_rotate` drifting from today's
`q_norm(q)` then RoPE. With the attention backend's K/V write in the same launch (`KVWrite`):
the cache must hold exactly what the rotation then `write_kv` would store (float8 rounding
included, the pass-through tail included), padding tokens (slot -1) write nothing and zero their
output row, KV heads past the first program's block still written, nothing else touched.
"""

from __future__ import annotations

import pytest
import torch

FP32_TOL = dict(atol=1e-6, rtol=1e-6)
MAX_POSITION = 300
# With the norm, half precision: the sum of squares runs in another order, which now and then
# moves the rounded normalized value by one ulp, and weight * it by one or two.
NORM_ULPS = 2
MAX_DIFFER = 0.01  # share of half-precision elements allowed off the reference (a skipped rounding: ~25%)
# Qwen3-0.6B's attention shape (16 q heads, 8 kv heads, head_dim 128) on a tiny model.
QWEN3_SHAPE = dict(hidden_size=256, intermediate_size=1536, num_attention_heads=16, num_key_value_heads=8, head_dim=128)
BF16_ATOL, BF16_RTOL = 0.1, 0.05  # as tests/conformance/test_decoders_gpu.py


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between fp16/bf16 tensors (+0 and -0 are equal)."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return (ordered(a) - ordered(b)).abs()


def _assert_matches(got: torch.Tensor, want: torch.Tensor, normed: torch.Tensor | None, rotary_dim: int, what: str) -> None:
    """fp32: tight. Half precision without the norm: bitwise (the same fp32 products, rounded
    once). With the norm: a few normalized inputs may be NORM_ULPS apart, which the rotation
    carries as that many ulps of its inputs, |x1| + |x2|, plus its own rounding."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32_TOL, msg=lambda m: f"{what}: {m}")
        return
    if normed is None:
        assert torch.equal(got, want), f"{what}: {int(_ulps(got, want).max())} ulps apart"
        return
    n = normed.float()
    n1, n2 = n[..., : rotary_dim // 2], n[..., rotary_dim // 2 : rotary_dim]
    unit = torch.finfo(got.dtype).eps  # one ulp at 1.0: ulp(x) <= unit * |x|
    bound = torch.cat([(n1.abs() + n2.abs()).repeat(1, 1, 2), n[..., rotary_dim:].abs()], dim=-1) * NORM_ULPS * unit
    bound = bound + want.float().abs() * unit
    excess = (got.float() - want.float()).abs() - bound
    assert float(excess.max()) <= 0, f"{what}: off by {float(excess.max())} beyond NORM_ULPS"
    differ = float((got != want).float().mean())
    assert differ <= MAX_DIFFER, f"{what}: {differ:.2%} of elements differ from the reference"


def _check_against_reference(device: str = "cpu", dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16)):
    from slotrunner.core_runner.triton_utils import use_triton
    from slotrunner.models.layers.norm import rms_norm_ref
    from slotrunner.models.layers.rotary_qk import QKNorm, rotary_qk, rotary_qk_ref

    assert use_triton(torch.device(device)), "the interpreter switch did not take: the reference would meet itself"
    gen = torch.Generator().manual_seed(0)
    # (tokens, q heads, kv heads, head_dim, rotary_dim)
    cases = [(1, 4, 2, 64, 64), (3, 12, 4, 128, 128), (2, 6, 2, 64, 32), (3, 2, 1, 80, 80), (2, 3, 3, 80, 40)]
    for dtype in dtypes:
        for num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim in cases:
            name = f"{dtype} tokens={num_tokens} heads={num_heads}/{num_kv_heads} head_dim={head_dim} rotary={rotary_dim}"
            q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
            qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(device, dtype)
            positions = torch.tensor([MAX_POSITION - 1, 0, 137, 64, 5][:num_tokens], device=device)
            angles = torch.rand(MAX_POSITION, rotary_dim // 2, generator=gen) * 6.3
            cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)
            norm = QKNorm(
                (1 + 0.5 * torch.randn(head_dim, generator=gen)).to(device, dtype),
                (1 + 0.5 * torch.randn(head_dim, generator=gen)).to(device, dtype),
                1e-6,
                1e-5,
            )
            q0 = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)  # strided views of the qkv buffer
            k0 = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
            for qk_norm in (None, norm, norm._replace(unit_offset=True)):
                unit_offset = qk_norm is not None and qk_norm.unit_offset
                tag = f"{name} norm={qk_norm is not None} unit_offset={unit_offset}"
                buf = qkv.clone()
                q, k = buf[:, :q_size].view_as(q0), buf[:, q_size : q_size + kv_size].view_as(k0)
                want_q, want_k = rotary_qk_ref(positions, q0, k0, cos_sin, qk_norm)
                got_q, got_k = rotary_qk(positions, q, k, cos_sin, qk_norm)
                nq = None if qk_norm is None else rms_norm_ref(q0, norm.q_weight, norm.q_eps, unit_offset=unit_offset)
                nk = None if qk_norm is None else rms_norm_ref(k0, norm.k_weight, norm.k_eps, unit_offset=unit_offset)
                _assert_matches(got_q, want_q, nq, rotary_dim, f"{tag} q")
                _assert_matches(got_k, want_k, nk, rotary_dim, f"{tag} k")
                assert torch.equal(buf[:, q_size + kv_size :], qkv[:, q_size + kv_size :]), f"{tag}: v was written"


def _check_cache_write(device: str = "cpu", dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16)):
    """rotary_qk with the backend's K/V write (one launch) against rotary_qk, then write_kv."""
    from slotrunner.core_runner.attention.backend import write_kv
    from slotrunner.core_runner.attention.kv_write import KVWrite
    from slotrunner.models.layers.rotary_qk import QKNorm, rotary_qk

    gen = torch.Generator().manual_seed(5)
    # (q heads, kv heads, head_dim, rotary_dim): 16 KV heads take two programs' blocks
    cases = [(4, 2, 64, 64), (12, 4, 80, 40), (16, 16, 32, 32)]
    slots = torch.tensor([9, -1, 0, 30, -1], device=device)  # two padding tokens
    num_tokens, num_blocks, block_size = slots.shape[0], 4, 8
    for dtype in dtypes:
        for cache_dtype in (dtype, torch.float8_e4m3fn):
            for num_heads, num_kv_heads, head_dim, rotary_dim in cases:
                tag = f"{dtype} cache {cache_dtype} heads={num_heads}/{num_kv_heads} head_dim={head_dim} rotary={rotary_dim}"
                q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
                qkv = (3 * torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen)).to(device, dtype)
                positions = torch.tensor([5, 77, 0, 299, 3], device=device)
                angles = torch.rand(MAX_POSITION, rotary_dim // 2, generator=gen) * 6.3
                cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)
                w = (1 + 0.5 * torch.randn(head_dim, generator=gen)).to(device, dtype)
                for qk_norm in (None, QKNorm(w, w.flip(0), 1e-6, 1e-5)):
                    views = []
                    for buf in (qkv.clone(), qkv.clone()):
                        views.append((buf[:, :q_size].view(num_tokens, num_heads, head_dim),
                                      buf[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim),
                                      buf[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)))  # fmt: skip
                    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
                    start = torch.randn(shape, generator=gen).to(device, dtype).to(cache_dtype)
                    got_cache, want_cache = start.clone(), start.clone()
                    got_out = torch.full((num_tokens, num_heads, head_dim), 7.0, dtype=dtype, device=device)
                    (q, k, v), (q2, k2, v2) = views
                    got_q, got_k = rotary_qk(positions, q, k, cos_sin, qk_norm, KVWrite(got_cache, v, slots, got_out))
                    want_q, want_k = rotary_qk(positions, q2, k2, cos_sin, qk_norm)
                    real = slots >= 0
                    write_kv(want_cache, want_k[real], v2[real], slots[real])
                    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k), f"{tag}: q/k moved"
                    u8 = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t  # noqa: E731
                    assert torch.equal(u8(got_cache), u8(want_cache)), f"{tag} norm={qk_norm is not None}: cache"
                    assert torch.equal(got_out[~real], torch.zeros_like(got_out[~real])), f"{tag}: padding output not zeroed"
                    assert bool((got_out[real] == 7.0).all()), f"{tag}: a real token's output row was written"


def _check_layer_calls(device: str = "cpu"):
    """The layer entry points llama.py calls, against the unfused composition of the references."""
    from slotrunner.models.layers.mrope import MRotaryEmbedding
    from slotrunner.models.layers.norm import RMSNorm, rms_norm_ref
    from slotrunner.models.layers.rotary import RopeConfig, RotaryEmbedding
    from slotrunner.models.layers.rotary_qk import _rotate

    gen = torch.Generator().manual_seed(2)
    rope = RopeConfig(theta=10000.0, partial_rotary_factor=0.5)
    q_norm, k_norm = RMSNorm(64, 1e-6).to(device), RMSNorm(64, 1e-6).to(device)
    with torch.no_grad():
        q_norm.weight.copy_(1 + 0.3 * torch.randn(64, generator=gen))
        k_norm.weight.copy_(1 + 0.3 * torch.randn(64, generator=gen))
    q = torch.randn(3, 4, 64, generator=gen).to(device)
    k = torch.randn(3, 2, 64, generator=gen).to(device)
    positions = torch.tensor([7, 250, 0], device=device)
    nq, nk = rms_norm_ref(q, q_norm.weight, 1e-6), rms_norm_ref(k, k_norm.weight, 1e-6)
    mrope = MRotaryEmbedding(64, MAX_POSITION, rope, (4, 6, 6)).to(device)
    for rotary in (RotaryEmbedding(64, MAX_POSITION, rope).to(device), mrope):  # M-RoPE: 1-D positions are plain RoPE
        cos, sin = rotary.cos_sin[positions].chunk(2, dim=-1)
        got = rotary.norm_and_rotate(positions, q.clone(), k.clone(), q_norm, k_norm)
        for g, w in zip(got, (_rotate(nq, cos, sin, 32), _rotate(nk, cos, sin, 32))):
            torch.testing.assert_close(g, w, **FP32_TOL)
        got = rotary(positions, q.clone(), k.clone())
        for g, w in zip(got, (_rotate(q, cos, sin, 32), _rotate(k, cos, sin, 32))):
            torch.testing.assert_close(g, w, **FP32_TOL)
    # M-RoPE's three position axes keep the unfused torch path.
    axes = torch.stack([positions, positions + 1, positions + 2])
    got = mrope.norm_and_rotate(axes, q.clone(), k.clone(), q_norm, k_norm)
    for g, w in zip(got, mrope(axes, nq, nk)):
        torch.testing.assert_close(g, w, **FP32_TOL)


def _check_interpreted_models():
    """Qwen3 (q/k norms) and Llama (plain RoPE) with every kernel interpreted -- the rotary launch
    writing each layer's K/V into the cache -- against transformers' logits at every position,
    two requests batched under chunked prefill (decode rows beside prefill chunks)."""
    import tempfile
    from pathlib import Path

    from slotrunner import LLM
    from slotrunner.conformance import compare_logits, tiny_case
    from slotrunner.conformance_recorder import greedy_params, run_batch

    for arch in ("Qwen3ForCausalLM", "LlamaForCausalLM"):
        with tempfile.TemporaryDirectory() as d:
            hf = tiny_case(arch, Path(d)).oracle.hf_model
            llm = LLM(d, device="cpu", max_model_len=64, max_num_seqs=2, block_size=4, max_num_batched_tokens=7)
            assert llm.engine.runner.attn_backend.name == "triton", "the interpreted run must take the Triton backend"
            prompts = [[5, 17, 300], [(13 * i) % 900 + 4 for i in range(13)]]
            runs = run_batch(llm, [{"prompt_token_ids": p} for p in prompts], [greedy_params(4)] * 2)
            for prompt, run in zip(prompts, runs):
                with torch.no_grad():
                    ref = hf(input_ids=torch.tensor([prompt + run.output_token_ids[:-1]])).logits[0].float()
                result = compare_logits(f"{arch} interpreted", run.logits.float(), ref)
                assert result.passed, result.detail


def test_interpreted_models_match_transformers(run_interpreted):
    run_interpreted(_check_interpreted_models)


def _check_wide_blocks(device: str = "cpu", dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16)):
    """The launch at prefill sizes (rotary_qk.WIDE_FROM_TOKENS tokens up) rotates WIDE_BLOCK_H
    heads a program: the same checks with every launch taking that width, so 12 q heads and 4 KV
    heads share one program, masked past them."""
    import slotrunner.models.layers.rotary_qk as rq

    saved = rq.WIDE_FROM_TOKENS
    rq.WIDE_FROM_TOKENS = 1
    try:
        _check_against_reference(device, dtypes)
        _check_cache_write(device, dtypes)
    finally:
        rq.WIDE_FROM_TOKENS = saved


def _check_all_interpreted():
    _check_against_reference()
    _check_cache_write()
    _check_layer_calls()
    _check_wide_blocks()


def test_rotary_kernel_matches_reference(run_interpreted):
    run_interpreted(_check_all_interpreted)


def test_cpu_norm_and_rotate_is_the_unfused_torch_code():
    """Without Triton (plain CPU) the fused entry point runs exactly q_norm(q), k_norm(k), RoPE."""
    from slotrunner.models.layers.norm import RMSNorm
    from slotrunner.models.layers.rotary import RopeConfig, RotaryEmbedding

    torch.manual_seed(0)
    rotary = RotaryEmbedding(16, 64, RopeConfig())
    q_norm, k_norm = RMSNorm(16, 1e-6), RMSNorm(16, 1e-6)
    q, k, positions = torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.tensor([0, 3, 63, 9, 1])
    got = rotary.norm_and_rotate(positions, q, k, q_norm, k_norm)
    want = rotary(positions, q_norm(q), k_norm(k))
    assert all(torch.equal(g, w) for g, w in zip(got, want))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_compiled_rotary_matches_reference():
    _check_against_reference("cuda", (torch.float32, torch.float16, torch.bfloat16))
    _check_cache_write("cuda", (torch.float32, torch.float16, torch.bfloat16))
    _check_layer_calls("cuda")
    _check_wide_blocks("cuda", (torch.float32, torch.float16, torch.bfloat16))


@needs_cuda
def test_qwen3_logits_unchanged_by_kernels(tmp_path, monkeypatch):
    """A Qwen3-shaped tiny model in bf16 on CUDA: logits with the fused norm/rotary/activation
    kernels against the same engine running the torch references (attention is Triton in both)."""
    from slotrunner import LLM
    from slotrunner.conformance import build_case, compare_greedy, compare_logits, first_divergence, run_recorded
    from slotrunner.models.layers import activation, norm, rotary_qk
    from slotrunner.registry import tiny_config

    build_case(tiny_config("Qwen3ForCausalLM", **QWEN3_SHAPE), tmp_path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (1, 9, 40)]

    def runs():
        llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", enforce_eager=True, max_model_len=128, max_num_seqs=4)
        return [run_recorded(llm, p, 10) for p in prompts]

    with monkeypatch.context() as m:
        for module in (activation, norm, rotary_qk):
            m.setattr(module, "use_triton", lambda device: False)
        refs = runs()
    for prompt, got, ref in zip(prompts, runs(), refs):
        # Two free-running generations share contexts only up to their first differing token
        # (a near-tie in bf16): compare the positions computed on identical contexts.
        i = first_divergence(got.output_token_ids, ref.output_token_ids)
        same = len(prompt) + (len(ref.output_token_ids) if i is None else i)
        logits = compare_logits(f"n={len(prompt)}", got.logits[:same].cpu(), ref.logits[:same].cpu(), BF16_ATOL, BF16_RTOL)
        assert logits.passed, f"{logits.detail}, worst {logits.worst}"
        greedy = compare_greedy(f"n={len(prompt)}", got.output_token_ids, ref.output_token_ids, ref.logits.cpu(), len(prompt), BF16_ATOL)
        assert greedy.passed, greedy.detail
