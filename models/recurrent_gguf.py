"""llama.cpp's GGUF conventions for recurrent token mixers, both ways, in one place.

Every recurrent mixer llama.cpp's converter writes (`Mamba2Model` and its subclasses
`FalconH1Model`, `GraniteHybridModel`, `NemotronHModel`; `Qwen3NextModel`'s gated delta-net)
reshapes the same few tensors:

| HF tensor | in the file |
|---|---|
| `conv1d.weight` `[conv_dim, 1, kernel]` | `ssm_conv1d.weight` `[conv_dim, kernel]` (squeezed) |
| `A_log` `[heads]` | `ssm_a` = -exp(A_log): `[heads, 1]` (Mamba2Model) or `[heads]` (Qwen3NextModel) |
| `D` `[heads]` | `ssm_d` `[heads, 1]` (Mamba2Model) |
| the gated norm's `weight` `[inner]` | `ssm_norm.weight` `[groups, inner / groups]` (Mamba2Model) or as is |
| `dt_bias` | `ssm_dt.bias` (renamed only) |

`to_gguf` is the converter's direction (the conformance writer uses it); `RecurrentCheckpoint`
undoes it while it yields the weights. A_log comes back through log(-A), so it can differ from
the original in the last bit (the model computes -exp(A_log) again).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping

import torch

from slotrunner.core_runner.cpu.packed import PackedWeight
from slotrunner.core_runner.loader.gguf_file import GGUFFile
from slotrunner.models.llama_gguf import GGUFCheckpoint, metadata_getter


# A Mamba2 mixer's tensors (Mamba2Model, and the hybrids built on it): GGUF name after
# `blk.{i}.` -> HF name after the mixer module (`mixer.` in Mamba2, `mamba.` in Falcon-H1)
MAMBA2_MIXER_TENSORS = {
    "ssm_in.weight": "in_proj.weight", "ssm_in.bias": "in_proj.bias", "ssm_conv1d.weight": "conv1d.weight",
    "ssm_conv1d.bias": "conv1d.bias", "ssm_dt.bias": "dt_bias", "ssm_a": "A_log", "ssm_d": "D",
    "ssm_norm.weight": "norm.weight", "ssm_out.weight": "out_proj.weight", "ssm_out.bias": "out_proj.bias",
}  # fmt: skip


def mamba2_mixer_names(module: str) -> dict[str, str]:
    """MAMBA2_MIXER_TENSORS with the HF names under `module` ("mixer", "mamba")."""
    return {gguf: f"{module}.{hf}" for gguf, hf in MAMBA2_MIXER_TENSORS.items()}


@dataclasses.dataclass(frozen=True)
class MixerNames:
    """The HF parameter names (their last dotted parts) of a recurrent mixer's reshaped tensors."""

    conv: str = "conv1d.weight"
    a_log: str = "A_log"
    d: str = "mixer.D"
    norm: str = "mixer.norm.weight"  # the gated output norm


def to_gguf(kind: str, tensor: torch.Tensor, groups: int | None = None, column: bool = True) -> torch.Tensor:
    """A mixer tensor as the converter stores it. `kind`: "conv", "a_log", "d" or "norm";
    `column`: A and D as [heads, 1] (Mamba2Model) rather than [heads] (Qwen3NextModel);
    `groups`: the norm's groups (Mamba2Model reshapes it to [groups, inner / groups], even for
    one group); None: the norm as it is (Qwen3NextModel)."""
    if kind == "conv":
        return tensor.squeeze(1)
    if kind == "a_log":
        tensor = -torch.exp(tensor)
    if kind in ("a_log", "d") and column:
        return tensor.reshape(-1, 1)
    if kind == "norm" and groups is not None:
        return tensor.reshape(groups, -1)
    return tensor


@dataclasses.dataclass(frozen=True)
class RecurrentCheckpoint(GGUFCheckpoint):
    """Yields a recurrent model's tensors in transformers' shapes (see the module docstring)."""

    mixer: MixerNames = MixerNames()

    def weights(self) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        for name, tensor in super().weights():
            if isinstance(tensor, PackedWeight):
                if name.endswith(self.mixer.conv):
                    raise ValueError(f"{self.path}: a quantized ssm_conv1d is not supported (llama.cpp keeps it float).")
                yield name, tensor
            elif name.endswith(self.mixer.conv):
                yield name, tensor.unsqueeze(1)
            elif name.endswith(self.mixer.a_log):
                yield name, torch.log(-tensor.float().reshape(-1)).to(self.dtype)
            elif name.endswith((self.mixer.d, self.mixer.norm)):
                yield name, tensor.reshape(-1)
            else:
                yield name, tensor


_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


def whole_name_table(
    gguf: GGUFFile,
    path: str,
    global_names: Mapping[str, str],  # whole GGUF name -> HF name
    layer_names: Mapping[str, str],  # GGUF name after blk.{i}. -> HF name after the layer prefix
    layer_prefix: str,  # "model.layers", "backbone.layers"
    model: str,  # the HF architecture, for errors
    num_layers: int | None = None,  # blocks from this one on are skipped (multi-token-prediction blocks)
) -> dict[str, str]:
    """`{hf_name: gguf_name}` for every tensor of a file whose tables map whole names (suffix
    included, as the recurrent converters write some tensors without one); raises, naming the
    file, on a tensor the model lacks or a file without its token embedding."""
    names, unknown = {}, []
    for gguf_name in gguf.tensors:
        layer = _LAYER_TENSOR.fullmatch(gguf_name)
        if gguf_name in global_names:
            names[global_names[gguf_name]] = gguf_name
        elif layer and num_layers is not None and int(layer.group(1)) >= num_layers:
            continue
        elif layer and layer.group(2) in layer_names:
            names[f"{layer_prefix}.{layer.group(1)}.{layer_names[layer.group(2)]}"] = gguf_name
        else:
            unknown.append(gguf_name)
    if unknown:
        hint = ""
        if any("ffn_gate_up_exps." in n for n in unknown):
            hint = " (experts with gate and up fused in one stack are not read yet; convert with them apart)"
        raise ValueError(f"{path}: tensors with no {model} equivalent: {', '.join(unknown[:8])}{hint}.")
    if global_names["token_embd.weight"] not in names:
        raise ValueError(f"{path}: no token_embd.weight tensor, so this is not a complete {model} model.")
    return names


def tensor_shape(gguf: GGUFFile, names: Mapping[str, str], hf_suffix: str) -> tuple[int, ...] | None:
    """The shape of the first tensor whose HF name (in `names`, {hf: gguf}) ends with `hf_suffix`, or None."""
    name = next((n for n in names if n.endswith(hf_suffix)), None)
    return None if name is None else tuple(gguf.tensors[names[name]].shape)


def mamba2_sizes(gguf: GGUFFile, arch: str, names: Mapping[str, str], conv: str, path: str) -> tuple[int, ...]:
    """(inner, heads, state, groups, kernel) from the `{arch}.ssm.*` keys of a Mamba2 mixer
    (`add_ssm_keys`' five), checked against each other and the conv tensor (HF name suffix `conv`);
    a ValueError naming the file where they disagree."""
    get = metadata_getter(gguf, arch, path)
    inner, heads = get("ssm.inner_size"), get("ssm.time_step_rank")
    state, groups, kernel = get("ssm.state_size"), get("ssm.group_count", 1), get("ssm.conv_kernel")
    if heads <= 0 or inner % heads or groups <= 0 or inner % groups:
        raise ValueError(f"{path}: ssm.inner_size {inner} does not split into {heads} heads and {groups} groups.")
    shape = tensor_shape(gguf, names, conv)
    if shape is not None and shape != (inner + 2 * groups * state, kernel):
        raise ValueError(f"{path}: ssm_conv1d has shape {shape}, the metadata implies {(inner + 2 * groups * state, kernel)}.")
    return inner, heads, state, groups, kernel
