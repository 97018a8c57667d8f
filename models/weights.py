"""WeightLoader: copies checkpoint tensors (Hugging Face names) into a model's parameters.

Handles the renames a fused module needs (q/k/v -> qkv_proj shards), hands packed GGUF weights
(`PackedWeight`) to the modules that run them packed (`load_packed`) and dequantizes them for
any other parameter, and reports every mismatch by tensor name: a checkpoint tensor the model
does not consume, a parameter the checkpoint lacks, a shape that differs.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

import torch
from torch import nn

from slotrunner.core_runner.cpu.packed import PackedWeight
from slotrunner.models.layers.linear import MergedLinear
from slotrunner.models.layers.parallel_linear import ShardedWeights


# WeightLoader's `merged` maps for the usual fusions: checkpoint q/k/v -> one `qkv_proj`, gate/up
# -> one `gate_up_proj` (MergedLinear shards). A name matches anywhere in a tensor's name, so
# they serve `model.layers.{i}.self_attn.*` and `backbone.layers.{i}.mixer.*` alike; combine
# them with `|`. (A model whose other modules say `up_proj`, NemotronH's MLPs, takes QKV alone.)
QKV_SHARDS: dict[str, tuple[str, str]] = {f".{p}_proj.": (".qkv_proj.", p) for p in ("q", "k", "v")}
GATE_UP_SHARDS: dict[str, tuple[str, str]] = {f".{p}_proj.": (".gate_up_proj.", p) for p in ("gate", "up")}


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
                    cls = type(self.model).__name__
                    raise WeightLoadError(
                        f"checkpoint tensor {name!r} is not consumed by {cls}: the `merged` mapping of "
                        f"{cls}.load_weights sends it to {param_name!r}, which is not a MergedLinear parameter of "
                        "the model; fix the mapping, or give that module the shard"
                    )
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
                cls = type(self.model).__name__
                raise WeightLoadError(
                    f"checkpoint tensor {name!r} is not consumed by {cls}: it has no parameter of that name"
                    f"{self._closest(name)}. Map the name in {cls}.load_weights, or list it in "
                    "WeightLoader(ignore_unexpected=...) if the model does not need it; a checkpoint of another "
                    "architecture fails here too"
                )
            module = self.modules.get(name.rpartition(".")[0])
            if isinstance(module, ShardedWeights):  # tensor parallel: the layer keeps its rank's part
                try:
                    module.load_full(name.rpartition(".")[2], tensor)
                except ValueError as e:
                    raise WeightLoadError(f"checkpoint tensor {name!r}: {e}") from None
                loaded.add(name)
                continue
            if tuple(tensor.shape) != tuple(param.shape):
                shape, expected = tuple(tensor.shape), tuple(param.shape)
                hint = ""
                if tensor.dim() == 2 and shape == expected[::-1]:
                    cls = type(self.model).__name__
                    hint = f" (its transpose: an [in, out] Conv1D-style weight? transpose it in {cls}.load_weights)"
                raise WeightLoadError(f"checkpoint tensor {name!r} has shape {shape}, the model expects {expected}{hint}")
            module = self.modules.get(name.rpartition(".")[0])
            if isinstance(tensor, PackedWeight):
                if name.endswith(".weight") and hasattr(module, "load_packed"):
                    module.load_packed(tensor)
                    loaded.add(name)
                    continue
                tensor = tensor.dequantize()
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        missing = sorted(self._checkpoint_names(m, shards_seen.get(m, set())) for m in set(self.params) - loaded)
        missing = [name for names in missing for name in names]
        if missing:
            shown = ", ".join(repr(m) for m in missing[:5]) + (" ..." if len(missing) > 5 else "")
            cls = type(self.model).__name__
            raise WeightLoadError(
                f"checkpoint lacks {len(missing)} weight(s) of {cls}: {shown}. If the file names them differently, "
                f"map the names in {cls}.load_weights; if the model ties them to another weight (embeddings), "
                "build that module as None, as lm_head is for tie_word_embeddings"
            )
        return loaded

    def _closest(self, name: str) -> str:
        """The model parameter whose name is nearest `name`, as a hint for the mapping."""
        match = difflib.get_close_matches(name, list(self.params), n=1, cutoff=0.6)
        return f" (nearest model parameter: {match[0]!r})" if match else ""

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
