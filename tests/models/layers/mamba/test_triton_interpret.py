"""Every Mamba Triton kernel against its reference, run by the Triton interpreter on CPU.

Guards against: kernels that drift from their `op_ref` specification (masks on dims that are
not powers of two, strided token rows as the mixer passes them, empty rows, rows out of slot
order, bf16 inputs with float32 state), found on CPU before the GPU run. The cases live in
triton_interpret_checks.py, which also runs them compiled on a GPU (`--device cuda`).
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 9):
    # Older interpreters (3.6 seen) cannot take a loaded scalar as a `range` bound under numpy 2;
    # the compiled kernels are checked on the GPU machine instead.
    pytest.skip("the Triton interpreter before 3.9 cannot run these kernels", allow_module_level=True)


def _check_kernels_match_references():
    import json
    import os
    import sys

    import torch

    from slotrunner.core_runner.triton_utils import use_triton

    assert use_triton(torch.device("cpu")), "the interpreter switch did not take: the references would be compared to themselves"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from triton_interpret_checks import failures, run_cases

    results = run_cases()
    print(json.dumps(results))
    bad = failures(results)
    assert not bad, "kernels differ from their references:\n" + json.dumps(bad, indent=1)


def test_triton_kernels_match_references(run_interpreted):
    run_interpreted(_check_kernels_match_references)
