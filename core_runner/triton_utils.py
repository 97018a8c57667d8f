"""Triton availability and the one switch that decides where kernels run.

Kernels run as Triton on CUDA devices; elsewhere their torch reference runs. Setting
`SLOTRUNNER_FORCE_TRITON=1` together with `TRITON_INTERPRET=1` runs the Triton kernels on CPU
through the interpreter -- how CI checks every kernel against its reference. Environment
variables are read here and nowhere else.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import time
from collections.abc import Iterator

import torch

FORCE_TRITON = os.environ.get("SLOTRUNNER_FORCE_TRITON", "0") == "1"
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # e.g. macOS wheels of torch without triton
    triton = None
    tl = None
    HAS_TRITON = False


def use_triton(device: torch.device) -> bool:
    if not HAS_TRITON:
        return False
    if device.type == "cuda":
        return True
    return FORCE_TRITON and TRITON_INTERPRET and device.type == "cpu"


def jit_per_step(*varying: str):
    """`triton.jit` for a kernel launched every step with integer arguments that change from
    step to step (row and token counts, lengths). Triton compiles a variant per value class of
    such an argument (equal to 1, a multiple of 16, other): a class first met mid-run compiles
    inside a step (on one H200, twelve such compiles took 1 s of a 128-token run at batch 16,
    and the run 0.16x plain decoding). These arguments are not specialized: one compile each."""
    kwargs = {"do_not_specialize": list(varying)}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:  # divisibility by 16
        kwargs["do_not_specialize_on_alignment"] = list(varying)
    return triton.jit(**kwargs)


@contextlib.contextmanager
def compiles_counted() -> Iterator[list[tuple[str, float]]]:
    """(kernel name, seconds) of each Triton compile inside the block (none without Triton): a
    benchmark names the variants its timed run met first, a test asserts there are none."""
    compiled: list[tuple[str, float]] = []
    if not HAS_TRITON:
        yield compiled
        return
    from triton.runtime.jit import JITFunction

    original = JITFunction._do_compile

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            compiled.append((getattr(self, "__name__", "?"), time.perf_counter() - t0))

    JITFunction._do_compile = timed
    try:
        yield compiled
    finally:
        JITFunction._do_compile = original
