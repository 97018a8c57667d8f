"""A `nemotron_h` or `nemotron_h_moe` GGUF file as a NemotronHForCausalLM checkpoint.

llama.cpp's `NemotronHModel` converter (conversion/nemotron.py, over `GraniteHybridModel`, of the
llama.cpp vendored by llama-cpp-python 0.3.36) writes `nemotron_h_moe` when the config has
`num_experts_per_tok`, else `nemotron_h`. Each layer is one mixer under `blk.{i}.attn_norm`:

| GGUF | as stored | Hugging Face (`backbone.layers.{i}.`) |
|---|---|---|
| `ssm_*` (Mamba2 layers) | Mamba2Model's reshapes (`recurrent_gguf.py`) | `mixer.*` |
| `attn_q`, `attn_k`, `attn_v`, `attn_output` | Q/K rows interleaved for ggml's rotary (LlamaModel.permute), though NemotronH has none | `mixer.q_proj` ... `o_proj` |
| `ffn_up`, `ffn_down` (dense files) | as HF | `mixer.up_proj`, `down_proj` |
| `ffn_gate_inp`, `exp_probs_b.bias` | as HF | `mixer.gate.weight`, `.e_score_correction_bias` |
| `ffn_up_exps`, `ffn_down_exps` | every expert's matrix in one `[experts, out, in]` stack | `mixer.experts.up_proj`, `down_proj` (stacked) |
| `ffn_up_shexp`, `ffn_down_shexp` | as HF | `mixer.shared_experts.*` |

Which layer is which: llama.cpp's loader (src/models/nemotron-h.cpp) reads a layer with a
nonzero `attention.head_count_kv` entry as attention, one with a nonzero `feed_forward_length`
entry as an MLP (a MoE in `nemotron_h_moe`, where every such layer routes), any other as Mamba2.
The router is sigmoid with the correction bias (fixed in llama.cpp's graph), experts and MLPs
relu2 (fixed), `expert_weights_norm` / `expert_weights_scale` / `expert_group_count` /
`expert_group_used_count` as NemotronH's `norm_topk_prob` / `routed_scaling_factor` / `n_group` /
`topk_group`. Trailing multi-token-prediction blocks (`nextn_predict_layers`) are skipped. The
file has no `time_step_min`: NemotronH clamps dt at the config's default (0.001), where llama.cpp
does not clamp; slotrunner follows the model. transformers' GGUF loader does not read
`nemotron_h`: the tests check this reader against the model a tiny file was written from.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import NemotronHConfig

from slotrunner.core_runner.loader.gguf_file import GGUFFile
from slotrunner.models.llama_gguf import GGUFCheckpoint, make_config, metadata_getter, token_ids
from slotrunner.models.recurrent_gguf import (
    MixerNames, RecurrentCheckpoint, mamba2_mixer_names, mamba2_sizes, tensor_shape, whole_name_table,
)

_PROJECTIONS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj", "ffn_up": "up_proj",
                "ffn_down": "down_proj", "ffn_up_shexp": "shared_experts.up_proj",
                "ffn_down_shexp": "shared_experts.down_proj"}  # fmt: skip
_LAYER = {
    "attn_norm.weight": "norm.weight",
    **mamba2_mixer_names("mixer"),
    **{f"{g}.{suffix}": f"mixer.{hf}.{suffix}" for g, hf in _PROJECTIONS.items() for suffix in ("weight", "bias")},
    "ffn_gate_inp.weight": "mixer.gate.weight",
    "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_exps.weight": "mixer.experts.up_proj",
    "ffn_down_exps.weight": "mixer.experts.down_proj",
}
_GLOBAL = {"token_embd.weight": "backbone.embeddings.weight", "output_norm.weight": "backbone.norm_f.weight",
           "output.weight": "lm_head.weight"}  # fmt: skip
# Granite's multipliers, which the converter's base class would write: NemotronH has none
_GRANITE_SCALES = ("attention.scale", "embedding_scale", "residual_scale", "logit_scale")
_ROTARY = (".mixer.q_proj.", ".mixer.k_proj.")


def read_nemotron_h_gguf(gguf: GGUFFile, path: str, dtype: torch.dtype, pack: bool = False) -> GGUFCheckpoint:
    """Read an opened `nemotron_h` / `nemotron_h_moe` GGUF file's config, tokenizer and tensor
    table (not the data) as a NemotronHForCausalLM (module docstring). Raises ValueError naming
    the file for tensors or metadata the model cannot use."""
    arch = gguf.metadata["general.architecture"]
    get = metadata_getter(gguf, arch, path)
    if scales := [f"{arch}.{key}" for key in (*_GRANITE_SCALES, "moe_latent_size") if f"{arch}.{key}" in gguf.metadata]:
        raise ValueError(f"{path}: {', '.join(scales)} is not supported: NemotronH has no such multiplier or latent MoE.")
    num_layers = get("block_count") - get("nextn_predict_layers", 0)
    names = whole_name_table(gguf, path, _GLOBAL, _LAYER, "backbone.layers", "NemotronHForCausalLM", num_layers)
    kinds = _layer_kinds(gguf, arch, num_layers, path)
    for i, kind in enumerate(kinds):
        routed = f"backbone.layers.{i}.mixer.gate.weight" in names
        if kind in ("mlp", "moe") and routed != (kind == "moe"):
            raise ValueError(f"{path}: layer {i} is {'a MoE' if kind == 'moe' else 'an MLP'} in {arch} "
                             f"but {'lacks' if kind == 'moe' else 'has'} blk.{i}.ffn_gate_inp.weight.")  # fmt: skip
    config = _config(gguf, arch, names, kinds, path)
    mixer = MixerNames(d="mixer.D", norm="mixer.norm.weight")
    return RecurrentCheckpoint.of(gguf, path, dtype, config, names, pack, mixer=mixer, rotary_projections=_ROTARY)


def _per_layer(get: Any, key: str, num_layers: int, path: str, arch: str) -> list[int]:
    """A per-layer metadata array (or one value for every layer), the trunk's entries."""
    value = get(key)
    values = [int(v) for v in value] if hasattr(value, "__len__") else [int(value)] * num_layers
    if len(values) < num_layers:
        raise ValueError(f"{path}: {arch}.{key} has {len(values)} entries for {num_layers} layers.")
    return values[:num_layers]


def _layer_kinds(gguf: GGUFFile, arch: str, num_layers: int, path: str) -> list[str]:
    """NemotronH's `layers_block_type`, as llama.cpp tells the layers apart (module docstring)."""
    get = metadata_getter(gguf, arch, path)
    kv = _per_layer(get, "attention.head_count_kv", num_layers, path, arch)
    ff = _per_layer(get, "feed_forward_length", num_layers, path, arch)
    ffn = "moe" if arch == "nemotron_h_moe" else "mlp"
    return ["full_attention" if k > 0 else ffn if f > 0 else "linear_attention" for k, f in zip(kv, ff)]


def _one(values: list[int], what: str, path: str) -> int | None:
    """The one value `values` share (None if empty), or a ValueError naming the file."""
    if len(set(values)) > 1:
        raise ValueError(f"{path}: {what} differs between layers ({values}); NemotronH has one for all.")
    return values[0] if values else None


def _config(gguf: GGUFFile, arch: str, names: Mapping[str, str], kinds: list[str], path: str) -> NemotronHConfig:
    get = metadata_getter(gguf, arch, path)
    num_layers, metadata = len(kinds), gguf.metadata
    hidden, heads = get("embedding_length"), get("attention.head_count")
    kv = _per_layer(get, "attention.head_count_kv", num_layers, path, arch)
    ff = _per_layer(get, "feed_forward_length", num_layers, path, arch)
    num_kv = _one([k for k in kv if k > 0], f"{arch}.attention.head_count_kv", path)
    inner, ssm_heads, state, groups, kernel = mamba2_sizes(gguf, arch, names, "mixer.conv1d.weight", path)
    fields: dict[str, Any] = dict(
        architectures=["NemotronHForCausalLM"],
        vocab_size=gguf.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        layers_block_type=kinds,
        num_attention_heads=heads,
        num_key_value_heads=num_kv or heads,
        head_dim=get("attention.key_length", hidden // heads),
        layer_norm_epsilon=get("attention.layer_norm_epsilon", get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=get("context_length"),
        mamba_num_heads=ssm_heads,
        mamba_head_dim=inner // ssm_heads,
        ssm_state_size=state,
        n_groups=groups,
        conv_kernel=kernel,
        use_conv_bias=any(n.endswith("mixer.conv1d.bias") for n in names),
        use_bias=any(n.endswith("mixer.in_proj.bias") for n in names),
        attention_bias=any(n.endswith("mixer.q_proj.bias") for n in names),
        mlp_bias=any(n.endswith("mixer.up_proj.bias") for n in names),
        mamba_hidden_act="silu",  # llama.cpp's fixed activations
        mlp_hidden_act="relu2",
        tie_word_embeddings="lm_head.weight" not in names,
        **token_ids(metadata),
    )
    dense = _one([f for f, k in zip(ff, kinds) if k == "mlp"], f"{arch}.feed_forward_length", path)
    if dense is not None:
        fields["intermediate_size"] = dense
    if "moe" in kinds:
        fields.update(_moe_fields(gguf, arch, names, path))
    return make_config(NemotronHConfig, fields, path, arch)


def _moe_fields(gguf: GGUFFile, arch: str, names: Mapping[str, str], path: str) -> dict[str, Any]:
    get = metadata_getter(gguf, arch, path)
    stacks = [tuple(gguf.tensors[g].shape) for hf, g in names.items() if hf.endswith("mixer.experts.up_proj")]
    if len(set(stacks)) > 1:  # NemotronH-Puzzle files: another expert width per layer
        raise ValueError(f"{path}: ffn_up_exps shapes differ between layers ({sorted(set(stacks))}); NemotronH has one.")
    experts = stacks[0] if stacks else None  # [experts, ff, hidden]
    shared = tensor_shape(gguf, names, "mixer.shared_experts.up_proj.weight")  # [ff, hidden]
    if experts is None or shared is None:
        raise ValueError(f"{path}: a MoE layer without ffn_up_exps or ffn_up_shexp tensors.")
    if get("expert_count") != experts[0]:
        raise ValueError(f"{path}: {arch}.expert_count is {get('expert_count')} but ffn_up_exps holds {experts[0]} experts.")
    used = get("expert_used_count")
    used = _one([int(u) for u in used] if hasattr(used, "__len__") else [int(used)], f"{arch}.expert_used_count", path)
    return dict(
        n_routed_experts=experts[0],
        num_experts_per_tok=used,
        moe_intermediate_size=experts[1],
        moe_shared_expert_intermediate_size=shared[0],
        norm_topk_prob=bool(get("expert_weights_norm", False)),  # llama.cpp's defaults when absent
        routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
        n_group=max(1, get("expert_group_count", 1)),
        topk_group=max(1, get("expert_group_used_count", 1)),
    )
