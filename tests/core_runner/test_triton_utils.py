"""CachedLaunch: a Triton kernel launched again through the compiled kernel of its first launch,
for as long as the launch's specialization (`launch_key`) stays the one it was compiled for.

Guards against: a cached compiled kernel reused for arguments Triton would have specialized
differently (an int that was 1, a tensor whose address is not 16-byte aligned, another dtype,
other launch options) -- it would compute silently with the wrong assumptions; arguments given
by keyword or left to their defaults passed to the compiled kernel out of order; and a kernel
that keeps paying Triton's dispatch every step (the cache never hit). Here a stand-in for
Triton's JITFunction records which path each launch took; on a GPU every kernel test launches
the real kernels through it.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from slotrunner.core_runner import triton_utils
from slotrunner.core_runner.triton_utils import CachedLaunch, launch_key


class _Param:
    def __init__(self, name: str, default=inspect.Parameter.empty, do_not_specialize: bool = False,
                 is_constexpr: bool = False) -> None:
        self.name, self.default, self.do_not_specialize, self.is_constexpr = name, default, do_not_specialize, is_constexpr


class _Compiled:
    """What Triton's JIT returns: launched as compiled[grid](*args, stream=...)."""

    def __init__(self, log: list) -> None:
        self.log = log

    def __getitem__(self, grid):
        return lambda *args, stream: self.log.append(("cached", grid, args, stream))


class _Jit:
    """A JITFunction stand-in: `params`, and fn[grid](*args, **kwargs) -> a compiled kernel."""

    def __init__(self) -> None:
        # n varies from step to step (jit_per_step), stride is specialized, BLOCK is a constexpr
        self.params = [_Param("x_ptr"), _Param("n", do_not_specialize=True), _Param("stride", 4), _Param("flag", False),
                       _Param("BLOCK", 64, is_constexpr=True)]  # fmt: skip
        self.log: list = []
        self.compiled = _Compiled(self.log)
        self.some_attribute = "kept"

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return self.compiled

        return launch


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(triton_utils, "TRITON_INTERPRET", False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    return CachedLaunch(_Jit())


def test_second_launch_takes_the_compiled_kernel_with_every_argument_in_order(kernel):
    x = torch.zeros(64, dtype=torch.int64)
    kernel[(3,)](x, 5, BLOCK=128)
    kernel[(3,)](x, 7, BLOCK=128)  # n: 5 -> 7, the same class (not 1, not a multiple of 16)
    (path1, grid1, args1, kwargs1), (path2, grid2, args2, stream) = kernel.log
    assert path1 == "triton" and args1 == (x, 5, 4, False, 128) and kwargs1 == {}
    assert path2 == "cached" and grid2 == (3, 1, 1) and args2 == (x, 7, 4, False, 128) and stream == 1234
    assert kernel.some_attribute == "kept"  # the JITFunction's attributes show through


@pytest.mark.parametrize(
    "change",
    ["n is 1", "n is a multiple of 16", "n past 32 bits", "n past 63 bits", "misaligned tensor", "other dtype", "other BLOCK",
     "other stride", "flag", "num_warps"],  # fmt: skip
)
def test_a_launch_triton_would_specialize_otherwise_takes_its_path(kernel, change):
    x = torch.zeros(64, dtype=torch.int64)
    args, kwargs = [x, 5], {"BLOCK": 128}
    kernel[(3,)](*args, **kwargs)
    if change == "n is 1":
        args[1] = 1
    elif change == "n is a multiple of 16":
        args[1] = 32
    elif change == "n past 32 bits":
        args[1] = 2**31 + 5
    elif change == "n past 63 bits":  # Triton's u64, where 2**31 + 5 is an i64
        kernel[(3,)](x, 2**31 + 5, **kwargs)
        kernel.log.pop()
        args[1] = 2**63 + 5
    elif change == "misaligned tensor":
        args[0] = x.view(torch.int8)[1:]  # one byte past an aligned address
    elif change == "other dtype":
        args[0] = x.to(torch.int32)
    elif change == "other BLOCK":  # both multiples of 16: a constexpr is keyed by its value
        kwargs["BLOCK"] = 256
    elif change == "other stride":  # an int Triton specializes: now a multiple of 16
        kwargs["stride"] = 16
    elif change == "flag":
        kwargs["flag"] = True
    else:
        kwargs["num_warps"] = 8
    kernel[(3,)](*args, **kwargs)
    assert [entry[0] for entry in kernel.log] == ["triton", "triton"], change
    kernel[(3,)](*args, **kwargs)  # now cached under its own key
    assert kernel.log[-1][0] == "cached"
    if change == "num_warps":  # a launch option, not a kernel argument: passed to Triton only
        assert kernel.log[1][3] == {"num_warps": 8} and len(kernel.log[2][2]) == 5


def test_new_values_of_the_same_classes_take_the_cached_path(kernel):
    """A prefill launch's token count and strides change from step to step: the compiled kernel
    serves every value of the class it was compiled for, specialized ints included."""
    x = torch.zeros(64, dtype=torch.int64)
    kernel[(3,)](x, 5, stride=7, BLOCK=128)
    kernel[(9,)](x, 37, stride=9, BLOCK=128)
    kernel[(2,)](x, 3, stride=2**20 + 3, BLOCK=128)
    assert [entry[0] for entry in kernel.log] == ["triton", "cached", "cached"]
    assert kernel.log[1][2] == (x, 37, 9, False, 128) and kernel.log[2][2] == (x, 3, 2**20 + 3, False, 128)


def test_interpreted_or_callable_grid_always_takes_tritons_path(kernel, monkeypatch):
    x = torch.zeros(64, dtype=torch.int64)
    kernel[lambda meta: (3,)](x, 5)
    kernel[lambda meta: (3,)](x, 5)
    assert [entry[0] for entry in kernel.log] == ["triton", "triton"]
    monkeypatch.setattr(triton_utils, "TRITON_INTERPRET", True)
    interpreted = CachedLaunch(_Jit())
    interpreted[(3,)](x, 5)
    interpreted[(3,)](x, 5)
    assert [entry[0] for entry in interpreted.log] == ["triton", "triton"]


def test_launch_key_classes():
    x = torch.zeros(8, dtype=torch.float32)
    varying = (False, True, False, False, False)
    assert launch_key((x, 5, 0.5, None, True), varying) == launch_key((x.clone(), 7, 1.5, None, True), varying)
    assert launch_key((x, 5), varying) != launch_key((x, 1), varying) != launch_key((x, 16), varying)
    assert launch_key((x, 16), varying) == launch_key((x, 48), varying)
    assert launch_key((16,), (False,)) != launch_key((48,), (False,))  # a constexpr: by value
    assert launch_key((x,), varying) != launch_key((x[1:],), varying)  # 4 bytes past: not 16-byte aligned
    assert launch_key((True,), (False,)) != launch_key((1,), (False,)) != launch_key((False,), (False,))
