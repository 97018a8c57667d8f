"""GGUF files of the Llama-style decoders besides Llama itself: Qwen2, Qwen3, Qwen3-MoE, Gemma 2, Gemma 3, Phi-3, GPT-OSS.

Each `general.architecture` is a table of llama.cpp's conventions (convert_hf_to_gguf.py and
gguf-py's tensor_mapping.py, read backwards): the tensor names, the metadata keys, the HF config
they make, and the two transforms the converter applies -- Q/K rows interleaved for rotary
(the `llama` architecture only, `llama_gguf.py`) and 1 added to Gemma's (1 + w) norm weights.
What the metadata cannot say, llama.cpp fixes in code, and so does this reader: Gemma's query
scale 1/sqrt(head_dim), Gemma 3's local RoPE base 10000 and its five local layers to one
global. The weights come through `GGUFCheckpoint` (`llama_gguf.py`), the tokenizer through
`gguf_tokenizer.py`.

A Qwen3-MoE or GPT-OSS file stores each projection of a layer's experts as one [num_experts, ...]
tensor (GPT-OSS's in MXFP4, biases beside them); the checkpoint yields them expert by expert,
dequantized, as Qwen3-MoE's Hugging Face checkpoints store them.
Mixtral files (the `llama` architecture with `llama.expert_count`) are read by `llama_gguf.py`.
DeepSeek-V2/V3 files (`deepseek2`) are read by `deepseek2_gguf.py`, which shares this module's
tensor naming (`hf_tensor_names`). Not read: `qwen2moe`: say so, naming the file.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from slotrunner.core_runner.loader.gguf_file import GGUFFile
from slotrunner.models.llama_gguf import GGUFCheckpoint, metadata_getter, token_ids

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_PRE_POST_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# Gemma 2/3: a norm before and after each of attention and MLP
_SANDWICH_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Phi-3 stores Q/K/V and gate/up fused, as its HF checkpoints do
_PHI3 = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
# Mixture of experts (Qwen3-MoE): the router, and each projection of all experts in one tensor
_EXPERTS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.*.gate_proj",
    "ffn_up_exps": "mlp.experts.*.up_proj",
    "ffn_down_exps": "mlp.experts.*.down_proj",
}
# GPT-OSS: a norm before attention and one after; attention sinks; a router with a bias; each
# projection of the experts stacked, with a bias per expert (the converter splits HF's
# interleaved gate/up into gate and up, and transposes the stacks to [experts, out, in])
_GPT_OSS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    **_ATTENTION,
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.*.gate_proj",
    "ffn_up_exps": "mlp.experts.*.up_proj",
    "ffn_down_exps": "mlp.experts.*.down_proj",
}
# HF parameters that are no module's `weight` or `bias`; llama.cpp's converter appends ".weight" (GPT-OSS's
# sinks) or ".bias" (DeepSeek-V3's expert-choice bias, renamed `e_score_correction.bias`) to their names
_BARE_PARAMETERS = frozenset({"self_attn.sinks", "mlp.gate.e_score_correction_bias"})
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

Metadata = Callable[..., Any]  # get(key, default=<required>) -> value of "{arch}.{key}"


@dataclass(frozen=True)
class Conventions:
    """How one GGUF architecture maps onto a Hugging Face decoder."""

    architecture: str  # the HF architecture the file becomes (slotrunner resolves it)
    config_class: str  # its transformers config class
    layer_names: Mapping[str, str]  # GGUF per-layer tensor stem -> HF submodule
    extra_config: Callable[[Metadata, Mapping[str, Any]], dict[str, Any]]  # (get, base fields) -> fields
    norm_shift: float = 0.0


def _no_extra(get: Metadata, base: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def _qwen2(get: Metadata, base: Mapping[str, Any]) -> dict[str, Any]:
    return {"sliding_window": None, "use_sliding_window": False}


def _gemma2(get: Metadata, base: Mapping[str, Any]) -> dict[str, Any]:
    # llama.cpp scales queries by 1/sqrt(head_dim), except Gemma 2 27B: 1/sqrt(hidden / heads)
    # (detected by its size, 46 layers; the converter writes no key for it).
    scale = base["hidden_size"] // base["num_attention_heads"] if base["num_hidden_layers"] == 46 else base["head_dim"]
    return {
        "query_pre_attn_scalar": scale,
        "attn_logit_softcapping": get("attn_logit_softcapping", None),
        "final_logit_softcapping": get("final_logit_softcapping", None),
        "sliding_window": get("attention.sliding_window"),
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _gemma3(get: Metadata, base: Mapping[str, Any]) -> dict[str, Any]:
    scale = base["hidden_size"] // base["num_attention_heads"] if base["num_hidden_layers"] == 62 else base["head_dim"]
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 1_000_000.0))}
    if get("rope.scaling.type", "none") == "linear":
        full |= {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif get("rope.scaling.type", "none") != "none":
        raise ValueError(f"RoPE scaling {get('rope.scaling.type')!r} is not supported for gemma3")
    return {
        "query_pre_attn_scalar": scale,
        "sliding_window": get("attention.sliding_window"),
        "sliding_window_pattern": 6,  # llama.cpp: five local layers, then one global
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": full,
        },
        "final_logit_softcapping": get("final_logit_softcapping", None),
        "attn_logit_softcapping": get("attn_logit_softcapping", None),
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _qwen3moe(get: Metadata, base: Mapping[str, Any]) -> dict[str, Any]:
    # llama.cpp runs every layer sparse and renormalises the top-k weights (norm_topk_prob).
    return _qwen2(get, base) | {
        "num_experts": get("expert_count"),
        "num_experts_per_tok": get("expert_used_count"),
        "moe_intermediate_size": get("expert_feed_forward_length"),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _phi3(get: Metadata, base: Mapping[str, Any]) -> dict[str, Any]:
    rotary = get("rope.dimension_count", base["head_dim"])
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    if rotary != base["head_dim"]:
        rope["partial_rotary_factor"] = rotary / base["head_dim"]
    original = get("rope.scaling.original_context_length", None)
    return {"rope_parameters": rope, "sliding_window": get("attention.sliding_window", None)} | (
        {"original_max_position_embeddings": original} if original is not None else {}
    )


def _gpt_oss(get: Metadata, base: Mapping[str, Any]) -> dict[str, Any]:
    # What the file does not say, llama.cpp fixes in code: sliding-window layers alternate with
    # full ones, the first sliding (`set_swa_pattern(2)`), and the clamped SwiGLU's alpha 1.702 and
    # limit 7.0 (GptOssConfig's defaults). YaRN's correction range is not rounded (`truncate`
    # False, as every GPT-OSS checkpoint has it; llama.cpp rounds it, a departure from the model).
    scaling = get("rope.scaling.type", "none")
    if scaling != "yarn":
        raise ValueError(f"gpt-oss files scale RoPE with YaRN; this one has rope.scaling.type={scaling!r}")
    for key in ("yarn_ext_factor", "yarn_attn_factor", "yarn_log_multiplier", "attn_factor"):
        if get(f"rope.scaling.{key}", None) is not None:
            raise ValueError(f"gpt-oss.rope.scaling.{key} is not supported (GPT-OSS's converter writes none)")
    yarn = {
        "rope_type": "yarn",
        "factor": float(get("rope.scaling.factor")),
        "original_max_position_embeddings": get("rope.scaling.original_context_length"),
        "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),  # llama.cpp's defaults
        "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
        "truncate": False,
    }
    layers = base["num_hidden_layers"]
    return {
        "rope_parameters": base["rope_parameters"] | yarn,
        "num_local_experts": get("expert_count"),
        "num_experts_per_tok": get("expert_used_count"),
        "intermediate_size": get("expert_feed_forward_length", base["intermediate_size"]),
        "sliding_window": get("attention.sliding_window"),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
    }


# Phi-3 128k files: LongRoPE's two factor sets as tensors (llama.cpp's Phi3MiniModel converter).
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _phi3_longrope(gguf: GGUFFile, get: Metadata, rope: dict[str, Any], head_dim: int, path: str) -> dict[str, Any]:
    """Phi-3's LongRoPE parameters from the factor tensors, the original context length and the
    attention factor the converter computed (sqrt(1 + ln(scale) / ln(original)))"""
    if not all(name in gguf.tensors for name in _ROPE_FACTORS):
        raise ValueError(f"{path}: one of {', '.join(_ROPE_FACTORS)} without the other.")
    original = get("rope.scaling.original_context_length", None)
    if original is None:
        raise ValueError(f"{path}: LongRoPE factors without phi3.rope.scaling.original_context_length.")
    long, short = ([float(f) for f in gguf.read_tensor(name).reshape(-1)] for name in _ROPE_FACTORS)
    rotated = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    if len(long) != rotated // 2 or len(short) != rotated // 2:
        raise ValueError(
            f"{path}: LongRoPE factor tensors hold {len(long)} and {len(short)} values, expected one per rotated "
            f"frequency ({rotated // 2})."
        )
    longrope = {"rope_type": "longrope", "long_factor": long, "short_factor": short, "original_max_position_embeddings": original}
    attention_factor = get("rope.scaling.attn_factor", None)
    if attention_factor is not None:
        longrope["attention_factor"] = float(attention_factor)
    return rope | longrope


CONVENTIONS: dict[str, Conventions] = {
    "qwen2": Conventions("Qwen2ForCausalLM", "Qwen2Config", {**_PRE_POST_NORMS, **_ATTENTION, **_MLP}, _qwen2),
    "qwen3": Conventions("Qwen3ForCausalLM", "Qwen3Config", {**_PRE_POST_NORMS, **_ATTENTION, **_QK_NORMS, **_MLP}, _qwen2),
    "gemma2": Conventions("Gemma2ForCausalLM", "Gemma2Config", {**_SANDWICH_NORMS, **_ATTENTION, **_MLP}, _gemma2, 1.0),
    "gemma3": Conventions(
        "Gemma3ForCausalLM", "Gemma3TextConfig", {**_SANDWICH_NORMS, **_ATTENTION, **_QK_NORMS, **_MLP}, _gemma3, 1.0
    ),
    "phi3": Conventions("Phi3ForCausalLM", "Phi3Config", _PHI3, _phi3),
    "qwen3moe": Conventions(
        "Qwen3MoeForCausalLM", "Qwen3MoeConfig", {**_PRE_POST_NORMS, **_ATTENTION, **_QK_NORMS, **_EXPERTS}, _qwen3moe
    ),
    "gpt-oss": Conventions("GptOssForCausalLM", "GptOssConfig", _GPT_OSS, _gpt_oss),
}


def read_decoder_gguf(gguf: GGUFFile, path: str, dtype: torch.dtype, pack: bool = False) -> GGUFCheckpoint:
    """Read an opened GGUF file of one of CONVENTIONS' architectures: config, tokenizer and
    tensor table (not the data). Raises ValueError naming the file for tensors or metadata the
    architecture cannot use."""
    arch = gguf.metadata["general.architecture"]
    conv = CONVENTIONS[arch]
    gguf_names = hf_tensor_names(gguf, conv.layer_names, conv.architecture, path)
    config = _config(gguf, conv, gguf_names, path)
    _check_shapes(config, {hf: gguf.tensors[name].shape for hf, name in gguf_names.items()}, path)
    return GGUFCheckpoint.of(gguf, path, dtype, config, gguf_names, pack, permute_rotary=False, norm_shift=conv.norm_shift)


def hf_tensor_names(gguf: GGUFFile, layer_names: Mapping[str, str], model: str, path: str) -> dict[str, str]:
    """`{hf_name: gguf_name}` for every tensor of the file, `layer_names` mapping each per-layer
    GGUF stem to its HF submodule (`model` names the HF architecture in errors); raises on
    tensors the model lacks."""
    arch = gguf.metadata["general.architecture"]
    names: dict[str, str] = {}
    unknown = []
    for gguf_name in gguf.tensors:
        stem, _, suffix = gguf_name.rpartition(".")
        layer = _LAYER_TENSOR.fullmatch(gguf_name)
        if layer and layer.group(2) in layer_names:
            hf = layer_names[layer.group(2)]
            bare = hf in _BARE_PARAMETERS
            names[f"model.layers.{layer.group(1)}.{hf}" + ("" if bare else f".{suffix}")] = gguf_name
        elif stem in _GLOBAL_NAMES and suffix in ("weight", "bias"):
            names[f"{_GLOBAL_NAMES[stem]}.{suffix}"] = gguf_name
        else:
            unknown.append(gguf_name)
    if arch == "phi3":  # LongRoPE factors: config, not weights (_phi3_longrope)
        unknown = [n for n in unknown if n not in _ROPE_FACTORS]
    if unknown:
        hint = ""
        if any(n.startswith("rope_factors") for n in unknown):
            hint = " (LongRoPE factor tensors are read for phi3 only)"
        elif any("ffn_gate_up_exps." in n for n in unknown):
            hint = " (experts with gate and up fused in one stack are not read yet; convert with them apart)"
        elif any("_exps." in n for n in unknown):
            hint = " (mixture-of-experts tensors: read for qwen3moe, gpt-oss and deepseek2 only)"
        raise ValueError(f"{path}: tensors with no {model} equivalent: {', '.join(unknown[:8])}{hint}.")
    if "model.embed_tokens.weight" not in names:
        raise ValueError(f"{path}: no token_embd.weight tensor, so this is not a complete {arch} model.")
    return names


def _config(gguf: GGUFFile, conv: Conventions, hf_names: Mapping[str, str], path: str) -> Any:
    """The HF config from `{arch}.*` metadata, with llama.cpp's defaults for the optional keys."""
    metadata = gguf.metadata
    arch = metadata["general.architecture"]
    get = metadata_getter(gguf, arch, path)

    hidden_size, num_heads = get("embedding_length"), get("attention.head_count")
    num_kv_heads = get("attention.head_count_kv", num_heads)
    head_dim = get("attention.key_length", hidden_size // max(num_heads, 1))
    if get("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{path}: {arch}.attention.value_length differs from key_length; not supported.")
    if arch not in ("gemma3", "gpt-oss") and get("rope.scaling.type", "none") != "none":
        raise ValueError(f"{path}: RoPE scaling {get('rope.scaling.type')!r} is not supported yet.")
    if arch != "phi3" and get("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{path}: partial rotary (rope.dimension_count != head_dim) is not supported for {arch}.")
    if isinstance(num_kv_heads, list):
        raise ValueError(f"{path}: per-layer {arch}.attention.head_count_kv is not supported.")
    base = dict(
        architectures=[conv.architecture],
        vocab_size=get("vocab_size", gguf.tensors["token_embd.weight"].shape[0]),
        hidden_size=hidden_size,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6 if conv.norm_shift else 1e-5),
        max_position_embeddings=get("context_length"),
        tie_word_embeddings="lm_head.weight" not in hf_names,
        **token_ids(metadata),
    )
    if arch not in ("gemma3", "phi3"):
        base["rope_parameters"] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    if arch == "phi3":
        del base["head_dim"]  # Phi3Config derives it
    try:
        fields = base | conv.extra_config(get, {**base, "head_dim": head_dim})
        if arch == "phi3" and any(name in gguf.tensors for name in _ROPE_FACTORS):
            fields["rope_parameters"] = _phi3_longrope(gguf, get, fields["rope_parameters"], head_dim, path)
        return getattr(transformers, conv.config_class)(**fields)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    except Exception as exc:  # transformers' config validators raise their own exception types
        raise ValueError(f"{path}: the {arch}.* metadata does not make a valid {conv.config_class}: {exc}") from exc


def _check_shapes(config: Any, shapes: Mapping[str, tuple[int, ...]], path: str) -> None:
    """Every tensor of the file has the shape the metadata implies; the ones every layer needs are there."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_rows, kv_rows = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_name = {
        "input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
        "pre_feedforward_layernorm": (hidden,), "post_feedforward_layernorm": (hidden,),
        "self_attn.q_proj": (q_rows, hidden), "self_attn.k_proj": (kv_rows, hidden),
        "self_attn.v_proj": (kv_rows, hidden), "self_attn.o_proj": (hidden, q_rows),
        "self_attn.qkv_proj": (q_rows + 2 * kv_rows, hidden),
        "self_attn.q_norm": (head_dim,), "self_attn.k_norm": (head_dim,),
        "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter),
        "mlp.gate_up_proj": (2 * inter, hidden),
    }  # fmt: skip
    experts, expert_inter = getattr(config, "num_experts", 0), getattr(config, "moe_intermediate_size", inter)
    per_name |= {
        "mlp.gate": (experts, hidden), "mlp.router": (experts, hidden), "self_attn.sinks": (config.num_attention_heads,),
        "mlp.experts.*.gate_proj": (experts, expert_inter, hidden),
        "mlp.experts.*.up_proj": (experts, expert_inter, hidden), "mlp.experts.*.down_proj": (experts, hidden, expert_inter),
    }  # fmt: skip
    globals_ = {"model.embed_tokens": (config.vocab_size, hidden), "model.norm": (hidden,), "lm_head": (config.vocab_size, hidden)}
    problems = []
    for name, shape in shapes.items():
        stem, suffix = name.rsplit(".", 1)
        if suffix not in ("weight", "bias"):  # a bare parameter (sinks): its own shape
            stem, suffix = name, "weight"
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem)
        if layer and int(layer.group(1)) >= config.num_hidden_layers:
            problems.append(f"{name} is beyond block_count={config.num_hidden_layers}")
            continue
        expected = per_name[layer.group(2)] if layer else globals_[stem]
        expected = expected[:-1] if suffix == "bias" else expected  # one value per output row (of each expert)
        if tuple(shape) != expected:
            problems.append(f"{name} has shape {tuple(shape)}, expected {expected}")
    for i in range(config.num_hidden_layers):
        problems += [f"{n} is missing" for n in (f"model.layers.{i}.input_layernorm.weight",) if n not in shapes]
    if problems:
        raise ValueError(f"{path}: tensors disagree with the metadata: {'; '.join(problems[:6])}.")
