"""Qwen3-Next and Qwen3.5 GGUF files (llama.cpp's `qwen3next`, `qwen35`, `qwen35moe`) as Hugging Face checkpoints.

llama.cpp's converter (`Qwen3NextModel`, over `Qwen2MoeModel` and `TextModel`; conversion/qwen.py
and conversion/base.py of the llama.cpp vendored by llama-cpp-python 0.3.36; llama.cpp's own
loader, src/models/qwen3next.cpp, for what it fixes in code) writes:

| GGUF | as stored | Hugging Face |
|---|---|---|
| `attn_norm`, `post_attention_norm`, `attn_q_norm`, `attn_k_norm`, `output_norm` | 1 + w | the (1 + w) norms' w |
| `ssm_norm.weight` | w (not shifted) | `linear_attn.norm.weight` |
| `attn_qkv` + `attn_gate` | every key head's q, then k, then v; z apart | `linear_attn.in_proj_qkvz` ([q, k, v, z] per key head) |
| `ssm_in` (converters before the split) | as HF | `linear_attn.in_proj_qkvz` |
| `ssm_ba`, `ssm_out`, `ssm_dt.bias` | as HF | `in_proj_ba`, `out_proj`, `dt_bias` |
| `ssm_conv1d`, `ssm_a` | squeezed; -exp(A_log) `[heads]` (`recurrent_gguf.py`) | `conv1d.weight`, `A_log` |
| `ffn_gate_inp`, `ffn_{gate,up,down}_exps` | router; `[experts, ...]` stacks | `mlp.gate`, `mlp.experts.{e}.*` |
| `ffn_{gate,up,down}_shexp`, `ffn_gate_inp_shexp` | as HF | `mlp.shared_expert.*`, `mlp.shared_expert_gate` |

Metadata: the `ssm.*` keys carry the delta-net's sizes (state_size = key head dim, group_count =
key heads, time_step_rank = value heads, inner_size = value heads x value head dim);
`attention.recurrent_layers` which layers are delta-nets (older files: every
`full_attention_interval`-th layer is full attention, 4 if absent, as llama.cpp reads them);
`rope.dimension_count` the rotated part of a head. What llama.cpp fixes in code: every layer
sparse, softmax router with renormalised top-k weights. A multi-token-prediction block
(`nextn_predict_layers` extra blocks) is skipped, as slotrunner skips `mtp.*` in HF checkpoints.

Qwen3.5 (`Qwen3_5TextModel` / `Qwen3_5MoeTextModel` over `_LinearAttentionVReorderBase`, a
Qwen3NextModel; loaders src/models/qwen35.cpp and qwen35moe.cpp) keeps all of the above but the
delta-net's input projections, which its checkpoints hold as four: `attn_qkv` (in_proj_qkv), `attn_gate`
(in_proj_z), `ssm_beta` (in_proj_b), `ssm_alpha` (in_proj_a), none split or merged. Where value
heads outnumber key heads the converter reorders them from grouped (each key head's value heads
together, HF's order) to tiled (value head i of every key head, then i + 1: what ggml's repeat
broadcasts), in the v rows of attn_qkv, attn_gate's rows, ssm_beta / ssm_alpha / ssm_a /
ssm_dt, the conv's v channels and ssm_out's columns; `Qwen35Checkpoint` puts them back. `qwen35`
has a dense SwiGLU MLP (`ffn_gate` / `ffn_up` / `ffn_down`) in every layer, `qwen35moe` the
experts above. Its `rope.dimension_sections` (interleaved M-RoPE, [11, 11, 10, 0] when the
checkpoint has none) only matter for images: text positions are equal on every axis, where
M-RoPE is plain RoPE, so the text model ignores them. ConditionalGeneration checkpoints convert
to the same text file (`language_model.` dropped, the vision tower left to a separate mmproj
file, general.architecture `clip`): a text file with vision-tower tensors is refused.

transformers' GGUF loader reads none of these architectures: the tests check this reader against
the model a tiny file was written from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import transformers

from slotrunner.core_runner.cpu.packed import PackedWeight
from slotrunner.core_runner.loader.gguf_file import GGUFFile
from slotrunner.models.llama_gguf import GGUFCheckpoint, make_config, metadata_getter, token_ids
from slotrunner.models.recurrent_gguf import MixerNames, RecurrentCheckpoint, whole_name_table

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}  # fmt: skip
_WEIGHTS = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
}  # fmt: skip
_QWEN3NEXT_WEIGHTS = {"ssm_in": "linear_attn.in_proj_qkvz", "ssm_ba": "linear_attn.in_proj_ba"}
_QWEN35_WEIGHTS = {"ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a"}
_DENSE_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_MOE = {
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.*.gate_proj", "ffn_up_exps": "mlp.experts.*.up_proj",
    "ffn_down_exps": "mlp.experts.*.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}  # fmt: skip


def _layer_names(weights: Mapping[str, str]) -> dict[str, str]:
    return {f"{g}.weight": f"{hf}.weight" for g, hf in weights.items()} | {
        "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias", "ssm_dt.bias": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log",
    }  # fmt: skip


MIXER = MixerNames(d="linear_attn.D", norm="linear_attn.norm.weight")  # no D; its norm is not grouped
# The split in_proj_qkvz: HF's names of its two halves (Qwen3.5's), merged back by the checkpoint.
_SPLIT = ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight")


@dataclasses.dataclass(frozen=True)
class Qwen3NextCheckpoint(RecurrentCheckpoint):
    """Yields the tensors in transformers' shapes, `attn_qkv` + `attn_gate` merged back into
    in_proj_qkvz (packed quantized rows stay packed: the merge only reorders whole rows)."""

    def weights(self) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        pending: dict[str, dict[str, torch.Tensor | PackedWeight]] = {}
        rows = qkvz_rows(self.config)
        for name, tensor in super().weights():
            part = next((p for p in _SPLIT if name.endswith(p)), None)
            if part is None:
                yield name, tensor
                continue
            prefix = name.removesuffix(part)
            halves = pending.setdefault(prefix, {})
            halves[part] = tensor
            if len(halves) == 2:
                qkv, z = halves[_SPLIT[0]], halves[_SPLIT[1]]
                if isinstance(qkv, PackedWeight) and isinstance(z, PackedWeight):
                    merged = PackedWeight.cat([qkv, z]).select_rows(rows)
                else:
                    merged = torch.cat([_dense(qkv), _dense(z)])[rows]
                yield prefix + "linear_attn.in_proj_qkvz.weight", merged
                del pending[prefix]
        assert not pending, f"{self.path}: attn_qkv without attn_gate in {sorted(pending)}"


def _dense(tensor: torch.Tensor | PackedWeight) -> torch.Tensor:
    return tensor.dequantize() if isinstance(tensor, PackedWeight) else tensor


def qkvz_rows(config: Any) -> torch.Tensor:
    """The rows of cat([attn_qkv, attn_gate]) in in_proj_qkvz's order: for each key head, its q,
    k, v and z rows (the inverse of Qwen3NextModel's split)."""
    num_k, head_k = config.linear_num_key_heads, config.linear_key_head_dim
    group_v = config.linear_num_value_heads // num_k * config.linear_value_head_dim  # v (or z) rows per key head
    key_dim, value_dim = num_k * head_k, num_k * group_v
    starts = [(0, head_k), (key_dim, head_k), (2 * key_dim, group_v), (2 * key_dim + value_dim, group_v)]
    return torch.cat([torch.arange(s + h * n, s + (h + 1) * n) for h in range(num_k) for s, n in starts])


@dataclasses.dataclass(frozen=True)
class Qwen35Checkpoint(RecurrentCheckpoint):
    """Yields the tensors in transformers' shapes, the value heads back in HF's grouped order
    (packed quantized rows stay packed: only whole rows move; ssm_out's columns move, so a
    quantized ssm_out comes dequantized)."""

    def weights(self) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        c = self.config
        num_k, num_v = c.linear_num_key_heads, c.linear_num_value_heads
        if num_k == num_v:  # the converter reorders nothing
            yield from super().weights()
            return
        per_row = grouped_v_heads(num_k, num_v, c.linear_value_head_dim)  # [num_v * head_v]
        per_head = grouped_v_heads(num_k, num_v, 1)  # [num_v]
        qkv = torch.cat([torch.arange(2 * num_k * c.linear_key_head_dim), 2 * num_k * c.linear_key_head_dim + per_row])
        rows = {"linear_attn.in_proj_qkv.weight": qkv, "linear_attn.conv1d.weight": qkv,
                "linear_attn.in_proj_z.weight": per_row, "linear_attn.in_proj_b.weight": per_head,
                "linear_attn.in_proj_a.weight": per_head, "linear_attn.A_log": per_head, "linear_attn.dt_bias": per_head}  # fmt: skip
        for name, tensor in super().weights():
            suffix = next((s for s in rows if name.endswith(s)), None)
            if suffix is not None:
                index = rows[suffix]
                tensor = tensor.select_rows(index) if isinstance(tensor, PackedWeight) else tensor[index]
            elif name.endswith("linear_attn.out_proj.weight"):
                tensor = _dense(tensor)[:, per_row].to(self.dtype)  # columns: a packed weight's blocks run along them
            yield name, tensor


def grouped_v_heads(num_k: int, num_v: int, head_dim: int) -> torch.Tensor:
    """The rows of a tiled value-head tensor (`_LinearAttentionVReorderBase`: value head i of
    every key head, then i + 1) in HF's grouped order (each key head's value heads together):
    HF's tensor is the file's [index]."""
    return torch.arange(num_v * head_dim).view(num_v // num_k, num_k, head_dim).transpose(0, 1).reshape(-1)


@dataclasses.dataclass(frozen=True)
class _Variant:
    """What differs between the architectures this module reads."""

    model: str  # the HF architecture
    config_class: str  # transformers' config class
    layer_names: Mapping[str, str]  # GGUF name after blk.{i}. -> HF name after the layer prefix
    checkpoint: type[RecurrentCheckpoint]
    sparse: bool  # experts in every layer, else a dense MLP
    dense_width: bool  # `feed_forward_length` is the config's intermediate_size (Qwen3.5-MoE has none)
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # what llama.cpp fixes in code


_VARIANTS = {
    "qwen3next": _Variant("Qwen3NextForCausalLM", "Qwen3NextConfig", _layer_names(_WEIGHTS | _QWEN3NEXT_WEIGHTS | _MOE),
                          Qwen3NextCheckpoint, sparse=True, dense_width=True,
                          # every layer sparse, the top-k weights renormalised
                          fixed={"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "qwen35": _Variant("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", _layer_names(_WEIGHTS | _QWEN35_WEIGHTS | _DENSE_MLP),
                       Qwen35Checkpoint, sparse=False, dense_width=True),
    "qwen35moe": _Variant("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", _layer_names(_WEIGHTS | _QWEN35_WEIGHTS | _MOE),
                          Qwen35Checkpoint, sparse=True, dense_width=False),  # renormalises always, as llama.cpp
}  # fmt: skip


def read_qwen3next_gguf(gguf: GGUFFile, path: str, dtype: torch.dtype, pack: bool = False) -> GGUFCheckpoint:
    """Read an opened `qwen3next`, `qwen35` or `qwen35moe` GGUF file's config, tokenizer and
    tensor table (not the data). Raises ValueError naming the file for tensors or metadata the
    model cannot use."""
    arch = gguf.metadata["general.architecture"]
    variant = _VARIANTS[arch]
    get = metadata_getter(gguf, arch, path)
    num_layers = get("block_count") - get("nextn_predict_layers", 0)
    gguf_names = _hf_names(gguf, variant, num_layers, path)
    config = _config(gguf, arch, variant, gguf_names, num_layers, path)
    return variant.checkpoint.of(gguf, path, dtype, config, gguf_names, pack, permute_rotary=False, norm_shift=1.0,
                                 unshifted_norms=(MIXER.norm,), mixer=MIXER)  # fmt: skip


def _hf_names(gguf: GGUFFile, variant: _Variant, num_layers: int, path: str) -> dict[str, str]:
    vision = [name for name in gguf.tensors if name.startswith(("v.", "mm."))]
    if vision:
        raise ValueError(
            f"{path}: vision-tower tensors ({', '.join(vision[:4])}) in a text model's file; slotrunner reads "
            f"{variant.model} only, and llama.cpp's converter writes the vision tower to a separate mmproj file."
        )
    names = whole_name_table(gguf, path, _GLOBAL_NAMES, variant.layer_names, "model.layers", variant.model, num_layers)
    for i in range(num_layers):
        split = [f"model.layers.{i}.{p}" in names for p in _SPLIT]
        if any(split) and not all(split):
            raise ValueError(f"{path}: blk.{i} has one of attn_qkv and attn_gate without the other.")
    return names


def _config(gguf: GGUFFile, arch: str, variant: _Variant, hf_names: Mapping[str, str], num_layers: int, path: str) -> Any:
    metadata = gguf.metadata
    get = metadata_getter(gguf, arch, path)
    if get("rope.scaling.type", "none") != "none":
        raise ValueError(f"{path}: RoPE scaling {get('rope.scaling.type')!r} is not supported for {arch}.")
    if get("expert_gating_func", 1) != 1 or get("expert_weights_scale", 1.0) != 1.0:
        raise ValueError(f"{path}: {arch}.expert_gating_func / expert_weights_scale other than a plain softmax router.")
    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // heads)
    if get("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{path}: {arch}.attention.value_length differs from key_length; not supported.")
    num_k, num_v, head_k = get("ssm.group_count"), get("ssm.time_step_rank"), get("ssm.state_size")
    inner, kernel = get("ssm.inner_size"), get("ssm.conv_kernel")
    if num_k <= 0 or num_v % num_k or inner % num_v:
        raise ValueError(f"{path}: ssm.inner_size {inner} / time_step_rank {num_v} / group_count {num_k} do not split into heads.")
    recurrent = get("attention.recurrent_layers", None)
    if recurrent is None:  # llama.cpp's rule for files without the array
        interval = get("full_attention_interval", 4)
        recurrent = [(i + 1) % interval != 0 for i in range(num_layers)]
    conv = hf_names.get(next((n for n in hf_names if n.endswith("linear_attn.conv1d.weight")), ""))
    conv_dim = 2 * num_k * head_k + inner
    if conv is not None and tuple(gguf.tensors[conv].shape) != (conv_dim, kernel):
        raise ValueError(f"{path}: ssm_conv1d has shape {tuple(gguf.tensors[conv].shape)}, the metadata implies {(conv_dim, kernel)}.")
    fields = dict(
        architectures=[variant.model],
        vocab_size=gguf.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=head_dim,
        attention_bias=any(n.endswith("self_attn.q_proj.bias") for n in hf_names),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
        max_position_embeddings=get("context_length"),
        rope_parameters={"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0)),
                         "partial_rotary_factor": get("rope.dimension_count", head_dim) / head_dim},
        layer_types=["linear_attention" if r else "full_attention" for r in list(recurrent)[:num_layers]],
        linear_conv_kernel_dim=kernel,
        linear_key_head_dim=head_k,
        linear_value_head_dim=inner // num_v,
        linear_num_key_heads=num_k,
        linear_num_value_heads=num_v,
        tie_word_embeddings="lm_head.weight" not in hf_names,
        **token_ids(metadata),
        **variant.fixed,
    )
    if variant.dense_width:
        fields["intermediate_size"] = get("feed_forward_length")
    if variant.sparse:
        fields.update(num_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
                      moe_intermediate_size=get("expert_feed_forward_length"),
                      shared_expert_intermediate_size=get("expert_shared_feed_forward_length"))  # fmt: skip
    return make_config(getattr(transformers, variant.config_class), fields, path, arch)
