"""A Falcon-H1 GGUF file (llama.cpp's `falcon-h1` architecture) as a Hugging Face checkpoint.

llama.cpp's converter (`FalconH1Model` over `Mamba2Model`; conversion/falcon_h1.py and
conversion/mamba.py of the llama.cpp vendored by llama-cpp-python 0.3.36) writes each layer's
Mamba2 mixer as Mamba2Model does (`recurrent_gguf.py`: conv squeezed, A = -exp(A_log) and D as
[heads, 1], the norm as [groups, inner / groups]), its attention and MLP under Llama's names
(no rotary permutation), the norm before the MLP as `blk.{i}.ffn_norm` (no `.weight`: gguf-py
maps the whole HF name), and folds every muP multiplier into the weights: embedding, lm_head,
q/k/v (keys also times key_multiplier), o_proj, MLP gate and down, the mixer's in_proj (each of
the z, x, B, C, dt row sections times its ssm_multiplier) and out_proj. So the file is a model
whose multipliers are all 1, and that is the config this reader makes. The gated norm is
computed as llama.cpp's Mamba2 layer does, after the gate (`mamba_norm_before_gate` False).
transformers' GGUF loader does not read `falcon-h1`: the tests check this reader against the
model a tiny file was written from.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import FalconH1Config

from slotrunner.core_runner.loader.gguf_file import GGUFFile
from slotrunner.models.llama_gguf import GGUFCheckpoint, make_config, metadata_getter, token_ids
from slotrunner.models.recurrent_gguf import MixerNames, RecurrentCheckpoint, mamba2_mixer_names, whole_name_table

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.final_layernorm.weight",
                 "output.weight": "lm_head.weight"}  # fmt: skip
_PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj",
                "ffn_down": "feed_forward.down_proj"}  # fmt: skip
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm": "pre_ff_layernorm.weight",
    **{f"{g}.{suffix}": f"{hf}.{suffix}" for g, hf in _PROJECTIONS.items() for suffix in ("weight", "bias")},
    **mamba2_mixer_names("mamba"),
}
MIXER = MixerNames(d="mamba.D", norm="mamba.norm.weight")


def read_falcon_h1_gguf(gguf: GGUFFile, path: str, dtype: torch.dtype, pack: bool = False) -> GGUFCheckpoint:
    """Read an opened `falcon-h1` GGUF file's config, tokenizer and tensor table (not the data).
    Raises ValueError naming the file for tensors or metadata Falcon-H1 cannot use."""
    gguf_names = whole_name_table(gguf, path, _GLOBAL_NAMES, _LAYER_NAMES, "model.layers", "FalconH1ForCausalLM")
    config = _config(gguf, gguf_names, path)
    return RecurrentCheckpoint.of(gguf, path, dtype, config, gguf_names, pack, permute_rotary=False, mixer=MIXER)


def _config(gguf: GGUFFile, hf_names: Mapping[str, str], path: str) -> FalconH1Config:
    metadata = gguf.metadata
    get = metadata_getter(gguf, "falcon-h1", path)
    if get("rope.scaling.type", "none") != "none":
        raise ValueError(f"{path}: RoPE scaling {get('rope.scaling.type')!r} is not supported for falcon-h1.")
    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // heads)
    if get("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{path}: falcon-h1.attention.value_length differs from key_length; not supported.")
    inner, ssm_heads = get("ssm.inner_size"), get("ssm.time_step_rank")
    state, groups, kernel = get("ssm.state_size"), get("ssm.group_count", 1), get("ssm.conv_kernel")
    if ssm_heads <= 0 or inner % ssm_heads or groups <= 0 or inner % groups:
        raise ValueError(f"{path}: ssm.inner_size {inner} does not split into {ssm_heads} heads and {groups} groups.")
    conv_dim = inner + 2 * groups * state
    conv = hf_names.get("model.layers.0.mamba.conv1d.weight")
    if conv is not None and tuple(gguf.tensors[conv].shape) != (conv_dim, kernel):
        raise ValueError(f"{path}: ssm_conv1d has shape {tuple(gguf.tensors[conv].shape)}, the metadata implies {(conv_dim, kernel)}.")
    if get("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{path}: partial rotary (rope.dimension_count != head_dim) is not supported for falcon-h1.")
    fields = dict(
        architectures=["FalconH1ForCausalLM"],
        vocab_size=gguf.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
        max_position_embeddings=get("context_length"),
        rope_parameters={"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))},
        mamba_d_ssm=inner,
        mamba_n_heads=ssm_heads,
        mamba_d_head=inner // ssm_heads,
        mamba_n_groups=groups,
        mamba_d_state=state,
        mamba_d_conv=kernel,
        mamba_expand=max(inner // hidden, 1),
        mamba_conv_bias="model.layers.0.mamba.conv1d.bias" in hf_names,
        mamba_proj_bias="model.layers.0.mamba.in_proj.bias" in hf_names,
        mamba_rms_norm="model.layers.0.mamba.norm.weight" in hf_names,
        mamba_norm_before_gate=False,  # llama.cpp's Mamba2 layer: norm(y * silu(z))
        attention_bias="model.layers.0.self_attn.q_proj.bias" in hf_names,
        mlp_bias="model.layers.0.feed_forward.up_proj.bias" in hf_names,
        # the converter folded every multiplier into the weights
        embedding_multiplier=1.0, lm_head_multiplier=1.0, key_multiplier=1.0, attention_in_multiplier=1.0,
        attention_out_multiplier=1.0, ssm_in_multiplier=1.0, ssm_out_multiplier=1.0,
        ssm_multipliers=[1.0] * 5, mlp_multipliers=[1.0, 1.0],
        tie_word_embeddings="lm_head.weight" not in hf_names,
        **token_ids(metadata),
    )
    return make_config(FalconH1Config, fields, path, "falcon-h1")
