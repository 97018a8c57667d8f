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
from torch import Tensor

FORCE_TRITON = os.environ.get("SLOTRUNNER_FORCE_TRITON", "0") == "1"
CACHED_LAUNCH = True  # CachedLaunch's own path; benchmarks turn it off to time Triton's dispatch (read per launch)
PDL = True  # programmatic dependent launch where the GPU has it (`pdl_launch`); benchmarks turn it off (read per launch)
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:
    import triton
    import triton.language as tl
    import triton.language.extra.cuda  # noqa: F401  (tl.extra.cuda.gdc_*, for `pdl_enter`)

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


_PDL_ON = {"PDL": True, "launch_pdl": True}
_PDL_OFF: dict = {}
_PDL_DEVICES: dict[int, bool] = {}


def pdl_launch(device: torch.device) -> dict:
    """Launch options of a kernel that takes `PDL: tl.constexpr` and calls `pdl_enter(PDL)` before
    it touches memory: programmatic dependent launch on a GPU that has it (compute capability 9 or
    more), nothing elsewhere. Launched so, the kernel's programs may start while the kernel before
    it on the stream still runs (once that one's programs have all called `pdl_enter` or ended);
    each then waits, in `pdl_enter`, until that kernel has ended and its writes are visible. A
    small step's launches sit at their latency floor one after another (the batch-1 profile: ~200
    launches of 1-5 us); started early, a launch's own start-up overlaps its predecessor's tail.
    CUDA graphs keep the launches' programmatic edges."""
    if not PDL or device.type != "cuda":
        return _PDL_OFF
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _PDL_DEVICES.get(index)
    if ok is None:
        ok = _PDL_DEVICES[index] = HAS_TRITON and torch.cuda.get_device_capability(index)[0] >= 9
    return _PDL_ON if ok else _PDL_OFF


def jit_per_step(*varying: str):
    """`triton.jit` for a kernel launched every step with integer arguments that change from
    step to step (row and token counts, lengths). Triton compiles a variant per value class of
    such an argument (equal to 1, a multiple of 16, other): a class first met mid-run compiles
    inside a step (on one H200, twelve such compiles took 1 s of a 128-token run at batch 16,
    and the run 0.16x plain decoding). These arguments are not specialized: one compile each.
    Launches go through `CachedLaunch`."""
    kwargs = {"do_not_specialize": list(varying)}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:  # divisibility by 16
        kwargs["do_not_specialize_on_alignment"] = list(varying)
    return lambda fn: CachedLaunch(triton.jit(**kwargs)(fn))


def launch_key(args: tuple, by_class: tuple[bool, ...]) -> tuple:
    """What a compiled Triton kernel was specialized on, for one launch's arguments, at least as
    finely as Triton keys it: per tensor its dtype and 16-byte alignment; an int that is not a
    constexpr (`by_class`) by its classes (equal to 1, a multiple of 16, i32 / i64 / u64 range):
    Triton keys it by those or, unspecialized (jit_per_step's varying ones), by its range alone;
    a constexpr int by its value; other values (constexprs, flags, None) as they are. So a
    launch whose token count is new takes the cached path too. (Per launch on the host: kept to
    one pass.)"""
    key = []
    add = key.append
    for a, cls in zip(args, by_class):
        kind = type(a)
        if kind is Tensor or isinstance(a, Tensor):
            add((a.dtype, not a.data_ptr() & 15))
        elif kind is int:
            add((a == 1, not a & 15, -2147483648 <= a < 2147483648, a < 9223372036854775808) if cls else (int, a))
        elif kind is float:
            add(float)
        else:
            add((kind, a))  # True and 1 apart
    return tuple(key)


class CachedLaunch:
    """A Triton kernel that, once launched for a specialization (`launch_key`), is launched again
    through the compiled kernel Triton returned: Triton's own dispatch (argument binding,
    specialization, its cache key, the device and stream lookups) took about as long as the
    launch itself for the few small kernels a step launches -- the host, not the GPU, bounds a
    small batch's step. The key is at least as fine as Triton's, so a launch that Triton would
    compile or dispatch differently takes Triton's path (which compiles or finds the variant)
    and is cached in turn. Interpreted (TRITON_INTERPRET=1), every launch takes Triton's path."""

    def __init__(self, fn) -> None:
        self.fn = fn
        params = getattr(fn, "params", None)
        self._names = None if params is None or TRITON_INTERPRET else [p.name for p in params]
        self._name_set = frozenset(self._names or ())
        self._defaults = {p.name: p.default for p in params or () if p.default is not inspect.Parameter.empty}
        self._by_class = tuple(not p.is_constexpr for p in params or ())
        self._compiled: dict[tuple, object] = {}

    def __getattr__(self, name: str):  # the JITFunction's own attributes
        if name == "fn":  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args: tuple, kwargs: dict):
        if self._names is None or callable(grid) or not CACHED_LAUNCH:
            return self.fn[grid](*args, **kwargs)
        names = self._names
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self._name_set))  # num_warps, ...
        if len(args) < len(names):  # keyword and default arguments, in the kernel's order
            args = args + tuple(kwargs[n] if n in kwargs else self._defaults[n] for n in names[len(args) :])
        device = torch._C._cuda_getDevice()
        key = (launch_key(args, self._by_class), options, device)
        compiled = self._compiled.get(key)
        if compiled is None:  # Triton's path: compiles or finds the variant
            compiled = self.fn[grid](*args, **dict(options))
            if hasattr(compiled, "result"):  # compiled asynchronously
                compiled = compiled.result()
            if compiled is not None:
                self._compiled[key] = compiled
            return compiled
        compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, stream=torch._C._cuda_getCurrentRawStream(device))
        return compiled


if HAS_TRITON:

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """A kernel launched with `pdl_launch`'s options calls this in every program before its
        first load or store of anything another kernel writes (weights may come before): it waits
        for the kernel before it to end, then lets the next one start (`pdl_launch`). Nothing
        without PDL."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()


@contextlib.contextmanager
def compiles_counted(keys: list[str] | None = None) -> Iterator[list[tuple[str, float]]]:
    """(kernel name, seconds) of each Triton compile inside the block (none without Triton): a
    benchmark names the variants its timed run met first, a test asserts there are none.
    `keys`, if given, gets each compile's Triton cache key (the specialization: argument
    classes and constexpr values), to tell which argument made a new variant."""
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
            name = getattr(self, "__name__", "?")
            compiled.append((name, time.perf_counter() - t0))
            if keys is not None:
                keys.append(f"{name}: {args[0] if args else kwargs.get('key')}")

    JITFunction._do_compile = timed
    try:
        yield compiled
    finally:
        JITFunction._do_compile = original
