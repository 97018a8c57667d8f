"""WeightLoader: copies checkpoint tensors (Hugging Face names) into a model's parameters.

Handles the renames a fused module needs (q/k/v -> qkv_proj shards), and reports every
mismatch by tensor name: a checkpoint tensor the model does not consume, a parameter the
checkpoint lacks, a shape that differs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from slotrunner.models.layers.linear import MergedLinear


class WeightLoadError(ValueError):
    pass


class WeightLoader:
    def __init__(
        self,
        model: nn.Module,
        merged: dict[str, tuple[str, str]] | None = None,  # ".q_proj." -> (".qkv_proj.", "q")
        ignore_unexpected: tuple[str, ...] = ("rotary_emb.inv_freq",),
    ) -> None:
        self.model = model
        self.merged = merged or {}
        self.ignore_unexpected = ignore_unexpected
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load every tensor; raise WeightLoadError at the first bad one, or if any parameter
        (or fused shard) was never written. Returns the names of the loaded parameters."""
        loaded: set[str] = set()
        shards_seen: dict[str, set[str]] = {}
        tied = getattr(self.model, "lm_head", "absent") is None
        for name, tensor in weights:
            if tied and name == "lm_head.weight":
                continue  # some tied checkpoints store the head anyway; the embedding is used
            target = self._merged_target(name)
            if target is not None:
                param_name, shard = target
                module_name, _, attr = param_name.rpartition(".")
                module = self.modules.get(module_name)
                if not isinstance(module, MergedLinear) or param_name not in self.params:
                    raise WeightLoadError(f"checkpoint tensor {name!r} maps to {param_name!r}, which the model lacks")
                try:
                    module.load_shard(attr, shard, tensor)
                except ValueError as e:
                    raise WeightLoadError(f"checkpoint tensor {name!r}: {e}") from None
                shards_seen.setdefault(param_name, set()).add(shard)
                if shards_seen[param_name] == set(module.shard_offsets):
                    loaded.add(param_name)
                continue
            param = self.params.get(name)
            if param is None:
                if any(name.endswith(s) for s in self.ignore_unexpected):
                    continue
                raise WeightLoadError(
                    f"checkpoint tensor {name!r} is not consumed by {type(self.model).__name__}: "
                    "the checkpoint does not match this architecture, or the name mapping misses it"
                )
            if tuple(tensor.shape) != tuple(param.shape):
                raise WeightLoadError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        missing = sorted(self._checkpoint_names(m, shards_seen.get(m, set())) for m in set(self.params) - loaded)
        missing = [name for names in missing for name in names]
        if missing:
            shown = ", ".join(repr(m) for m in missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise WeightLoadError(f"checkpoint lacks {len(missing)} weight(s) of {type(self.model).__name__}: {shown}")
        return loaded

    def _checkpoint_names(self, param_name: str, shards_seen: set[str]) -> list[str]:
        """The checkpoint tensor names that would have filled `param_name` but were absent."""
        module = self.modules.get(param_name.rpartition(".")[0])
        if not isinstance(module, MergedLinear):
            return [param_name]
        names = []
        for old, (new, shard) in self.merged.items():
            if new in param_name and shard in module.shard_offsets and shard not in shards_seen:
                names.append(param_name.replace(new, old))
        return names or [param_name]

    def _merged_target(self, name: str) -> tuple[str, str] | None:
        for old, (new, shard) in self.merged.items():
            if old in name:
                return name.replace(old, new), shard
        return None
