"""Media items on their way to a tower (models/layers/media_item.py): the host-side copy.

Guards against: the staging copy (`concat_into`, what `stack_to_device` gathers into page-locked
memory on CUDA) putting items out of order, dropping a strided view's layout, or failing on a
dtype numpy lacks.
"""

from __future__ import annotations

import pytest
import torch

from slotrunner.models.layers.media_item import concat_into


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.int64, torch.bfloat16])
def test_concat_into_equals_torch_cat(dtype):
    gen = torch.Generator().manual_seed(0)
    parts = [(torch.rand(n, 3, 5, 7, generator=gen) * 200).to(dtype) for n in (1, 2, 1)]
    parts[1] = parts[1].transpose(2, 3).contiguous().transpose(2, 3)  # a strided layout
    out = torch.empty(4, 3, 5, 7, dtype=dtype)
    concat_into(parts, out)
    assert torch.equal(out, torch.cat(parts))
