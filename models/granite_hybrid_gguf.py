"""A `granitehybrid` GGUF file (Granite 4.0-H, or Bamba) as a Hugging Face checkpoint.

llama.cpp's converter registers `GraniteMoeHybridForCausalLM` and `BambaForCausalLM` under one
class, `GraniteHybridModel` (conversion/granite.py, over `Mamba2Model` and `GraniteMoeModel`, of
the llama.cpp vendored by llama-cpp-python 0.3.36), and writes both as `granitehybrid`:

| GGUF | as stored | Hugging Face |
|---|---|---|
| `ssm_*` (Mamba2 layers) | Mamba2Model's reshapes (`recurrent_gguf.py`) | `mamba.*` |
| `attn_q`, `attn_k` (attention layers) | rows interleaved for ggml's rotary (LlamaModel.permute), with or without RoPE | `self_attn.q_proj`, `k_proj` |
| `ffn_gate_exps` + `ffn_up_exps` | `block_sparse_moe.input_linear` split in its gate and up halves | `block_sparse_moe.input_linear` |
| `ffn_down_exps`, `ffn_gate_inp` | as HF | `block_sparse_moe.output_linear`, `.router.layer` |
| `ffn_gate_shexp` + `ffn_up_shexp` (with experts), `ffn_gate` + `ffn_up` (without) | `shared_mlp.input_linear` split | `shared_mlp.input_linear` (Granite), or Bamba's `feed_forward.gate_proj` / `up_proj` |
| `ffn_down_shexp` / `ffn_down` | as HF | `shared_mlp.output_linear` / `feed_forward.down_proj` |
| `ffn_norm`, `output_norm` | as HF | `post_attention_layernorm`, `model.norm` (Granite); `pre_ff_layernorm`, `model.final_layernorm` (Bamba) |

Which class a file is: the converter writes Granite's multipliers as `attention.scale`,
`embedding_scale`, `residual_scale`, `logit_scale` (Bamba has none), and `rope.scaling.finetuned`
true only for Bamba (llama.cpp rotates a granitehybrid file's attention only then; Granite 4.0
has no position embedding, and its file gets context length 2**20). So a dense file with RoPE
and no Granite multiplier is a Bamba; anything else a GraniteMoeHybrid, its missing multipliers
what llama.cpp assumes (1, attention head_dim**-0.5). Which layers attend: those with a nonzero
entry in the `attention.head_count_kv` array. A Bamba's partial rotary comes from
`rope.dimension_count` (its hub configs' `attn_rotary_emb`); llama.cpp rotates the pairs of the
permuted head, not HF's halves of the rotated part: there slotrunner follows the
model. transformers' GGUF loader does not read `granitehybrid`: the tests check this reader
against the model a tiny file was written from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

import torch
from transformers import BambaConfig, GraniteMoeHybridConfig, PretrainedConfig

from slotrunner.core_runner.cpu.packed import PackedWeight
from slotrunner.core_runner.loader.gguf_file import GGUFFile
from slotrunner.models.llama_gguf import GGUFCheckpoint, make_config, metadata_getter, token_ids
from slotrunner.models.recurrent_gguf import (
    MixerNames, RecurrentCheckpoint, mamba2_mixer_names, mamba2_sizes, tensor_shape, whole_name_table,
)

_ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj"}  # fmt: skip
_COMMON = {
    "attn_norm.weight": "input_layernorm.weight",
    **{f"{g}.{suffix}": f"{hf}.{suffix}" for g, hf in _ATTENTION.items() for suffix in ("weight", "bias")},
    **mamba2_mixer_names("mamba"),
}
# A tensor the converter split in two: HF name + ".gate" / ".up", joined again by the checkpoint.
_GRANITE = {
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "block_sparse_moe.router.layer.weight",
    "ffn_gate_exps.weight": "block_sparse_moe.input_linear.gate", "ffn_up_exps.weight": "block_sparse_moe.input_linear.up",
    "ffn_down_exps.weight": "block_sparse_moe.output_linear.weight",
    "ffn_gate_shexp.weight": "shared_mlp.input_linear.gate", "ffn_up_shexp.weight": "shared_mlp.input_linear.up",
    "ffn_down_shexp.weight": "shared_mlp.output_linear.weight",
    "ffn_gate.weight": "shared_mlp.input_linear.gate", "ffn_up.weight": "shared_mlp.input_linear.up",
    "ffn_down.weight": "shared_mlp.output_linear.weight",
}  # fmt: skip
_BAMBA = {"ffn_norm.weight": "pre_ff_layernorm.weight", "ffn_gate.weight": "feed_forward.gate_proj.weight",
          "ffn_up.weight": "feed_forward.up_proj.weight", "ffn_down.weight": "feed_forward.down_proj.weight"}  # fmt: skip
_GRANITE_SCALES = ("attention.scale", "embedding_scale", "residual_scale", "logit_scale")
MIXER = MixerNames(d="mamba.D", norm="mamba.norm.weight")
_HALVES = ("gate", "up")


@dataclasses.dataclass(frozen=True)
class GraniteHybridCheckpoint(RecurrentCheckpoint):
    """Yields the tensors in transformers' shapes, the split gate/up halves joined again (gate
    rows first, as `input_linear` holds them; packed quantized rows stay packed)."""

    def weights(self) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        pending: dict[str, dict[str, torch.Tensor | PackedWeight]] = {}
        for name, tensor in super().weights():
            stem, _, half = name.rpartition(".")
            if half not in _HALVES:
                yield name, tensor
                continue
            halves = pending.setdefault(stem, {})
            halves[half] = tensor
            if len(halves) == 2:
                del pending[stem]
                yield f"{stem}.weight", _join(halves["gate"], halves["up"])
        assert not pending, f"{self.path}: a gate half without its up half in {sorted(pending)}"


def _join(gate: torch.Tensor | PackedWeight, up: torch.Tensor | PackedWeight) -> torch.Tensor | PackedWeight:
    if isinstance(gate, PackedWeight) and isinstance(up, PackedWeight):
        return PackedWeight.cat([gate, up])
    gate, up = (t.dequantize() if isinstance(t, PackedWeight) else t for t in (gate, up))
    return torch.cat([gate, up], dim=-2)  # rows: [out, in], or [experts, out, in]


def read_granite_hybrid_gguf(gguf: GGUFFile, path: str, dtype: torch.dtype, pack: bool = False) -> GGUFCheckpoint:
    """Read an opened `granitehybrid` GGUF file's config, tokenizer and tensor table (not the
    data), as a BambaForCausalLM or a GraniteMoeHybridForCausalLM (module docstring). Raises
    ValueError naming the file for tensors or metadata neither can use."""
    get = metadata_getter(gguf, "granitehybrid", path)
    experts = get("expert_count", 0) > 0 or any(n.endswith("ffn_gate_inp.weight") for n in gguf.tensors)
    scales = [key for key in _GRANITE_SCALES if f"granitehybrid.{key}" in gguf.metadata]
    bamba = bool(get("rope.scaling.finetuned", False)) and not experts and not scales
    model = "BambaForCausalLM" if bamba else "GraniteMoeHybridForCausalLM"
    norm = "model.final_layernorm.weight" if bamba else "model.norm.weight"
    globals_ = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": norm, "output.weight": "lm_head.weight"}
    names = whole_name_table(gguf, path, globals_, _COMMON | (_BAMBA if bamba else _GRANITE), "model.layers", model)
    for stem in {n.rpartition(".")[0] for n in names if n.endswith((".gate", ".up"))}:
        if not all(f"{stem}.{half}" in names for half in _HALVES):
            raise ValueError(f"{path}: {stem} has one of its gate and up halves without the other.")
    config = _bamba_config(gguf, names, path) if bamba else _granite_config(gguf, names, path)
    return GraniteHybridCheckpoint.of(gguf, path, dtype, config, names, pack, mixer=MIXER)


def _common_fields(gguf: GGUFFile, names: Mapping[str, str], path: str) -> tuple[dict, list[int]]:
    """The config fields Bamba and GraniteMoeHybrid share (sizes, the mixer), and the layers that attend."""
    metadata = gguf.metadata
    get = metadata_getter(gguf, "granitehybrid", path)
    hidden, heads, num_layers = get("embedding_length"), get("attention.head_count"), get("block_count")
    kv = get("attention.head_count_kv")
    kv = [int(n) for n in kv] if hasattr(kv, "__len__") else [int(kv)] * num_layers  # an array, or one count
    attention = [i for i, n in enumerate(kv) if n > 0]
    if len(kv) != num_layers or len({kv[i] for i in attention}) > 1:
        raise ValueError(f"{path}: granitehybrid.attention.head_count_kv {kv} is not one head count per attention layer.")
    inner, ssm_heads, state, groups, kernel = mamba2_sizes(gguf, "granitehybrid", names, "mamba.conv1d.weight", path)
    if inner % hidden:
        raise ValueError(f"{path}: ssm.inner_size {inner} is not an expansion of embedding_length {hidden}.")
    return dict(
        vocab_size=gguf.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv[attention[0]] if attention else heads,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
        max_position_embeddings=get("context_length"),
        mamba_n_heads=ssm_heads,
        mamba_d_head=inner // ssm_heads,
        mamba_n_groups=groups,
        mamba_d_state=state,
        mamba_d_conv=kernel,
        mamba_expand=inner // hidden,
        mamba_conv_bias=any(n.endswith("mamba.conv1d.bias") for n in names),
        mamba_proj_bias=any(n.endswith("mamba.in_proj.bias") for n in names),
        attention_bias=any(n.endswith("self_attn.q_proj.bias") for n in names),
        tie_word_embeddings="lm_head.weight" not in names,
        **token_ids(metadata),
    ), attention


def _rope(gguf: GGUFFile, path: str, head_dim: int) -> dict:
    get = metadata_getter(gguf, "granitehybrid", path)
    if get("rope.scaling.type", "none") != "none":
        raise ValueError(f"{path}: RoPE scaling {get('rope.scaling.type')!r} is not supported for granitehybrid.")
    rotary = get("rope.dimension_count", head_dim)
    if not 0 < rotary <= head_dim or rotary % 2:
        raise ValueError(f"{path}: rope.dimension_count {rotary} does not fit a head of {head_dim}.")
    return {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0)), "partial_rotary_factor": rotary / head_dim}


def _bamba_config(gguf: GGUFFile, names: Mapping[str, str], path: str) -> PretrainedConfig:
    fields, attention = _common_fields(gguf, names, path)
    gate = tensor_shape(gguf, names, "feed_forward.gate_proj.weight")
    fields.update(
        architectures=["BambaForCausalLM"],
        intermediate_size=gate[0] if gate else metadata_getter(gguf, "granitehybrid", path)("feed_forward_length"),
        attn_layer_indices=attention,
        rope_parameters=_rope(gguf, path, fields["hidden_size"] // fields["num_attention_heads"]),
    )
    return _make(BambaConfig, fields, path)


def _granite_config(gguf: GGUFFile, names: Mapping[str, str], path: str) -> PretrainedConfig:
    get = metadata_getter(gguf, "granitehybrid", path)
    fields, attention = _common_fields(gguf, names, path)
    head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    rope = _rope(gguf, path, head_dim)
    use_rope = bool(get("rope.scaling.finetuned", False))
    if use_rope and rope["partial_rotary_factor"] != 1.0:
        raise ValueError(f"{path}: partial rotary (rope.dimension_count < head dim) with Granite multipliers or experts "
                         "is not supported: GraniteMoeHybrid rotates whole heads.")  # fmt: skip
    experts_in = tensor_shape(gguf, names, "block_sparse_moe.input_linear.gate")
    shared = tensor_shape(gguf, names, "shared_mlp.input_linear.gate")
    if shared is None and fields["num_hidden_layers"]:
        raise ValueError(f"{path}: no ffn_gate_shexp / ffn_gate tensors: GraniteMoeHybrid needs its shared MLP.")
    num_experts = get("expert_count", 0) if experts_in else 0
    if experts_in and experts_in[0] != num_experts:
        raise ValueError(f"{path}: granitehybrid.expert_count is {num_experts} but ffn_gate_exps holds {experts_in[0]} experts.")
    fields.update(
        architectures=["GraniteMoeHybridForCausalLM"],
        intermediate_size=experts_in[1] if experts_in else get("feed_forward_length"),
        shared_intermediate_size=shared[0],
        num_local_experts=num_experts,
        num_experts_per_tok=get("expert_used_count", 0),  # unused without experts
        # llama.cpp's defaults for a missing multiplier
        embedding_multiplier=float(get("embedding_scale", 1.0)),
        residual_multiplier=float(get("residual_scale", 1.0)),
        attention_multiplier=float(get("attention.scale", head_dim**-0.5)),
        logits_scaling=float(get("logit_scale", 1.0)),
        position_embedding_type="rope" if use_rope else "nope",
        rope_parameters={k: v for k, v in rope.items() if k != "partial_rotary_factor"},
        layer_types=["full_attention" if i in attention else "linear_attention" for i in range(fields["num_hidden_layers"])],
    )
    return _make(GraniteMoeHybridConfig, fields, path)


def _make(config_cls: type[PretrainedConfig], fields: dict, path: str) -> PretrainedConfig:
    return make_config(config_cls, fields, path, "granitehybrid")
