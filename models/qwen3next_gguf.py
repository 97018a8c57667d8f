"""A Qwen3-Next GGUF file (llama.cpp's `qwen3next` architecture) as a Hugging Face checkpoint.

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
transformers' GGUF loader does not read `qwen3next`: the tests check this reader against the
model a tiny file was written from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from transformers import Qwen3NextConfig

from slotrunner.core_runner.cpu.packed import PackedWeight
from slotrunner.core_runner.loader.gguf_file import GGUFFile
from slotrunner.models.llama_gguf import GGUFCheckpoint, metadata_getter
from slotrunner.models.recurrent_gguf import MixerNames, RecurrentCheckpoint, whole_name_table

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}  # fmt: skip
_WEIGHTS = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ssm_in": "linear_attn.in_proj_qkvz", "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
    "ssm_ba": "linear_attn.in_proj_ba", "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.*.gate_proj", "ffn_up_exps": "mlp.experts.*.up_proj",
    "ffn_down_exps": "mlp.experts.*.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}  # fmt: skip
_LAYER_NAMES = {f"{g}.weight": f"{hf}.weight" for g, hf in _WEIGHTS.items()} | {
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
    "ssm_dt.bias": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log",
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


def read_qwen3next_gguf(gguf: GGUFFile, path: str, dtype: torch.dtype, pack: bool = False) -> GGUFCheckpoint:
    """Read an opened `qwen3next` GGUF file's config, tokenizer and tensor table (not the data).
    Raises ValueError naming the file for tensors or metadata Qwen3-Next cannot use."""
    get = metadata_getter(gguf, "qwen3next", path)
    num_layers = get("block_count") - get("nextn_predict_layers", 0)
    gguf_names = _hf_names(gguf, num_layers, path)
    config = _config(gguf, gguf_names, num_layers, path)
    return Qwen3NextCheckpoint.of(gguf, path, dtype, config, gguf_names, pack, permute_rotary=False, norm_shift=1.0,
                                  unshifted_norms=(MIXER.norm,), mixer=MIXER)  # fmt: skip


def _hf_names(gguf: GGUFFile, num_layers: int, path: str) -> dict[str, str]:
    names = whole_name_table(gguf, path, _GLOBAL_NAMES, _LAYER_NAMES, "model.layers", "Qwen3NextForCausalLM", num_layers)
    for i in range(num_layers):
        split = [f"model.layers.{i}.{p}" in names for p in _SPLIT]
        if any(split) and not all(split):
            raise ValueError(f"{path}: blk.{i} has one of attn_qkv and attn_gate without the other.")
    return names


def _config(gguf: GGUFFile, hf_names: Mapping[str, str], num_layers: int, path: str) -> Qwen3NextConfig:
    metadata = gguf.metadata
    get = metadata_getter(gguf, "qwen3next", path)
    if get("rope.scaling.type", "none") != "none":
        raise ValueError(f"{path}: RoPE scaling {get('rope.scaling.type')!r} is not supported for qwen3next.")
    if get("expert_gating_func", 1) != 1 or get("expert_weights_scale", 1.0) != 1.0:
        raise ValueError(f"{path}: qwen3next.expert_gating_func / expert_weights_scale other than a plain softmax router.")
    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // heads)
    if get("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{path}: qwen3next.attention.value_length differs from key_length; not supported.")
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
        architectures=["Qwen3NextForCausalLM"],
        vocab_size=gguf.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
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
        num_experts=get("expert_count"),
        num_experts_per_tok=get("expert_used_count"),
        moe_intermediate_size=get("expert_feed_forward_length"),
        shared_expert_intermediate_size=get("expert_shared_feed_forward_length"),
        norm_topk_prob=True,  # llama.cpp renormalises the top-k weights
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings="lm_head.weight" not in hf_names,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
    )
    try:
        return Qwen3NextConfig(**fields)
    except Exception as exc:  # transformers' config validators raise their own exception types
        raise ValueError(f"{path}: the qwen3next.* metadata does not make a valid Qwen3NextConfig: {exc}") from exc
