"""One activation table serves every layer: plain (`hf_activation`), module (`Act`, the towers)
and gated (`GatedAct`, the fused [gate | up] projection).

Guards against: the tables drifting apart again (there were three: the towers lacked `relu2`,
the gated activation `swish` and `gelu_new`), two names of one function running different
kernels, and an unknown name accepted at build time only to fail inside a step.
"""

from __future__ import annotations

import pytest
import torch

from slotrunner.models.layers.activation import _KERNEL_ACTS, GatedAct, gated_act_ref
from slotrunner.models.layers.hf_act import _ACTS, Act, hf_activation


@pytest.mark.parametrize("name", sorted(_ACTS))
def test_every_name_serves_every_layer(name: str) -> None:
    x = torch.randn(3, 2 * 8, generator=torch.Generator().manual_seed(0))
    fn = hf_activation(name)
    assert torch.equal(Act(name)(x), fn(x))
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(GatedAct(name)(x), fn(gate) * up)
    assert torch.equal(gated_act_ref(x, name), fn(gate) * up)


def test_aliases_share_the_kernel() -> None:
    assert _KERNEL_ACTS[hf_activation("swish")] == _KERNEL_ACTS[hf_activation("silu")]
    assert _KERNEL_ACTS[hf_activation("gelu_new")] == _KERNEL_ACTS[hf_activation("gelu_pytorch_tanh")]
    assert hf_activation("quick_gelu") not in _KERNEL_ACTS  # the reference computes it


@pytest.mark.parametrize("layer", [Act, GatedAct, hf_activation])
def test_unknown_name_is_refused_at_build_time(layer) -> None:
    with pytest.raises(ValueError, match=r"activation 'gelu_fast' is not supported \(supported: \['gelu'"):
        layer("gelu_fast")
