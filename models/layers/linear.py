"""Linear layers: `Linear` (whose weight may stay packed in GGUF blocks on a CPU), the fused
`MergedLinear` (qkv, gate_up: several checkpoint tensors in one weight) and `VocabEmbedding`
(the token embedding, packed or dense; `lm_head.py` multiplies by its table when the output
head is tied to it)."""

from __future__ import annotations

import torch
from torch import nn

from slotrunner.core_runner.cpu.packed import PackedWeight, packed_linear
from slotrunner.models.layers.activation import gated_act
from slotrunner.models.layers.norm import RMSNorm
from slotrunner.models.layers.skinny_gemm import skinny_linear, skinny_norm_linear, wants_skinny


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias): the skinny kernel for the few rows of a small GPU decode batch,
    torch (cuBLAS, or the CPU's BLAS) for the rest."""
    if wants_skinny(x, weight):
        return skinny_linear(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


def _take_packed(module: nn.Module, weight: PackedWeight, expected: tuple[int, int]) -> None:
    """Keep `weight` as the module's packed weight and release its dense one."""
    if weight.shape != expected:
        raise ValueError(f"shape {weight.shape} does not match expected {expected}")
    module.packed = weight
    module.weight.data = torch.empty(0, dtype=module.weight.dtype, device=module.weight.device)


class Linear(nn.Linear):
    """nn.Linear whose weight the loader may hand over packed (`load_packed`); the product then
    runs through the native packed kernel and the dense weight is released."""

    packed: PackedWeight | None = None

    def load_packed(self, weight: PackedWeight) -> None:
        _take_packed(self, weight, (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return dense_linear(x, self.weight, self.bias)

    def _fuses(self, x: torch.Tensor, act: str | None = None) -> bool:
        """Whether the skinny kernel computes this layer's product of `x` and may take in the
        small kernel before it (a subclass with its own forward, e.g. tensor-parallel, never)."""
        return self.packed is None and type(self).forward is Linear.forward and wants_skinny(x, self.weight, act)

    def forward_gated(self, h: torch.Tensor, act: str) -> torch.Tensor:
        """self(act(gate) * up) for h = [gate | up] (an MLP's down projection): in one launch
        with the product where the skinny kernel takes it (a GPU decode of 1-2 rows)."""
        if self._fuses(h, act):
            return skinny_linear(h, self.weight, self.bias, act=act)
        return self(gated_act(h, act))

    def forward_normed(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(h), x + residual) with h, x + residual = norm(x, residual) (a decoder layer's
        residual add, norm and first product): in one launch where the skinny kernel takes it."""
        if type(norm).forward is RMSNorm.forward and residual.dtype == x.dtype == norm.weight.dtype and self._fuses(x):
            return skinny_norm_linear(x, residual, norm.weight, norm.eps, norm.unit_offset, self.weight, self.bias)
        x, residual = norm(x, residual)
        return self(x), residual


class MergedLinear(Linear):
    """One matmul for several projections of the same input. `shard_sizes` name the output rows
    of each part, so the loader can copy checkpoint tensor `part` into its rows. Packed shards
    are kept packed if every shard of the weight arrives packed in one format, and written
    dequantized into the dense weight otherwise."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (start, size)
            start += size
        self._packed_shards: dict[str, PackedWeight] = {}
        self._dense_shards: set[str] = set()

    def load_shard(self, param_name: str, shard: str, tensor: torch.Tensor | PackedWeight) -> None:
        param = getattr(self, param_name)
        start, size = self.shard_offsets[shard]
        expected = (size, self.in_features) if param_name == "weight" else (size,)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"shape {tuple(tensor.shape)} does not match expected {expected}")
        if isinstance(tensor, PackedWeight):
            if param_name != "weight":
                tensor = tensor.dequantize()
            else:
                self._packed_shards[shard] = tensor
                self._settle_packed()
                return
        elif param_name == "weight":
            self._dense_shards.add(shard)
            self._settle_packed()
        with torch.no_grad():
            param[start : start + size].copy_(tensor)

    def _settle_packed(self) -> None:
        """Once every weight shard is in: pack the whole weight, or densify the packed shards."""
        if len(self._packed_shards) + len(self._dense_shards) < len(self.shard_offsets):
            return
        parts = [self._packed_shards.get(name) for name in self.shard_offsets]
        if all(parts) and len({p.format for p in parts}) == 1:
            self.load_packed(PackedWeight.cat(parts))
        else:
            with torch.no_grad():
                for name, part in self._packed_shards.items():
                    start, size = self.shard_offsets[name]
                    self.weight[start : start + size].copy_(part.dequantize())
        self._packed_shards, self._dense_shards = {}, set()


class VocabEmbedding(nn.Embedding):
    """Token embedding. Loaded packed, it keeps only the packed table: a lookup dequantizes the
    rows it reads (exactly the float32 rows of the dense table), and a head tied to it
    (`lm_head.vocab_logits`) multiplies the table in the native kernel."""

    packed: PackedWeight | None = None

    def load_packed(self, weight: PackedWeight) -> None:
        _take_packed(self, weight, (self.num_embeddings, self.embedding_dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., hidden]
        if self.packed is None:
            return super().forward(input_ids)
        rows = self.packed.select_rows(input_ids.reshape(-1)).dequantize()
        return rows.view(*input_ids.shape, rows.shape[-1])
