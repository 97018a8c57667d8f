"""Runs every Mamba Triton kernel against its reference; prints one JSON line
{case: [output err, state err]} (err = max |diff| / (1 + max |ref|)) or {case: "error ..."}.

    python triton_interpret_checks.py [case ...]            # CPU, under TRITON_INTERPRET=1
    python triton_interpret_checks.py --device cuda [case ...]   # compiled, on a GPU, plus
                                                              # model-sized cases

Run it in a fresh process (test_triton_interpret.py does): Triton picks interpreted or compiled
kernels when `@triton.jit` runs, i.e. when the kernel module is first imported.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

DEVICE = sys.argv[2] if sys.argv[1:2] == ["--device"] else "cpu"
if DEVICE == "cpu":  # read by core_runner/triton_utils.py at import: set before importing slotrunner
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["SLOTRUNNER_FORCE_TRITON"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from mamba_cases import CHUNK, CONV_DIM, LENGTHS, N_GROUPS, NUM_HEADS, STATE_SIZE, conv_inputs, ssm_inputs, varlen  # noqa: E402

from slotrunner.models.layers.mamba import causal_conv1d as conv  # noqa: E402
from slotrunner.models.layers.mamba import selective_state_update as ssu  # noqa: E402
from slotrunner.models.layers.mamba import ssd_chunk_scan as ssd  # noqa: E402


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / (1 + b.float().abs().max())) if b.numel() else 0.0


def both(module, fn: str, ref: str, args: list, state_pos: int, kw: dict) -> list[float]:
    """Run op (the Triton kernel on this device) and op_ref on cloned states; errors of outputs
    and states."""
    args = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in args]
    kw = {k: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for k, t in kw.items()}
    a, b = list(args), list(args)
    a[state_pos], b[state_pos] = args[state_pos].clone(), args[state_pos].clone()
    out = getattr(module, fn)(*a, **kw)
    out_ref = getattr(module, ref)(*b, **kw)
    return [err(out, out_ref), err(a[state_pos], b[state_pos])]


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a token-strided view, like the mixer's split of in_proj's output."""
    wide = torch.zeros(t.shape[0], t[0].numel() + 5, dtype=t.dtype)
    wide[:, 3 : 3 + t[0].numel()] = t.reshape(t.shape[0], -1)
    return wide[:, 3 : 3 + t[0].numel()].view(t.shape)


def conv_varlen():
    v, c = varlen(), conv_inputs(sum(LENGTHS))
    args = [strided(c["x"]), c["weight"], c["bias"], c["conv_state"], v.query_start_loc, v.state_indices, v.has_initial_state]
    return both(conv, "causal_conv1d_varlen", "causal_conv1d_varlen_ref", args, 3, {})


def conv_varlen_no_bias_no_act():
    v, c = varlen(), conv_inputs(sum(LENGTHS), seed=1)
    args = [c["x"], c["weight"], None, c["conv_state"], v.query_start_loc, v.state_indices, v.has_initial_state]
    return both(conv, "causal_conv1d_varlen", "causal_conv1d_varlen_ref", args, 3, {"activation": None})


def conv_update():
    c = conv_inputs(3, seed=2)
    args = [strided(c["x"]), c["weight"], c["bias"], c["conv_state"], torch.tensor([5, 0, 8])]
    return both(conv, "causal_conv1d_update", "causal_conv1d_update_ref", args, 3, {})


def conv_update_bf16():
    c = conv_inputs(3, seed=3, dtype=torch.bfloat16)
    args = [c["x"], c["weight"], c["bias"], c["conv_state"], torch.tensor([1, 7, 2])]
    return both(conv, "causal_conv1d_update", "causal_conv1d_update_ref", args, 3, {})


def _ssu(seed: int, dtype: torch.dtype, **kw):
    s = ssm_inputs(3, seed=seed, dtype=dtype)
    args = [s["ssm_state"], strided(s["x"]), s["dt"], s["A"], strided(s["B"]), strided(s["C"]), torch.tensor([5, 0, 8])]
    return both(ssu, "selective_state_update", "selective_state_update_ref", args, 0, dict(D=s["D"], dt_bias=s["dt_bias"], **kw))


def _ssd(seed: int, dtype: torch.dtype = torch.float32, chunk: int = CHUNK, v=None, **kw):
    v = v or varlen()
    q = v.query_start_loc.tolist()
    s = ssm_inputs(q[-1], seed=seed, dtype=dtype)
    args = [strided(s["x"]), s["dt"], s["A"], strided(s["B"]), strided(s["C"]), chunk, s["ssm_state"],
            v.query_start_loc, v.state_indices, v.has_initial_state]
    return both(ssd, "ssd_chunk_scan_varlen", "ssd_chunk_scan_varlen_ref", args, 6, dict(D=s["D"], dt_bias=s["dt_bias"], **kw))


CASES = {
    "conv_varlen": conv_varlen,
    "conv_varlen_no_bias_no_act": conv_varlen_no_bias_no_act,
    "conv_update": conv_update,
    "conv_update_bf16": conv_update_bf16,
    "ssu": lambda: _ssu(4, torch.float32),
    "ssu_dt_limit": lambda: _ssu(5, torch.float32, dt_limit=(0.2, 0.5)),
    "ssu_bf16": lambda: _ssu(6, torch.bfloat16),
    "ssd_varlen": lambda: _ssd(7),
    # The kernel tiles 16+ tokens per chunk: a long row crosses several kernel chunks.
    "ssd_long_row": lambda: _ssd(8, v=varlen([37, 1], [3, 6], [True, False])),
    "ssd_dt_limit": lambda: _ssd(9, dt_limit=(0.2, 0.5)),
    "ssd_bf16": lambda: _ssd(10, torch.bfloat16),
}



# Relative to 1 + max |ref|: fp32 kernels reassociate sums (tl.dot, chunked decay); bf16 cases
# round the outputs to bf16 (states stay float32).
TOL_FP32, TOL_BF16 = 2e-5, 1e-2


def failures(results: dict) -> dict:
    """The cases that errored or exceeded their tolerance."""
    bad = {}
    for name, got in results.items():
        tol = TOL_BF16 if "bf16" in name else TOL_FP32
        if isinstance(got, str) or max(got) > tol:
            bad[name] = got
    return bad


def run_cases(names=None) -> dict:
    results: dict[str, object] = {}
    for name in names or CASES:
        try:
            results[name] = CASES[name]()
        except Exception:  # report every case, not just the first failure
            results[name] = "error " + traceback.format_exc()
    return results


def model_sized() -> dict:
    """GPU only: Bamba-9B-like mixer sizes, chunk 256, rows longer than the kernel's chunk tile."""
    import mamba_cases as mc

    g = torch.Generator().manual_seed(11)
    heads, head_dim, state, groups, kernel, slots = 128, 64, 128, 1, 4, 16
    lengths, row_slots, has_init = [300, 1, 77, 0, 256], [3, 0, 15, 7, 9], [True, False, True, True, False]
    v = mc.varlen(lengths, row_slots, has_init)
    n = sum(lengths)
    conv_dim = heads * head_dim + 2 * groups * state
    x = torch.randn(n, conv_dim, generator=g)
    cases = {
        "big_conv_varlen": lambda: both(conv, "causal_conv1d_varlen", "causal_conv1d_varlen_ref",
            [x, torch.randn(conv_dim, kernel, generator=g), torch.randn(conv_dim, generator=g),
             torch.randn(slots, conv_dim, kernel - 1, generator=g), v.query_start_loc, v.state_indices, v.has_initial_state], 3, {}),
        "big_conv_update": lambda: both(conv, "causal_conv1d_update", "causal_conv1d_update_ref",
            [x[:5], torch.randn(conv_dim, kernel, generator=g), torch.randn(conv_dim, generator=g),
             torch.randn(slots, conv_dim, kernel - 1, generator=g), torch.tensor(row_slots)], 3, {}),
    }
    ssm = dict(x=torch.randn(n, heads, head_dim, generator=g), dt=torch.randn(n, heads, generator=g) - 2,
               A=-torch.rand(heads, generator=g) * 8, B=torch.randn(n, groups, state, generator=g) / 4,
               C=torch.randn(n, groups, state, generator=g) / 4, D=torch.randn(heads, generator=g),
               dt_bias=torch.randn(heads, generator=g) * 0.5, ssm_state=torch.randn(slots, heads, head_dim, state, generator=g))
    for dtype in (torch.float32, torch.bfloat16):
        tag = "bf16" if dtype == torch.bfloat16 else "fp32"
        s_ = {k: (t.to(dtype) if k in ("x", "dt", "B", "C") else t) for k, t in ssm.items()}
        cases[f"big_ssd_{tag}"] = lambda s_=s_: both(ssd, "ssd_chunk_scan_varlen", "ssd_chunk_scan_varlen_ref",
            [s_["x"], s_["dt"], s_["A"], s_["B"], s_["C"], 256, s_["ssm_state"], v.query_start_loc, v.state_indices, v.has_initial_state],
            6, dict(D=s_["D"], dt_bias=s_["dt_bias"]))
        cases[f"big_ssu_{tag}"] = lambda s_=s_: both(ssu, "selective_state_update", "selective_state_update_ref",
            [s_["ssm_state"], s_["x"][:5], s_["dt"][:5], s_["A"], s_["B"][:5], s_["C"][:5], torch.tensor(row_slots)],
            0, dict(D=s_["D"], dt_bias=s_["dt_bias"]))
    return cases


if __name__ == "__main__":
    assert (NUM_HEADS, N_GROUPS, STATE_SIZE, CONV_DIM) == (4, 2, 8, 24)  # small: the interpreter is slow
    if DEVICE != "cpu":
        CASES.update(model_sized())
    results = run_cases([a for a in sys.argv[1:] if a not in ("--device", DEVICE)])
    print(json.dumps(results))
    sys.exit(1 if failures(results) else 0)
