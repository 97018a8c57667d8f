"""Float8 e4m3 KV caches (kv_cache_dtype="fp8", scale 1): the rounding every Triton writer
makes, the twin of `backend.to_cache_dtype`, so that a kernel and the torch reference store the
same bytes (the paged K/V write in triton_attn.py, the MLA latent write in
models/layers/mla_decode.py)."""

from __future__ import annotations

from slotrunner.core_runner.triton_utils import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def round_to_e4m3(x):
        """fp32 `x` rounded to the nearest float8 e4m3fn value (ties to even, saturated at
        +-448), still as fp32: the float8 store then converts an exact value. What
        backend.to_cache_dtype computes; done here in integer and fp32 arithmetic so that every
        Triton build (the interpreter's conversion mis-rounds across binades) writes the same bytes."""
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        a = tl.abs(x)
        e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)  # binade; subnormal step 2^-9 below 2^-6
        quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
        y = a / quantum  # exact: a power-of-two divisor
        f = tl.floor(y)
        d = y - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        r = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f) * quantum
        # x's sign bit on r: -0.0 stays -0.0 (a negation compiles to 0 - r, which gives +0.0)
        sign = x.to(tl.int32, bitcast=True) & -2147483648
        return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
