"""GGUF files as conformance cases: slotrunner reads the file with its own GGUF reader, and
transformers loads the same file (`from_pretrained(..., gguf_file=...)`) as the oracle. Part of
the harness in `slotrunner/conformance.py`.

transformers' GGUF loader dequantizes every tensor to float32, so the case runs slotrunner
with `quantized_weights="dequantized"`: both sides compute with the same weights, and what is
compared is the model, not the packed CPU kernels (tests/core_runner/cpu/ check those against
the dequantized weights).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from slotrunner.conformance_oracle import ConformanceError


def gguf_file_of(path: str | Path) -> Path | None:
    """The GGUF file `path` names: a `.gguf` file, or a directory holding exactly one and no
    config.json (how `LLM` reads a path); None for a Hugging Face model directory."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ConformanceError(f"{str(p)!r} is a file but not a .gguf file; give a model directory or a GGUF file")
        return p
    if (p / "config.json").is_file():
        return None
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) > 1:
        raise ConformanceError(f"{str(p)!r} holds several .gguf files ({', '.join(g.name for g in ggufs)}); name one")
    return ggufs[0] if ggufs else None


def gguf_checkpoint_config(path: Path) -> Any:
    """The HF config slotrunner's GGUF reader makes of the file (its `architectures` names the
    slotrunner architecture the file resolves to)."""
    from slotrunner.registry import read_gguf

    return read_gguf(path, torch.float32).config


# RoPE scaling stored as tensors, which transformers' GGUF loader does not read.
_ROPE_SCALING_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def load_gguf_oracle(path: Path, architecture: str) -> torch.nn.Module:
    """transformers' model for the GGUF file, in float32. Raises ConformanceError when
    transformers' GGUF loader does not read this architecture (then no oracle exists for the
    file: check the same model saved as a Hugging Face directory instead), or reads it as
    another class than slotrunner does."""
    import transformers

    from slotrunner.core_runner.loader.gguf_file import open_gguf

    gguf_file = open_gguf(str(path))
    if gguf_file.metadata.get("general.architecture") == "gpt-oss":
        raise ConformanceError(
            f"{path}: transformers' GGUF loader is no oracle for llama.cpp's gpt-oss files (transformers "
            f"{transformers.__version__} fails on their rope.scaling.* metadata, and loads neither the attention sinks "
            "nor the experts); check the Hugging Face checkpoint the file was made from instead"
        )
    if gguf_file.metadata.get("llama.expert_count", 0):
        raise ConformanceError(
            f"{path}: transformers' GGUF loader is no oracle for Mixtral files (llama.expert_count: transformers "
            f"{transformers.__version__} reads the `llama` architecture without its experts); check the Hugging Face "
            "checkpoint the file was made from instead"
        )
    _refuse_qwen35_layer_pattern(gguf_file, path)
    rope_tensors = [name for name in _ROPE_SCALING_TENSORS if name in gguf_file.tensors]
    if rope_tensors:
        raise ConformanceError(
            f"{path}: the file scales RoPE with {', '.join(rope_tensors)} (Llama 3.1 / Phi-3 128k style), which "
            "transformers' GGUF loader drops, so it would be no oracle; check the Hugging Face checkpoint the file "
            "was made from instead"
        )
    try:
        # eager attention: the reference implementation (some sdpa paths drop Gemma 2's soft cap)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
        )
    except ValueError as e:
        if "not supported" not in str(e):
            raise
        raise ConformanceError(
            f"{path}: transformers {transformers.__version__} cannot load this GGUF file as an oracle ({e}); "
            "check the same weights saved as a Hugging Face model directory instead"
        ) from None
    if type(model).__name__ != architecture:
        raise ConformanceError(
            f"{path}: transformers reads this GGUF file as a {type(model).__name__}, slotrunner as a {architecture}"
        )
    return model.eval()


def _refuse_qwen35_layer_pattern(gguf_file: Any, path: Path) -> None:
    """transformers' qwen35 / qwen35moe GGUF reader takes the layer pattern from
    `full_attention_interval` alone; llama.cpp reads `attention.recurrent_layers` first. Where
    the two disagree transformers would build another model, so it is no oracle."""
    arch = gguf_file.metadata.get("general.architecture")
    recurrent = gguf_file.metadata.get(f"{arch}.attention.recurrent_layers")
    if arch not in ("qwen35", "qwen35moe") or recurrent is None:
        return
    interval = gguf_file.metadata.get(f"{arch}.full_attention_interval", 4)
    num_layers = gguf_file.metadata[f"{arch}.block_count"] - gguf_file.metadata.get(f"{arch}.nextn_predict_layers", 0)
    if [bool(r) for r in recurrent[:num_layers]] != [(i + 1) % interval != 0 for i in range(num_layers)]:
        raise ConformanceError(
            f"{path}: transformers' GGUF loader is no oracle for this file: it takes the layer pattern from "
            f"{arch}.full_attention_interval ({interval}) alone, and the file's {arch}.attention.recurrent_layers "
            "(which llama.cpp reads) differs; check the Hugging Face checkpoint the file was made from instead"
        )


# -- tiny GGUF cases: a transformers model written as llama.cpp's converter writes it ----------

# transformers model_type -> GGUF general.architecture (Mistral is written as `llama`, named so)
GGUF_ARCHITECTURES = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
    "gemma3_text": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss", "mixtral": "llama",
}  # fmt: skip

# transformers model_type -> its writer in conformance_gguf_recurrent.py
RECURRENT_WRITERS = {"mamba2": "write_mamba2", "qwen3_next": "write_qwen3next", "falcon_h1": "write_falcon_h1",
                     "bamba": "write_granite_hybrid", "granitemoehybrid": "write_granite_hybrid",
                     "nemotron_h": "write_nemotron_h"}
RECURRENT_WRITERS |= {"qwen3_5_text": "write_qwen35", "qwen3_5_moe_text": "write_qwen35"}  # Qwen3.5, dense and MoE


def _byte_level_vocab(size: int) -> list[str]:
    """`size` tokens: <s>, </s>, the 256 byte-level symbols, then filler words (no merges)."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = ["<s>", "</s>", *sorted(ByteLevel.alphabet())]
    tokens += [f"w{i}" for i in range(size - len(tokens))]
    return tokens[:size]


def _sentencepiece_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """`size` SentencePiece pieces (<unk>, <s>, </s>, then "▁", letters, "▁"-words), their
    scores and llama.cpp token types (2 unknown, 3 control, 1 normal)."""
    pieces = ["<unk>", "<s>", "</s>", "\u2581", *"abcdefghijklmnopqrstuvwxyz"]
    pieces += [f"\u2581{a}{b}" for a in "abcdefghijklmnopqrstuvwxyz" for b in "abcdefghijklmnopqrstuvwxyz"]
    pieces = (pieces + [f"\u2581w{i}" for i in range(size)])[:size]
    return pieces, [0.0, 0.0, 0.0] + [-float(i) for i in range(size - 3)], [2, 3, 3] + [1] * (size - 3)


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> Any:
    """Llama 3.1-style RoPE scaling as llama.cpp's converter stores it (`LlamaModel`
    `generate_extra_tensors`): no scaling metadata, a float32 `rope_freqs` tensor holding the
    divisor of each frequency -- 1 for short wavelengths, `factor` for long ones, the smooth blend
    in between."""
    import numpy as np

    base, factor = float(rope.get("rope_theta", 10000.0)), float(rope["factor"])
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    original = float(rope.get("original_max_position_embeddings", 8192))
    divisors = []
    for freq in 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def _gpt_oss_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """GPT-OSS's tensors as llama.cpp's GptOssModel converter renames and reshapes them
    (`modify_tensors`), or None for a tensor it keeps as gguf-py's name map says: the sinks get
    ".weight"; the expert stacks ([experts, in, out]) are transposed to [experts, out, in] and
    HF's interleaved gate/up (g0 u0 g1 u1 ...) split into gate and up, biases alike."""
    block = f"blk.{name.split('.')[2]}" if name.startswith("model.layers.") else ""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "sinks":
        return [(f"{block}.attn_sinks.weight", tensor)]
    if leaf == "gate_up_proj":
        both = tensor.transpose(-1, -2)  # [experts, 2 x ff, hidden], rows interleaved
        return [(f"{block}.ffn_gate_exps.weight", both[:, ::2]), (f"{block}.ffn_up_exps.weight", both[:, 1::2])]
    if leaf == "gate_up_proj_bias":
        return [(f"{block}.ffn_gate_exps.bias", tensor[..., ::2]), (f"{block}.ffn_up_exps.bias", tensor[..., 1::2])]
    if leaf == "down_proj":
        return [(f"{block}.ffn_down_exps.weight", tensor.transpose(-1, -2))]
    if leaf == "down_proj_bias":
        return [(f"{block}.ffn_down_exps.bias", tensor)]
    return None


def llama_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Q/K rows interleaved for ggml's rotary, as LlamaModel.permute does (and every converter
    built on LlamaModel with `undo_permute`)."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_tensors(names: Any, arch: str, name: str, data: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """HF tensor `name` under gguf-py's names for `arch` (`names`: its TensorNameMap). A stacked
    `mlp.experts.gate_up_proj` ([experts, 2 x ff, hidden]) is split into gate and up stacks, as
    llama.cpp keeps them (Qwen2MoeModel.modify_tensors); `mlp.experts.down_proj` gets ".weight"."""
    if name.endswith("mlp.experts.gate_up_proj"):
        gate, up = data.chunk(2, dim=1)
        block = name.split(".")[2]
        return [(f"blk.{block}.ffn_gate_exps.weight", gate), (f"blk.{block}.ffn_up_exps.weight", up)]
    if name.endswith("mlp.experts.down_proj"):  # [experts, hidden, ff]: the converter appends ".weight"
        stem, suffix = name, "weight"
    elif names.get_name(name) is not None:  # the whole name first, as the converter looks it up: no suffix
        return [(names.get_name(name), data)]  # (A_log; Falcon-H1's pre_ff_layernorm.weight -> blk.{i}.ffn_norm)
    else:
        stem, suffix = name.rsplit(".", 1)
    gguf_name = names.get_name(stem)
    if gguf_name is None:
        raise ConformanceError(f"{name} has no GGUF name for {arch}")
    return [(f"{gguf_name}.{suffix}", data)]


# tokenizer.ggml.pre as real files of these architectures have it (llama.cpp's converter picks it
# from the tokenizer's hash); the rest write "gpt-2", or "qwen2" for Qwen
_PRE_TOKENIZER_OF = {
    "gpt-oss": "gpt-4o", "deepseek2": "deepseek-v3", "qwen35": "qwen35", "qwen35moe": "qwen35", "falcon-h1": "falcon-h1",
    "granitehybrid": "dbrx", "nemotron_h": "pixtral", "nemotron_h_moe": "pixtral",
}  # fmt: skip


def add_tokenizer(writer: Any, config: Any, arch: str, tokenizer: str) -> None:
    """A vocabulary of the model's size: byte-level BPE (`gpt2`, `tokenizer.ggml.pre` as the
    family's files have it) or SentencePiece (`llama`)."""
    if tokenizer == "gpt2":
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(_PRE_TOKENIZER_OF.get(arch, "qwen2" if arch.startswith("qwen") else "gpt-2"))
        writer.add_token_list(_byte_level_vocab(config.vocab_size))
        writer.add_token_types([3, 3] + [1] * (config.vocab_size - 2))
        writer.add_token_merges([])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
    elif tokenizer == "llama":
        pieces, scores, types = _sentencepiece_vocab(config.vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(pieces)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    else:
        raise ConformanceError(f"tokenizer {tokenizer!r}: write 'gpt2' (byte-level BPE) or 'llama' (SentencePiece)")
    if getattr(config, "pad_token_id", None) is not None:
        writer.add_pad_token_id(config.pad_token_id)


def _decoder_writer(path, arch: str, config) -> Any:  # gguf.GGUFWriter (gguf is imported only here)
    """A GGUF writer for `arch` with the keys every decoder file carries (llama.cpp's
    TextModel.set_gguf_parameters): name, depth, context, widths, query heads."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"{config.model_type} tiny")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    return writer


def write_gguf(
    hf_model: torch.nn.Module, path: str | Path, tokenizer: str = "gpt2", matrix_type: str = "F32", kv_b: str = "split"
) -> Path:
    """Write a transformers decoder (float32) to `path` as llama.cpp's convert_hf_to_gguf.py
    does: gguf-py's tensor names, Q/K rows interleaved for `llama` (and Llama 3.1-style RoPE
    scaling as `rope_freqs`), 1 added to Gemma's norm weights, the metadata keys its architecture reads, and a vocabulary of the model's size:
    byte-level BPE (`tokenizer="gpt2"`, `tokenizer.ggml.pre` as the family's files have it) or
    SentencePiece (`"llama"`, what Gemma and Phi-3 files carry). Tensors stay float32 (so
    transformers' GGUF loader and slotrunner's reader both see exactly the model's weights),
    or the 2-D matrices are quantized to `matrix_type` ("Q8_0", "Q4_0", ... what gguf-py
    quantizes) as a quantized file stores them. GPT-OSS's experts are always MXFP4, as every
    GPT-OSS file has them (the converter repacks the released MXFP4 weights as they are).
    DeepSeek-V2/V3 (`deepseek2`): `kv_b` "split" (attn_k_b / attn_v_b, today's converter) or
    "joined" (attn_kv_b, converters before llama.cpp's split of April 2025)."""
    import gguf
    import numpy as np

    config = hf_model.config
    if config.model_type in RECURRENT_WRITERS:  # their own metadata and tensor transforms
        from slotrunner import conformance_gguf_recurrent

        return getattr(conformance_gguf_recurrent, RECURRENT_WRITERS[config.model_type])(hf_model, Path(path), tokenizer)
    if config.model_type in ("deepseek_v2", "deepseek_v3"):
        return _write_deepseek2(hf_model, Path(path), tokenizer, matrix_type, kv_b)
    if config.model_type not in GGUF_ARCHITECTURES:
        written = sorted([*GGUF_ARCHITECTURES, *RECURRENT_WRITERS, "deepseek_v2", "deepseek_v3"])
        raise ConformanceError(f"no GGUF convention is known for {config.model_type!r}; written: {', '.join(written)}")
    arch = GGUF_ARCHITECTURES[config.model_type]
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = _decoder_writer(path, arch, config)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    rope = getattr(config, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if arch == "llama" and rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    if arch == "phi3" and rope.get("rope_type") == "longrope":  # Phi-3 128k, as Phi3MiniModel writes it
        original = rope.get("original_max_position_embeddings") or config.original_max_position_embeddings
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if config.model_type == "mixtral":  # MixtralModel.set_gguf_parameters
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "gpt-oss":  # GptOssModel.set_gguf_parameters, and TextModel's YaRN keys
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        writer.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast", 32.0)))
        writer.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow", 1.0)))
    if config.model_type == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if getattr(config, "sliding_window", None) and arch not in ("qwen2", "llama"):
        writer.add_sliding_window(config.sliding_window)
    add_tokenizer(writer, config, arch, tokenizer)
    shift = 1.0 if arch.startswith("gemma") else 0.0
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        renamed = _gpt_oss_tensors(name, tensor.detach().float()) if arch == "gpt-oss" else None
        for gguf_name, data in renamed or ():
            values = data.contiguous().numpy()
            if values.ndim == 3:  # the experts
                mxfp4 = gguf.GGMLQuantizationType.MXFP4
                writer.add_tensor(gguf_name, gguf.quants.quantize(values, mxfp4), raw_dtype=mxfp4)
            else:
                writer.add_tensor(gguf_name, values)
        if renamed is not None:
            continue
        data = tensor.detach().float()
        stem = name.rsplit(".", 1)[0]
        if shift and stem.endswith("norm"):
            data = data + shift
        if arch == "llama" and stem.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if stem.endswith("q_proj") else config.num_key_value_heads
            data = llama_permute(data, heads)
        for gguf_name, part in gguf_tensors(names, arch, name, data):
            _add_matrix(writer, gguf_name, part, matrix_type)
    return finish_writer(writer, Path(path))


def _add_matrix(writer: Any, name: str, data: torch.Tensor, matrix_type: str) -> None:
    """A tensor in float32, or a 2-D matrix quantized to `matrix_type` by gguf-py; unquantized where
    its rows do not split into the type's blocks (the converter falls back to F16 there)."""
    import gguf

    values = data.contiguous().numpy()
    qtype = gguf.GGMLQuantizationType[matrix_type]
    blocks = values.ndim == 2 and values.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0
    if qtype != gguf.GGMLQuantizationType.F32 and blocks:
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    else:
        writer.add_tensor(name, values)


def finish_writer(writer: Any, path: Path) -> Path:
    """Write the header, metadata and tensors to `path` and close the writer."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_deepseek2(hf_model: torch.nn.Module, path: Path, tokenizer: str, matrix_type: str, kv_b: str) -> Path:
    """A transformers DeepSeek-V2/V3 as llama.cpp's DeepseekV2Model converter writes it
    (`conversion/deepseek.py`, with TextModel's shared keys): experts stacked [experts, out, in],
    `e_score_correction_bias` as `exp_probs_b.bias`, no rows permuted, the gating function as
    DeepSeek's config.json names it (V2 softmax, V3 sigmoid; transformers' configs drop the key).
    `kv_b="split"`: kv_b_proj as attn_k_b [heads, rank, nope] (transposed) and attn_v_b
    [heads, v, rank], the MLA sizes in `key_length_mla` / `value_length_mla`, expert groups and
    YaRN betas; `"joined"`: attn_kv_b as stored, the MLA sizes in `key_length` / `value_length`,
    and only the keys converters of that time wrote (no groups, no betas).

    A model the file cannot hold is refused rather than written wrong: YaRN with mscale !=
    mscale_all_dim (the file keeps only the latter, `yarn_log_multiplier`), V3 with
    `rope_interleave` off (llama.cpp rotates interleaved pairs), groups in a "joined" file."""
    import gguf

    config = hf_model.config
    if kv_b not in ("split", "joined"):
        raise ConformanceError(f"kv_b {kv_b!r}: write 'split' (attn_k_b / attn_v_b) or 'joined' (attn_kv_b)")
    v3, split = config.model_type == "deepseek_v3", kv_b == "split"
    rope = dict(config.rope_parameters or {})
    yarn = rope.get("rope_type") == "yarn"
    if yarn and not (rope.get("mscale") and rope.get("mscale") == rope.get("mscale_all_dim")):
        raise ConformanceError(
            f"YaRN with mscale {rope.get('mscale')} and mscale_all_dim {rope.get('mscale_all_dim')}: a deepseek2 file "
            "keeps only mscale_all_dim and llama.cpp runs it as mscale = mscale_all_dim, so it would not hold this model"
        )
    if v3 and not config.rope_interleave:
        raise ConformanceError("rope_interleave=False: llama.cpp rotates a deepseek2 file's rope pairs interleaved")
    grouped = (config.n_group or 1) > 1 and config.topk_group != config.n_group
    if not split and grouped and (v3 or config.topk_method == "group_limited_greedy"):
        raise ConformanceError("expert groups in a 'joined' (attn_kv_b) file: converters of that time wrote none")
    nope, rope_dim, rank = config.qk_nope_head_dim, config.qk_rope_head_dim, config.kv_lora_rank
    writer = _decoder_writer(path, "deepseek2", config)
    writer.add_head_count_kv(1 if split else config.num_key_value_heads)  # today's converter: MLA as MQA
    if yarn:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        if split:
            writer.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast", 32.0)))
            writer.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow", 1.0)))
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if split and config.n_group is not None:
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
    gating = gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX
    writer.add_expert_gating_func(gating)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_vocab_size(config.vocab_size)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(rank)
    if split:
        writer.add_key_length(rank + rope_dim)
        writer.add_value_length(rank)
        writer.add_key_length_mla(nope + rope_dim)
        writer.add_value_length_mla(config.v_head_dim)
    else:
        writer.add_key_length(nope + rope_dim)
        writer.add_value_length(config.v_head_dim)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(float(config.routed_scaling_factor))
    if config.norm_topk_prob or not split:
        writer.add_expert_weights_norm(bool(config.norm_topk_prob))
    writer.add_rope_dimension_count(rope_dim)
    add_tokenizer(writer, config, "deepseek2", tokenizer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, config.num_hidden_layers)
    heads = config.num_attention_heads
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data, block = tensor.detach().float(), name.split(".")[2] if name.startswith("model.layers.") else ""
        if name.endswith("mlp.experts.gate_up_proj"):  # [experts, 2 x ff, hidden]: stacked gate, up apart
            gate, up = data.chunk(2, dim=1)
            writer.add_tensor(f"blk.{block}.ffn_gate_exps.weight", gate.contiguous().numpy())
            writer.add_tensor(f"blk.{block}.ffn_up_exps.weight", up.contiguous().numpy())
            continue
        if name.endswith("mlp.experts.down_proj"):  # [experts, hidden, ff]
            writer.add_tensor(f"blk.{block}.ffn_down_exps.weight", data.contiguous().numpy())
            continue
        if name.endswith("e_score_correction_bias"):
            writer.add_tensor(f"blk.{block}.exp_probs_b.bias", data.contiguous().numpy())
            continue
        if name.endswith("kv_b_proj.weight") and split:  # [heads * (nope + v), rank]
            k_b, v_b = data.view(heads, -1, rank).split([nope, config.v_head_dim], dim=1)
            writer.add_tensor(f"blk.{block}.attn_k_b.weight", k_b.transpose(1, 2).contiguous().numpy())
            writer.add_tensor(f"blk.{block}.attn_v_b.weight", v_b.contiguous().numpy())
            continue
        stem, suffix = name.rsplit(".", 1)
        gguf_name = names.get_name(stem)
        if gguf_name is None:
            raise ConformanceError(f"{name} has no GGUF name for deepseek2")
        _add_matrix(writer, f"{gguf_name}.{suffix}", data, matrix_type)
    return finish_writer(writer, path)
