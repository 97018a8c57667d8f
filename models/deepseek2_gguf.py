"""DeepSeek-V2/V3 GGUF files (llama.cpp's `deepseek2` architecture) as Hugging Face checkpoints.

llama.cpp's converter (`DeepseekV2Model` in convert_hf_to_gguf.py, `conversion/deepseek.py` in
newer trees) writes one architecture for both; the gating function tells them apart: softmax
(or none: DeepSeek-V2's older files) is `DeepseekV2ForCausalLM`, sigmoid with the expert-choice
bias `exp_probs_b` is `DeepseekV3ForCausalLM`. Tensors (gguf-py's tensor_mapping.py):

| GGUF `blk.{i}.` | Hugging Face `model.layers.{i}.` |
|---|---|
| `attn_q` or `attn_q_a`, `attn_q_a_norm`, `attn_q_b` | `self_attn.q_proj` or `q_a_proj`, `q_a_layernorm`, `q_b_proj` |
| `attn_kv_a_mqa`, `attn_kv_a_norm` | `self_attn.kv_a_proj_with_mqa`, `kv_a_layernorm` |
| `attn_kv_b` `[heads * (nope + v), rank]` (older files) | `self_attn.kv_b_proj` as stored |
| `attn_k_b` `[heads, rank, nope]`, `attn_v_b` `[heads, v, rank]` | `self_attn.kv_b_proj`: per head, k_b transposed, then v_b |
| `ffn_{gate,up,down}` (the leading dense layers) | `mlp.{gate,up,down}_proj` |
| `ffn_gate_inp`, `exp_probs_b.bias` | `mlp.gate.weight`, `mlp.gate.e_score_correction_bias` |
| `ffn_{gate,up,down}_exps` `[experts, ...]` | `mlp.experts.{e}.{gate,up,down}_proj` |
| `ffn_{gate,up,down}_shexp` | `mlp.shared_experts.{gate,up,down}_proj` |

No rows are permuted: DeepSeek rotates interleaved pairs, as llama.cpp's NORM rope does, so the
file keeps the checkpoint's order (the model reorders its rope rows itself, `models/deepseek.py`).
Head sizes: files with `attention.key_length_mla` (the split k_b / v_b) keep the MLA sizes there
(`key_length` = rank + rope, `value_length` = rank); older ones in `key_length` /
`value_length`. `head_count_kv` (1: MLA as MQA) is not read; the model has one latent per token.

What the file cannot say, this reader takes as llama.cpp runs it: YaRN's `mscale` equal to
`mscale_all_dim` (the file keeps 0.1 * mscale_all_dim as `rope.scaling.yarn_log_multiplier`;
with none, neither the softmax scale nor cos/sin move), and no expert groups without
`expert_group_count` (files of older converters). One departure, towards the model: a softmax
file with expert groups is DeepSeek-V2's `group_limited_greedy`, which scores a group by its
best expert; llama.cpp scores every grouped file by the sum of its best two (V3's rule).
transformers' GGUF loader does not read `deepseek2`, so the tests check this reader against the
model a tiny file was written from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import transformers

from slotrunner.core_runner.cpu.packed import PackedWeight
from slotrunner.core_runner.loader.gguf_file import GGUFFile
from slotrunner.models.decoder_gguf import hf_tensor_names
from slotrunner.models.llama_gguf import GGUFCheckpoint, make_config, metadata_getter, token_ids

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",  # the two halves of kv_b_proj (DeepseekCheckpoint joins them)
    "attn_v_b": "self_attn.v_b_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",
    "ffn_gate_exps": "mlp.experts.*.gate_proj",
    "ffn_up_exps": "mlp.experts.*.up_proj",
    "ffn_down_exps": "mlp.experts.*.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_SOFTMAX, _SIGMOID = 1, 2  # gguf-py's ExpertGatingFuncType (0: not written, softmax)


@dataclasses.dataclass(frozen=True)
class DeepseekCheckpoint(GGUFCheckpoint):
    """Yields `kv_b_proj` whole and dense (the model reads its weight as a matrix): from the
    split k_b / v_b, or the file's `attn_kv_b` dequantized if packed."""

    def weights(self) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        halves: dict[str, torch.Tensor] = {}
        for name, tensor in super().weights():
            if name.endswith((".k_b_proj.weight", ".v_b_proj.weight")):  # 3-D: never packed
                halves[name] = tensor
                prefix = name.rsplit(".", 2)[0]
                k, v = halves.get(f"{prefix}.k_b_proj.weight"), halves.get(f"{prefix}.v_b_proj.weight")
                if k is not None and v is not None:
                    # [heads, rank, nope] and [heads, v, rank] -> [heads * (nope + v), rank]
                    yield f"{prefix}.kv_b_proj.weight", torch.cat([k.transpose(1, 2), v], dim=1).flatten(0, 1)
                continue
            if name.endswith(".kv_b_proj.weight") and isinstance(tensor, PackedWeight):
                tensor = tensor.dequantize().to(self.dtype)
            yield name, tensor


def read_deepseek2_gguf(gguf: GGUFFile, path: str, dtype: torch.dtype, pack: bool = False) -> GGUFCheckpoint:
    """Read an opened `deepseek2` GGUF file's config, tokenizer and tensor table (not the data).
    Raises ValueError naming the file for tensors or metadata DeepSeek-V2/V3 cannot use."""
    names = hf_tensor_names(gguf, _LAYER_NAMES, "DeepSeek-V2/V3", path)
    shapes = {hf: tuple(gguf.tensors[name].shape) for hf, name in names.items()}
    config = _config(gguf, shapes, path)
    _check_shapes(config, shapes, path)
    return DeepseekCheckpoint.of(gguf, path, dtype, config, names, pack, permute_rotary=False)


def _config(gguf: GGUFFile, shapes: Mapping[str, tuple[int, ...]], path: str) -> Any:
    """DeepseekV2Config or DeepseekV3Config from `deepseek2.*` metadata and llama.cpp's defaults."""
    metadata = gguf.metadata
    get = metadata_getter(gguf, "deepseek2", path)
    rope_dim, rank = get("rope.dimension_count"), get("attention.kv_lora_rank")
    if get("attention.key_length_mla", None) is not None:  # MLA sizes apart; key/value_length: the latent's
        qk_dim, v_dim = get("attention.key_length_mla"), get("attention.value_length_mla")
        if (get("attention.key_length"), get("attention.value_length")) != (rank + rope_dim, rank):
            raise ValueError(
                f"{path}: deepseek2.attention.key_length / value_length are {get('attention.key_length')} / "
                f"{get('attention.value_length')}, expected kv_lora_rank + rope = {rank + rope_dim} / {rank}."
            )
    else:
        qk_dim, v_dim = get("attention.key_length"), get("attention.value_length")
    if qk_dim <= rope_dim:
        raise ValueError(f"{path}: key length {qk_dim} leaves no non-rotary part beside rope.dimension_count {rope_dim}.")

    gating = get("expert_gating_func", 0)
    has_bias = any(name.endswith("e_score_correction_bias") for name in shapes)
    groups = get("expert_group_count", 1)
    moe: dict[str, Any] = dict(
        n_routed_experts=get("expert_count"),
        num_experts_per_tok=get("expert_used_count"),
        n_shared_experts=get("expert_shared_count", 0),
        moe_intermediate_size=get("expert_feed_forward_length"),
        first_k_dense_replace=get("leading_dense_block_count", 0),
        routed_scaling_factor=float(get("expert_weights_scale", 0.0) or 1.0),  # 0 / absent: llama.cpp does not scale
        n_group=groups,
        topk_group=get("expert_group_used_count", groups),
    )
    norm = bool(get("expert_weights_norm", False))
    if gating == _SIGMOID:
        if not has_bias:
            raise ValueError(f"{path}: sigmoid gating without exp_probs_b tensors is not supported (DeepSeek-V3 has them).")
        architecture, moe = "DeepseekV3ForCausalLM", moe | {"norm_topk_prob": norm, "rope_interleave": True}
        moe["num_nextn_predict_layers"] = 0
    elif gating in (0, _SOFTMAX):
        if has_bias or norm:
            raise ValueError(
                f"{path}: softmax gating with {'exp_probs_b tensors' if has_bias else 'expert_weights_norm'} is not "
                "supported (DeepSeek-V2 neither biases the choice nor renormalises the weights)."
            )
        architecture = "DeepseekV2ForCausalLM"
        moe["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    else:
        raise ValueError(f"{path}: deepseek2.expert_gating_func {gating} is not supported (1 softmax, 2 sigmoid).")

    q_lora = get("attention.q_lora_rank", 0) or None
    if q_lora is not None and "model.layers.0.self_attn.q_a_proj.weight" not in shapes:
        q_lora = None  # llama.cpp ignores the key where a file has no q_a (its "lite" models)
    fields = dict(
        architectures=[architecture],
        vocab_size=get("vocab_size", shapes["model.embed_tokens.weight"][0]),
        hidden_size=get("embedding_length"),
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=get("attention.head_count"),
        num_key_value_heads=get("attention.head_count"),
        q_lora_rank=q_lora,
        kv_lora_rank=rank,
        qk_nope_head_dim=qk_dim - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=v_dim,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=get("context_length"),
        rope_parameters=_rope(get, path),
        tie_word_embeddings="lm_head.weight" not in shapes,
        attention_bias="model.layers.0.self_attn.kv_a_proj_with_mqa.bias" in shapes,
        **token_ids(metadata),
        **moe,
    )
    config_class = architecture.replace("ForCausalLM", "Config")
    return make_config(getattr(transformers, config_class), fields, path, "deepseek2")


def _rope(get: Any, path: str) -> dict[str, Any]:
    """Rope parameters as llama.cpp's deepseek2 graph applies the `rope.*` keys (module docstring)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    scaling = get("rope.scaling.type", "none")
    if scaling == "none":
        return rope
    if scaling != "yarn":
        raise ValueError(f"{path}: deepseek2 RoPE scaling {scaling!r} is not supported (none or yarn).")
    for key in ("yarn_ext_factor", "yarn_attn_factor", "attn_factor"):
        if get(f"rope.scaling.{key}", None) is not None:
            raise ValueError(f"{path}: deepseek2.rope.scaling.{key} is not supported (DeepSeek's converter writes none).")
    rope |= {
        "rope_type": "yarn",
        "factor": float(get("rope.scaling.factor")),
        "original_max_position_embeddings": get("rope.scaling.original_context_length"),
        "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),  # llama.cpp's defaults, DeepSeek's values
        "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
    }
    log_multiplier = get("rope.scaling.yarn_log_multiplier", None)
    if log_multiplier:  # 0.1 * mscale_all_dim; llama.cpp scales the softmax by its mscale, cos/sin not at all
        mscale = float(log_multiplier) / 0.1
        return rope | {"mscale": mscale, "mscale_all_dim": mscale}
    return rope | {"attention_factor": 1.0}


def _check_shapes(config: Any, shapes: Mapping[str, tuple[int, ...]], path: str) -> None:
    """Every tensor a DeepSeek layer needs is there, with the shape the metadata implies."""
    c = config
    hidden, heads, rank, rope = c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
    nope, v, experts, ff = c.qk_nope_head_dim, c.v_head_dim, c.n_routed_experts, c.moe_intermediate_size
    expected = {"model.embed_tokens.weight": (c.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not c.tie_word_embeddings:
        expected["lm_head.weight"] = (c.vocab_size, hidden)
    split_kv_b = "model.layers.0.self_attn.k_b_proj.weight" in shapes
    for i in range(c.num_hidden_layers):
        layer = {
            "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
            "self_attn.kv_a_proj_with_mqa.weight": (rank + rope, hidden), "self_attn.kv_a_layernorm.weight": (rank,),
            "self_attn.o_proj.weight": (hidden, heads * v),
        }  # fmt: skip
        if c.q_lora_rank is None:
            layer["self_attn.q_proj.weight"] = (heads * (nope + rope), hidden)
        else:
            layer |= {"self_attn.q_a_proj.weight": (c.q_lora_rank, hidden), "self_attn.q_a_layernorm.weight": (c.q_lora_rank,),
                      "self_attn.q_b_proj.weight": (heads * (nope + rope), c.q_lora_rank)}  # fmt: skip
        if split_kv_b:
            layer |= {"self_attn.k_b_proj.weight": (heads, rank, nope), "self_attn.v_b_proj.weight": (heads, v, rank)}
        else:
            layer["self_attn.kv_b_proj.weight"] = (heads * (nope + v), rank)
        if c.attention_bias:
            layer |= {"self_attn.kv_a_proj_with_mqa.bias": (rank + rope,), "self_attn.o_proj.bias": (hidden,)}
            if c.q_lora_rank is not None:
                layer["self_attn.q_a_proj.bias"] = (c.q_lora_rank,)
        if i < c.first_k_dense_replace:
            layer |= {"mlp.gate_proj.weight": (c.intermediate_size, hidden), "mlp.up_proj.weight": (c.intermediate_size, hidden),
                      "mlp.down_proj.weight": (hidden, c.intermediate_size)}  # fmt: skip
        else:
            layer |= {"mlp.gate.weight": (experts, hidden), "mlp.experts.*.gate_proj.weight": (experts, ff, hidden),
                      "mlp.experts.*.up_proj.weight": (experts, ff, hidden), "mlp.experts.*.down_proj.weight": (experts, hidden, ff)}  # fmt: skip
            if c.model_type == "deepseek_v3":
                layer["mlp.gate.e_score_correction_bias"] = (experts,)
            if c.n_shared_experts:
                shared = ff * c.n_shared_experts
                layer |= {"mlp.shared_experts.gate_proj.weight": (shared, hidden), "mlp.shared_experts.up_proj.weight": (shared, hidden),
                          "mlp.shared_experts.down_proj.weight": (hidden, shared)}  # fmt: skip
        expected |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    problems = [f"{name} is missing" for name in expected if name not in shapes]
    problems += [f"{name} is unexpected" for name in shapes if name not in expected]
    problems += [f"{name} has shape {shapes[name]}, expected {shape}" for name, shape in expected.items()
                 if name in shapes and shapes[name] != shape]  # fmt: skip
    if problems:
        raise ValueError(f"{path}: tensors disagree with the deepseek2.* metadata: {'; '.join(problems[:6])}.")
