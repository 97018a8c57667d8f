"""Build and load the native CPU kernels (`packed_linear.c`, `decode_attention.c`, `layer_ops.c`,
`decoder_layer.c`) on first use.

The source is compiled once per machine with the system C compiler (`$CC`, else `cc`) for the
host CPU (`-march=native`), and cached under `$SLOTRUNNER_CACHE` (default
`~/.cache/slotrunner`) by a hash of the source, the flags and the CPU, so a fresh machine pays
about two seconds once. With no compiler the library is unavailable and callers fall back to
dequantized weights (`native_unavailable_reason()` says why).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("packed_linear.c", "decode_attention.c", "layer_ops.c", "decoder_layer.c")
)
# Tried in order: with OpenMP threads; without OpenMP (Apple clang), one thread; without
# -march=native, for compilers that reject it (portable C, no SIMD intrinsics).
_FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"),
    ("-O3", "-march=native", "-shared", "-fPIC"),
    ("-O3", "-shared", "-fPIC"),
)
_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64
LINEAR_ARGTYPES = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, ctypes.c_int]
LINEAR_FORMATS = ("q4_1", "q8_0", "q8_16")
# function -> (argument types, result type)
SIGNATURES = {
    **{f"sr_linear_{fmt}": (LINEAR_ARGTYPES, None) for fmt in LINEAR_FORMATS},
    "sr_decode_attention": ([_PTR] * 5 + [_I64] * 4 + [ctypes.c_float, _I64, _PTR, ctypes.c_int], ctypes.c_int),
    "sr_simd_width": ([], ctypes.c_int),
    "sr_rms_norm": ([_PTR, _I64, _PTR, _I64, _PTR, ctypes.c_float, ctypes.c_int, _I64, _I64, _PTR, _PTR], None),
    "sr_rotary_qk": ([_PTR, _I64] + [_PTR, _I64, _I64, _I64] * 2 + [_PTR, _I64], None),
    "sr_write_kv": ([_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR], None),
    "sr_decode_layer": ([_PTR] * 6, ctypes.c_int),
}


class NativeKernelError(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("SLOTRUNNER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "slotrunner"
    )
    return Path(root) / "native"


def _cpu_signature() -> str:
    """What `-march=native` depends on: the CPU model and its feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def load_library() -> ctypes.CDLL:
    """The compiled kernels, built on first call. Raises NativeKernelError saying why not (the
    answer, either way, is kept for the process: a failing build is not retried per call)."""
    lib = _build_and_load()
    if isinstance(lib, str):
        raise NativeKernelError(lib)
    return lib


@functools.cache
def _build_and_load() -> ctypes.CDLL | str:
    """The library, or why there is none."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        return f"no C compiler: {compiler!r} is not on PATH (set $CC, or install gcc)"
    sources = [path.read_bytes() for path in SOURCES]
    errors = []
    for flags in _FLAG_SETS:
        key = hashlib.sha256(b"\0".join([*sources, compiler.encode(), " ".join(flags).encode(), _cpu_signature().encode()]))
        target = cache_dir() / f"slotrunner_cpu-{key.hexdigest()[:16]}.so"
        if not target.exists():
            error = _compile(compiler, flags, target)
            if error is not None:
                errors.append(f"{compiler} {' '.join(flags)}: {error}")
                continue
        try:
            lib = ctypes.CDLL(str(target))
        except OSError as exc:  # e.g. a cached build from another system image
            errors.append(f"loading {target}: {exc}")
            continue
        for name, (argtypes, restype) in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        return lib
    return f"compiling {', '.join(p.name for p in SOURCES)} failed: " + " | ".join(errors)


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile into `target` (atomically: concurrent builds cannot see a half-written file);
    returns the compiler's complaint, or None on success."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        return f"cannot write the cache {target.parent} ({exc}); set $SLOTRUNNER_CACHE to a writable folder"
    try:
        done = subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            return (done.stderr.strip().splitlines() or ["exit status %d" % done.returncode])[-1]
        os.replace(tmp, target)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def native_unavailable_reason() -> str | None:
    """None when the kernels load, else why they do not."""
    try:
        load_library()
    except NativeKernelError as exc:
        return str(exc)
    return None
