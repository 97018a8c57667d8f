"""The gated delta-net split by head over two ranks, built here in one process (no process group:
loading runs no collective).

Guards against: Qwen3-Next's fused in_proj_qkvz / in_proj_ba split as if they were [q | k | v | z]
of all heads (they are grouped per key head: rank 1 would take rank 0's v rows as its k),
Qwen3.5's in_proj_qkv split as one block instead of per part, conv channels that do not follow
the q/k/v heads the rank projects, A_log / dt_bias of the wrong heads, out_proj columns of other
heads, a head norm narrowed although every head shares it, and a state spec (the per-slot pools)
sized for every head.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from slotrunner.conformance import build_case
from slotrunner.core_runner.distributed.parallel_state import TensorParallelGroup, tensor_parallel_scope
from slotrunner.core_runner.loader.checkpoint import iter_safetensors, load_hf_config, safetensors_files
from slotrunner.core_runner.loader.model_loader import load_model
from slotrunner.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3NextForCausalLM
from slotrunner.registry import tiny_config

PREFIX = "model.layers.0.linear_attn"


def _load_ranks(cls, tmp_path) -> tuple[object, dict[str, torch.Tensor], list[torch.nn.Module]]:
    cfg = tiny_config(cls.__name__, tie_word_embeddings=False)
    build_case(cfg, tmp_path)
    weights = lambda: iter_safetensors(safetensors_files(tmp_path), torch.float32)  # noqa: E731
    layers = []
    for rank in range(2):
        with tensor_parallel_scope(TensorParallelGroup(rank, 2)):
            model = load_model(cls, load_hf_config(tmp_path), weights, torch.float32, torch.device("cpu"))
        layers.append(model.get_submodule(PREFIX))
    return cfg, load_file(str(tmp_path / "model.safetensors")), layers


def _halves(t: torch.Tensor, rank: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(2, dim)[rank]


def _check_common(cfg, full: dict[str, torch.Tensor], layer, rank: int) -> None:
    """conv channels [q | k | v], per-head parameters, out_proj, norm and the state spec."""
    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)  # fmt: skip
    cq, ck, cv = full[f"{PREFIX}.conv1d.weight"].split([nk * dk, nk * dk, nv * dv])
    assert torch.equal(layer.conv1d.weight, torch.cat([_halves(cq, rank), _halves(ck, rank), _halves(cv, rank)]))
    for name in ("A_log", "dt_bias"):
        assert torch.equal(getattr(layer, name), _halves(full[f"{PREFIX}.{name}"], rank))
    assert torch.equal(layer.out_proj.weight, _halves(full[f"{PREFIX}.out_proj.weight"], rank, 1))
    assert torch.equal(layer.norm.weight, full[f"{PREFIX}.norm.weight"])
    conv, recurrent = layer.state_spec().tensors
    assert conv.shape == ((2 * nk * dk + nv * dv) // 2, cfg.linear_conv_kernel_dim - 1)
    assert recurrent.shape == (nv // 2, dk, dv)


def test_fused_projections_split_by_key_head_group(tmp_path):
    cfg, full, layers = _load_ranks(Qwen3NextForCausalLM, tmp_path)
    nk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    per_k = cfg.linear_num_value_heads // nk
    qkvz = full[f"{PREFIX}.in_proj_qkvz.weight"].view(nk, 2 * dk + 2 * per_k * dv, -1)
    ba = full[f"{PREFIX}.in_proj_ba.weight"].view(nk, 2 * per_k, -1)
    for rank, layer in enumerate(layers):
        # Key head `rank`'s whole group: its q, k, and the v, z, b, a of the value heads it serves.
        assert torch.equal(layer.in_proj_qkvz.weight, qkvz[rank])
        assert torch.equal(layer.in_proj_ba.weight, ba[rank])
        _check_common(cfg, full, layer, rank)


def test_separate_projections_split_each_part_by_head(tmp_path):
    cfg, full, layers = _load_ranks(Qwen3_5ForCausalLM, tmp_path)
    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)  # fmt: skip
    q, k, v = full[f"{PREFIX}.in_proj_qkv.weight"].split([nk * dk, nk * dk, nv * dv])
    for rank, layer in enumerate(layers):
        assert torch.equal(layer.in_proj_qkv.weight, torch.cat([_halves(q, rank), _halves(k, rank), _halves(v, rank)]))
        for name in ("z", "b", "a"):
            assert torch.equal(getattr(layer, f"in_proj_{name}").weight, _halves(full[f"{PREFIX}.in_proj_{name}.weight"], rank))
        _check_common(cfg, full, layer, rank)

