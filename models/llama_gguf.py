"""A Llama-family GGUF file as a Hugging Face checkpoint: LlamaConfig, HF-named weights, tokenizer.

Mistral and Mixtral files are `llama` files too (llama.cpp writes them so): Mixtral's have
`llama.expert_count` and the expert tensors, read as a MixtralConfig and Mixtral's names.

    checkpoint = read_gguf(default_model_path(), torch.bfloat16)  # metadata + tokenizer, ~0.5 s
    for hf_name, tensor in checkpoint.weights():  # dequantized one at a time, ~2 s in all
        ...

Only code that knows Llama's GGUF conventions lives here, next to the model: llama.cpp's tensor
names, the rotary row order, the config keys. The loader (`core_runner/loader/gguf_loader.py`)
finds this reader through the registry; the container format is `gguf_file.py`, the tokenizer
`gguf_tokenizer.py`.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LlamaConfig, PretrainedConfig, PreTrainedTokenizerBase

from slotrunner.core_runner.cpu.packed import PACKABLE_GGML_TYPES, PackedWeight
from slotrunner.core_runner.loader.gguf_file import GGUFFile
from slotrunner.core_runner.loader.gguf_tokenizer import build_tokenizer

# GGUF tensor name -> Hugging Face name (llama.cpp's gguf-py/gguf/tensor_mapping.py, reversed)
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixtral, which llama.cpp writes as `llama` with `llama.expert_count`: the router, and each
    # projection of all experts in one [experts, ...] tensor (yielded expert by expert under
    # Mixtral's checkpoint names: w1 gate, w3 up, w2 down)
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.*.w1",
    "ffn_up_exps": "block_sparse_moe.experts.*.w3",
    "ffn_down_exps": "block_sparse_moe.experts.*.w2",
}
# Llama 3.1-style RoPE scaling: llama.cpp's converter writes no scaling metadata, only this
# float32 tensor of one divisor per rotary frequency (1 / factor / the blend between).
ROPE_FREQS = "rope_freqs.weight"
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class GGUFCheckpoint:
    """What `read_gguf` found in a file. Tensor data is only read by `weights()`."""

    path: str
    dtype: torch.dtype
    config: PretrainedConfig = field(repr=False)  # LlamaConfig here; other decoders' readers, theirs
    tokenizer: PreTrainedTokenizerBase = field(repr=False)
    chat_template: str | None = field(repr=False)
    # HF names in file order; no lm_head if tied. A name with "*" is a stack of experts in one GGUF
    # tensor ([num_experts, ...]): `weights` yields expert e as the name with "*" -> e.
    weight_names: tuple[str, ...] = field(repr=False)
    _file: GGUFFile = field(repr=False, compare=False)
    _gguf_names: Mapping[str, str] = field(repr=False, compare=False)  # HF name -> GGUF name
    pack: bool = False  # yield quantized matrices as PackedWeight (see `weights`)
    # llama.cpp's converter interleaves Q/K rows of the `llama` architecture only; other
    # architectures store them as Hugging Face does (models/decoder_gguf.py).
    permute_rotary: bool = True
    # The HF name parts of the projections whose rows are interleaved: q's, then k's
    rotary_projections: tuple[str, str] = (".self_attn.q_proj.", ".self_attn.k_proj.")
    # Added to every norm weight by llama.cpp's converter (Gemma's (1 + w) norms store 1 + w),
    # except those whose HF name ends with one of `unshifted_norms` (Qwen3-Next's delta-net norm).
    norm_shift: float = 0.0
    unshifted_norms: tuple[str, ...] = ()

    @classmethod
    def of(
        cls, gguf: GGUFFile, path: str, dtype: torch.dtype, config: PretrainedConfig, gguf_names: Mapping[str, str],
        pack: bool, tokenizer: PreTrainedTokenizerBase | None = None, **conventions: Any,
    ) -> GGUFCheckpoint:  # fmt: skip
        """A reader's result: the file's tokenizer (unless given) and chat template, `gguf_names`
        ({HF name: GGUF name}) in order, and the reader's `conventions` (permute_rotary, norm_shift)."""
        return cls(
            path=path,
            dtype=dtype,
            config=config,
            tokenizer=build_tokenizer(gguf.metadata, path) if tokenizer is None else tokenizer,
            chat_template=gguf.metadata.get("tokenizer.chat_template"),
            weight_names=tuple(gguf_names),
            _file=gguf,
            _gguf_names=gguf_names,
            pack=pack,
            **conventions,
        )

    def weights(self) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        """Yield `(hf_name, tensor)` in Hugging Face layout and `self.dtype`, one tensor at a time.

        With `pack`, 2-D tensors stored as Q4_0, Q4_1, Q4_K, Q6_K or Q8_0 come as `PackedWeight` (their
        blocks, for the native CPU kernel) instead. Each call reads afresh (dequantizing takes
        about 2 s for the 135M default model on 2 cores), so peak memory is one float32 tensor
        beyond what the caller keeps.
        """
        if self.permute_rotary:
            num_heads, num_kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
        for hf_name in self.weight_names:
            gguf_name = self._gguf_names[hf_name]
            info = self._file.tensors[gguf_name]
            if self.pack and len(info.shape) == 2 and info.tensor_type.name in PACKABLE_GGML_TYPES:
                tensor = PackedWeight.from_ggml(self._file.read_blocks(gguf_name), info.tensor_type.name, info.shape)
            else:
                tensor = torch.from_numpy(self._file.read_tensor(gguf_name))
                if self.norm_shift and hf_name.endswith("norm.weight") and not hf_name.endswith(self.unshifted_norms):
                    # in float32, before any cast
                    tensor = tensor.float() - self.norm_shift
                tensor = tensor.to(self.dtype)
            if ".*." in hf_name:
                yield from ((hf_name.replace("*", str(e)), expert) for e, expert in enumerate(tensor))
                continue
            heads = dict(zip(self.rotary_projections, (num_heads, num_kv_heads))) if self.permute_rotary else {}
            for part, count in heads.items():
                if part in hf_name:
                    rows = unpermute_rotary_rows(torch.arange(tensor.shape[0]), count)
                    tensor = tensor.select_rows(rows) if isinstance(tensor, PackedWeight) else tensor[rows]
            yield hf_name, tensor


def read_llama_gguf(gguf: GGUFFile, path: str, dtype: torch.dtype, pack: bool = False) -> GGUFCheckpoint:
    """Read an opened Llama-architecture GGUF file's config, tokenizer and tensor table (not the
    data). Raises ValueError naming the file for tensors or metadata Llama cannot use."""
    gguf_names = _hf_names(gguf, path)
    tokenizer = build_tokenizer(gguf.metadata, path)
    config = _llama_config(gguf, gguf_names, path)
    _check_shapes(config, {hf: gguf.tensors[name].shape for hf, name in gguf_names.items()}, path)
    return GGUFCheckpoint.of(gguf, path, dtype, config, gguf_names, pack, tokenizer=tokenizer)


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `LlamaModel.permute`).

    HF rotates the two halves of each head ([x0..x(d/2-1)], [x(d/2)..x(d-1)]); ggml rotates
    adjacent pairs (x0, x1), (x2, x3), ... so the converter interleaves each head's two halves.
    Works for a `[num_heads * head_dim, in]` weight and a `[num_heads * head_dim]` bias.
    """
    rows = weight.shape[0]
    assert rows % (2 * num_heads) == 0, f"{rows} rows do not split into {num_heads} heads of pairs"
    rest = weight.shape[1:]
    # [num_heads, head_dim / 2, 2, ...] -> [num_heads, 2, head_dim / 2, ...]
    pairs = weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
    return pairs.transpose(1, 2).reshape(weight.shape).contiguous()


_REQUIRED = object()


def token_ids(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The special token ids every converter writes, as config fields (None where absent)."""
    return {
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }


def make_config(config_cls: type[PretrainedConfig], fields: dict[str, Any], path: str, arch: str) -> PretrainedConfig:
    """`config_cls(**fields)`, or a ValueError naming the file when transformers' validators
    refuse the fields (they raise their own exception types)."""
    try:
        return config_cls(**fields)
    except Exception as exc:
        raise ValueError(f"{path}: the {arch}.* metadata does not make a valid {config_cls.__name__}: {exc}") from exc


def metadata_getter(gguf: GGUFFile, arch: str, path: str) -> Callable[..., Any]:
    """`get(key, default)`: the file's `{arch}.{key}` metadata, or `default` when absent; with no
    default the key is required (ValueError naming the file)."""

    def get(key: str, default: Any = _REQUIRED) -> Any:
        value = gguf.metadata.get(f"{arch}.{key}", None if default is _REQUIRED else default)
        if value is None and default is _REQUIRED:
            raise ValueError(f"{path}: required metadata {arch}.{key} is missing.")
        return value

    return get


def _hf_names(gguf: GGUFFile, path: str) -> dict[str, str]:
    """`{hf_name: gguf_name}` for every tensor of the file; raises on tensors Llama does not have."""
    names: dict[str, str] = {}
    unknown = []
    for gguf_name in gguf.tensors:
        stem, _, suffix = gguf_name.rpartition(".")
        layer = _LAYER_TENSOR.fullmatch(gguf_name)
        if layer and layer.group(2) in _LAYER_NAMES:
            names[f"model.layers.{layer.group(1)}.{_LAYER_NAMES[layer.group(2)]}.{suffix}"] = gguf_name
        elif stem in _GLOBAL_NAMES and suffix in ("weight", "bias"):
            names[f"{_GLOBAL_NAMES[stem]}.{suffix}"] = gguf_name
        else:
            unknown.append(gguf_name)
    unknown = [name for name in unknown if name != ROPE_FREQS]  # config, not a weight (_llama_config)
    if unknown:
        raise ValueError(f"{path}: tensors with no Llama equivalent: {', '.join(unknown[:8])}.")
    if "model.embed_tokens.weight" not in names:
        raise ValueError(f"{path}: no token_embd.weight tensor, so this is not a complete Llama model.")
    return names


def _llama_config(gguf: GGUFFile, hf_names: Mapping[str, str], path: str) -> PretrainedConfig:
    """LlamaConfig (MixtralConfig for a file with experts) from `llama.*` metadata, with
    llama.cpp's defaults for the optional keys."""
    metadata = gguf.metadata
    get = metadata_getter(gguf, "llama", path)

    num_experts = get("expert_count", 0)
    moe = "model.layers.0.block_sparse_moe.gate.weight" in hf_names
    if bool(num_experts) != moe:
        raise ValueError(
            f"{path}: llama.expert_count is {num_experts} but the file "
            f"{'has' if moe else 'has no'} expert tensors (ffn_gate_inp, ffn_*_exps)."
        )
    if get("rope.scaling.type", "none") != "none":
        raise ValueError(f"{path}: RoPE scaling {get('rope.scaling.type')!r} is not supported yet.")
    hidden_size, num_heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", get("rope.dimension_count", hidden_size // max(num_heads, 1)))
    if get("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{path}: partial rotary (rope.dimension_count != head_dim) is not supported.")
    rope_theta = float(get("rope.freq_base", 10000.0))
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if ROPE_FREQS in gguf.tensors:
        rope_parameters = _rope_freqs_parameters(gguf, rope_theta, head_dim, get("context_length"), path)
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:  # transformers >= 5
        rope: dict[str, Any] = {"rope_parameters": rope_parameters}
    else:
        rope = {"rope_theta": rope_theta}
        if rope_parameters["rope_type"] != "default":
            rope["rope_scaling"] = rope_parameters
    # llama.cpp converts Mistral models to the `llama` architecture, and runs them as Llama (no
    # sliding window: Mistral 7B v0.2 and later have none); so does transformers' GGUF loader
    # (unless general.name is exactly "mistral"), and so does this reader.
    fields = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=get("vocab_size", gguf.tensors["token_embd.weight"].shape[0]),
        hidden_size=hidden_size,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=get("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
        max_position_embeddings=get("context_length"),
        tie_word_embeddings="lm_head.weight" not in hf_names,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in hf_names,
        mlp_bias="model.layers.0.mlp.up_proj.bias" in hf_names,
        **token_ids(metadata),
        **rope,
    )
    config_cls = LlamaConfig
    if num_experts:  # Mixtral: its own config class (no sliding window in llama.cpp's files)
        from transformers import MixtralConfig

        config_cls = MixtralConfig
        for key in ("attention_bias", "mlp_bias"):
            if fields.pop(key):
                raise ValueError(f"{path}: a Mixtral file with {key.split('_')[0]} biases is not supported.")
        fields.update(architectures=["MixtralForCausalLM"], num_local_experts=num_experts,
                      num_experts_per_tok=get("expert_used_count"), sliding_window=None)  # fmt: skip
    return make_config(config_cls, fields, path, "llama")


def _rope_freqs_parameters(gguf: GGUFFile, theta: float, head_dim: int, context: int, path: str) -> dict[str, Any]:
    """The `rope_freqs` divisors as rope parameters. llama.cpp divides frequency i by factor i,
    which is what transformers' "longrope" computes with one factor set for every length
    (short = long, the original length = the context) and no attention scaling; the Llama 3.1
    parameters themselves (factor, low/high frequency factors, original context) are not in
    the file, and these divisors are exactly what they produced."""
    factors = [float(f) for f in gguf.read_tensor(ROPE_FREQS).reshape(-1)]
    if len(factors) != head_dim // 2:
        raise ValueError(f"{path}: {ROPE_FREQS} has {len(factors)} values, expected head_dim / 2 = {head_dim // 2}.")
    if not all(f > 0 for f in factors):
        raise ValueError(f"{path}: {ROPE_FREQS} holds a divisor <= 0.")
    return {
        "rope_type": "longrope",
        "rope_theta": theta,
        "short_factor": factors,
        "long_factor": factors,
        "original_max_position_embeddings": context,
        "factor": 1.0,
        "attention_factor": 1.0,
    }


def _check_shapes(config: PretrainedConfig, shapes: Mapping[str, tuple[int, ...]], path: str) -> None:
    """Every tensor a LlamaForCausalLM needs is present, with the shape the metadata implies."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_rows, kv_rows = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    expected = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        expected["lm_head.weight"] = (config.vocab_size, hidden)
    per_layer = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
    }
    experts = getattr(config, "num_local_experts", 0)
    if experts:  # stacked: [experts, out, in]
        per_layer.update({
            "block_sparse_moe.gate.weight": (experts, hidden),
            "block_sparse_moe.experts.*.w1.weight": (experts, inter, hidden),
            "block_sparse_moe.experts.*.w3.weight": (experts, inter, hidden),
            "block_sparse_moe.experts.*.w2.weight": (experts, hidden, inter),
        })  # fmt: skip
    else:
        per_layer.update({
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
        })  # fmt: skip
    for layer in range(config.num_hidden_layers):
        expected.update((f"model.layers.{layer}.{name}", shape) for name, shape in per_layer.items())
    for name in shapes:  # biases: one value per output row of their weight
        if name.endswith(".bias"):
            expected[name] = expected.get(name.removesuffix(".bias") + ".weight", (-1,))[:1]
    problems = [f"{name} is missing" for name in expected if name not in shapes]
    problems += [f"{name} is unexpected" for name in shapes if name not in expected]
    problems += [
        f"{name} has shape {shapes[name]}, expected {shape}"
        for name, shape in expected.items()
        if name in shapes and shapes[name] != shape
    ]
    if problems:
        raise ValueError(f"{path}: tensors disagree with the llama.* metadata: {'; '.join(problems[:6])}.")
