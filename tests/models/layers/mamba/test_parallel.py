"""The Mamba2 mixer split by head over two ranks, built here in one process (no process group:
loading runs no collective, and the norm's all-reduce is given the other rank's sum).

Guards against: in_proj split as one block instead of per part ([z | x | B | C | dt]: rank 1
would take x rows as its z), the depthwise conv's B and C channels dropped or split when there
is one group, dt_bias / A_log / D of the wrong heads, a state spec (the per-slot pools) sized for
every head, and a gated norm whose one group spans the ranks normalised by the rank's half only.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from slotrunner.conformance import build_case
from slotrunner.core_runner.distributed.parallel_state import TensorParallelGroup, tensor_parallel_scope
from slotrunner.core_runner.distributed.shard import Shard
from slotrunner.core_runner.loader.checkpoint import iter_safetensors, load_hf_config, safetensors_files
from slotrunner.core_runner.loader.model_loader import load_model
from slotrunner.models.bamba import BambaForCausalLM
from slotrunner.models.layers.mamba.gated_norm import GatedRMSNorm
from slotrunner.models.layers.mamba.parallel import ParallelGatedRMSNorm
from slotrunner.models.mamba2 import Mamba2ForCausalLM
from slotrunner.registry import tiny_config

# architecture -> (model class, prefix of layer 0's mixer, the config's fields)
CASES = {
    "Mamba2ForCausalLM": (Mamba2ForCausalLM, "backbone.layers.0.mixer", ("num_heads", "head_dim", "n_groups", "state_size")),
    "BambaForCausalLM": (BambaForCausalLM, "model.layers.0.mamba",
                         ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state")),
}  # fmt: skip


@pytest.mark.parametrize("architecture", sorted(CASES))
def test_each_rank_holds_its_heads_of_every_part(architecture, tmp_path):
    cls, prefix, fields = CASES[architecture]
    cfg = tiny_config(architecture, tie_word_embeddings=False)
    build_case(cfg, tmp_path)
    full = load_file(str(tmp_path / "model.safetensors"))
    heads, head_dim, groups, state = (getattr(cfg, f) for f in fields)
    inner = heads * head_dim
    weights = lambda: iter_safetensors(safetensors_files(tmp_path), torch.float32)  # noqa: E731
    for rank in range(2):
        with tensor_parallel_scope(TensorParallelGroup(rank, 2)):
            model = load_model(cls, load_hf_config(tmp_path), weights, torch.float32, torch.device("cpu"))
        mixer = model.get_submodule(prefix)
        h = slice(rank * heads // 2, (rank + 1) * heads // 2)
        rows = slice(rank * inner // 2, (rank + 1) * inner // 2)
        g = slice(0, groups * state) if groups == 1 else slice(rank * groups * state // 2, (rank + 1) * groups * state // 2)
        z, x, B, C, dt = full[f"{prefix}.in_proj.weight"].split([inner, inner, groups * state, groups * state, heads])
        assert torch.equal(mixer.in_proj.weight, torch.cat([z[rows], x[rows], B[g], C[g], dt[h]]))
        cx, cB, cC = full[f"{prefix}.conv1d.weight"].split([inner, groups * state, groups * state])
        assert torch.equal(mixer.conv1d.weight, torch.cat([cx[rows], cB[g], cC[g]]))
        for name in ("dt_bias", "A_log", "D"):
            assert torch.equal(getattr(mixer, name), full[f"{prefix}.{name}"][h])
        assert torch.equal(mixer.norm.weight, full[f"{prefix}.norm.weight"][rows])
        assert torch.equal(mixer.out_proj.weight, full[f"{prefix}.out_proj.weight"][:, rows])
        conv, ssm = mixer.state_spec().tensors
        local_groups = 1 if groups == 1 else groups // 2
        assert conv.shape == (inner // 2 + 2 * local_groups * state, cfg_conv_kernel(cfg) - 1)
        assert ssm.shape == (heads // 2, head_dim, state)


def cfg_conv_kernel(cfg) -> int:
    return getattr(cfg, "conv_kernel", None) or cfg.mamba_d_conv


class _PlusOther(TensorParallelGroup):
    """A rank whose all-reduce adds the other rank's partial sum (given by the test)."""

    other: torch.Tensor | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x + type(self).other


def test_a_norm_group_spanning_the_ranks_is_normalised_over_all_of_it():
    gen = torch.Generator().manual_seed(0)
    x, gate, weight = torch.randn(3, 32, generator=gen), torch.randn(3, 32, generator=gen), torch.randn(32, generator=gen)
    whole = GatedRMSNorm(32, 32)  # one group over all 32 rows
    whole.weight.data.copy_(weight)
    halves = []
    for rank in range(2):
        rows = Shard(rank * 16, 16, 32)
        norm = ParallelGatedRMSNorm(rows, 32, 1e-6, _PlusOther(rank, 2))
        assert norm.spans_ranks
        norm.load_full("weight", weight)
        other = slice(16, 32) if rank == 0 else slice(0, 16)
        _PlusOther.other = (x[:, other] * torch.nn.functional.silu(gate[:, other])).pow(2).sum(-1, keepdim=True)
        halves.append(norm(x[:, rows.start : rows.start + 16], gate[:, rows.start : rows.start + 16]))
    torch.testing.assert_close(torch.cat(halves, dim=-1), whole(x, gate), atol=1e-6, rtol=1e-5)
