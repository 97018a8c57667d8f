"""Tiny GGUF cases of the recurrent architectures: a transformers model written as llama.cpp's
converter writes it (`Mamba2Model`, `Qwen3NextModel` and its Qwen3.5 subclasses, `FalconH1Model`),
for `conformance_gguf.write_gguf`.

The mixers' shared reshapes (conv squeezed, A = -exp(A_log), ...) are `models/recurrent_gguf.py`'s
`to_gguf`, the same table the readers undo. Tensors stay float32. transformers' GGUF loader reads
none of these architectures, so the tests check each file against the model it was written from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from slotrunner.conformance_gguf import add_tokenizer, finish_writer, gguf_tensors, llama_permute
from slotrunner.conformance_oracle import ConformanceError
from slotrunner.models.recurrent_gguf import mamba2_mixer_names, to_gguf

# transformers Mamba2 name (after backbone.layers.{i}.) -> llama.cpp's, as Mamba2Model writes it
_MAMBA2_LAYER_NAMES = {"norm.weight": "attn_norm.weight"} | {hf: g for g, hf in mamba2_mixer_names("mixer").items()}
_MIXER_KINDS = {"conv1d.weight": "conv", "A_log": "a_log", "mixer.D": "d", "mixer.norm.weight": "norm", "mamba.D": "d",
                "mamba.norm.weight": "norm"}  # fmt: skip


def _mixer_kind(name: str) -> str | None:
    """Which of the mixer's reshaped tensors `name` is (`to_gguf`'s kind), or None."""
    return next((kind for suffix, kind in _MIXER_KINDS.items() if name.endswith(suffix)), None)


def add_ssm_keys(writer: Any, kernel: int, inner: int, state: int, heads: int, groups: int) -> None:
    """The `ssm.*` keys of a Mamba2 mixer (Mamba2Model.set_gguf_parameters; its subclasses write
    the same five): heads as `time_step_rank`, as llama.cpp reads them."""
    writer.add_ssm_conv_kernel(kernel)
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_state_size(state)
    writer.add_ssm_time_step_rank(heads)
    writer.add_ssm_group_count(groups)


def write_mamba2(hf_model: torch.nn.Module, path: Path, tokenizer: str) -> Path:
    """A transformers Mamba2 as llama.cpp's Mamba2Model converter writes it: the conv weight
    squeezed to [conv_dim, kernel], A stored as -exp(A_log) and D as [heads, 1], the gated norm
    as [groups, inner / groups], the `mamba2.ssm.*` keys (float32 tensors)."""
    import gguf

    config = hf_model.config
    inner = int(config.expand * config.hidden_size)
    writer = gguf.GGUFWriter(str(path), "mamba2")
    writer.add_name("mamba2 tiny")
    writer.add_context_length(2**20)  # what the converter writes
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_block_count(config.num_hidden_layers)
    add_ssm_keys(writer, config.conv_kernel, inner, config.state_size, config.num_heads, config.n_groups)
    writer.add_layer_norm_rms_eps(config.layer_norm_epsilon)
    writer.add_vocab_size(config.vocab_size)
    add_tokenizer(writer, config, "mamba2", tokenizer)
    globals_ = {"backbone.embeddings.weight": "token_embd.weight", "backbone.norm_f.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}  # fmt: skip
    for name, tensor in hf_model.state_dict().items():
        data = tensor.detach().float()
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name in globals_:
            writer.add_tensor(globals_[name], data.contiguous().numpy())
            continue
        _, _, block, leaf = name.split(".", 3)  # backbone.layers.{i}.<leaf>
        if leaf not in _MAMBA2_LAYER_NAMES:
            raise ConformanceError(f"{name} has no GGUF name for mamba2")
        if (kind := _mixer_kind(name)) is not None:
            data = to_gguf(kind, data, groups=config.n_groups)
        writer.add_tensor(f"blk.{block}.{_MAMBA2_LAYER_NAMES[leaf]}", data.contiguous().numpy())
    return finish_writer(writer, path)


def split_qkvz(weight: torch.Tensor, config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3NextModel.modify_tensors: HF's in_proj_qkvz rows, [q, k, v, z] per key head, as the
    `attn_qkv` rows (every head's q, then every k, then every v) and the `attn_gate` rows (z)."""
    head_k, head_v = config.linear_key_head_dim, config.linear_value_head_dim
    num_k, num_v, hidden = config.linear_num_key_heads, config.linear_num_value_heads, config.hidden_size
    sizes = [head_k, head_k, num_v // num_k * head_v, num_v // num_k * head_v]
    data = weight.permute(1, 0).contiguous().view(-1, num_k, sum(sizes))  # [hidden, key heads, q+k+v+z]
    q, k, v, z = (part.contiguous().view(hidden, -1) for part in torch.split(data, sizes, dim=-1))
    return torch.cat([q, k, v], dim=-1).permute(1, 0).contiguous(), z.permute(1, 0).contiguous()


def write_qwen3next(hf_model: torch.nn.Module, path: Path, tokenizer: str, fused_qkvz: bool = False) -> Path:
    """A transformers Qwen3-Next as llama.cpp's Qwen3NextModel converter writes it (with
    TextModel's and Qwen2MoeModel's keys): every norm but the delta-net's stored as 1 + w, A as
    -exp(A_log) `[heads]`, the conv squeezed, dt_bias as `ssm_dt.bias`, in_proj_qkvz split into
    `attn_qkv` and `attn_gate` (`fused_qkvz`: kept whole as `ssm_in`, as converters before the
    split wrote it), in_proj_ba as `ssm_ba`, the experts as gate/up/down stacks, the shared
    expert's gate as `ffn_gate_inp_shexp`; `attention.recurrent_layers` from `layer_types`."""
    config = hf_model.config

    def split(name: str, data: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        if not name.endswith("in_proj_qkvz.weight") or fused_qkvz:
            return None
        qkv, z = split_qkvz(data, config)
        block = name.split(".")[2]
        return [(f"blk.{block}.attn_qkv.weight", qkv), (f"blk.{block}.attn_gate.weight", z)]

    return _write_gated_delta_net(hf_model, path, tokenizer, "qwen3next", split=split)


def write_qwen35(hf_model: torch.nn.Module, path: Path, tokenizer: str) -> Path:
    """A transformers Qwen3.5 or Qwen3.5-MoE as llama.cpp's Qwen3_5TextModel / Qwen3_5MoeTextModel
    writes it (`qwen35` / `qwen35moe`): Qwen3NextModel's conventions and keys, the value heads
    tiled (`tile_v_heads`), the four delta-net projections under their own names (`attn_qkv`,
    `attn_gate`, `ssm_beta`, `ssm_alpha`), a dense model's MLP as `ffn_gate` / `ffn_up` /
    `ffn_down`, and `rope.dimension_sections` (the config's `mrope_section` padded to four, else
    [11, 11, 10, 0] as _Qwen35MRopeMixin writes)."""
    config = hf_model.config
    arch = "qwen35moe" if getattr(config, "num_experts", 0) else "qwen35"
    return _write_gated_delta_net(hf_model, path, tokenizer, arch, reorder=lambda name, data: tile_v_heads(name, data, config))


def tile_v_heads(name: str, data: torch.Tensor, config: Any) -> torch.Tensor:
    """_LinearAttentionVReorderBase.modify_tensors: where value heads outnumber key heads, HF's
    grouped value heads (each key head's together) reordered to tiled (value head i of every key
    head, then i + 1) in every delta-net tensor that has them: the v rows of in_proj_qkv and of the
    conv, in_proj_z's rows, in_proj_b / in_proj_a / A_log / dt_bias, out_proj's columns."""
    num_k, num_v = config.linear_num_key_heads, config.linear_num_value_heads
    if num_k == num_v or "linear_attn." not in name:
        return data
    head_v, key_dim = config.linear_value_head_dim, 2 * num_k * config.linear_key_head_dim  # q and k rows

    def tiled(tensor: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:  # _reorder_v_heads
        shape = list(tensor.shape)
        grouped = tensor.reshape(*shape[:dim], num_k, num_v // num_k, head_dim, *shape[dim + 1:])
        return grouped.transpose(dim, dim + 1).contiguous().reshape(shape)

    if ".in_proj_qkv." in name or ".conv1d." in name:
        return torch.cat([data[:key_dim], tiled(data[key_dim:], 0, head_v)])
    if ".in_proj_z." in name:
        return tiled(data, 0, head_v)
    if name.endswith((".in_proj_b.weight", ".in_proj_a.weight", ".A_log", ".dt_bias")):
        return tiled(data, 0, 1)
    if ".out_proj." in name:
        return tiled(data, 1, head_v)
    return data


def _write_gated_delta_net(
    hf_model: torch.nn.Module,
    path: Path,
    tokenizer: str,
    arch: str,  # "qwen3next", "qwen35", "qwen35moe"
    reorder: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, data: data,  # before the shared transforms
    split: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]] | None] = lambda name, data: None,
) -> Path:
    """What Qwen3NextModel and its Qwen3.5 subclasses share: TextModel's keys, Qwen2MoeModel's
    expert widths, the delta-net's `ssm.*` keys and layer pattern, and the tensor transforms."""
    import gguf

    config = hf_model.config
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    rope = config.rope_parameters
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"{arch} tiny")
    writer.add_block_count(config.num_hidden_layers)  # TextModel.set_gguf_parameters
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    if getattr(config, "intermediate_size", None) is not None:  # Qwen3.5-MoE has none
        writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if arch != "qwen3next":  # _Qwen35MRopeMixin (TextModel pads a config's sections to four)
        writer.add_rope_dimension_sections((list(rope.get("mrope_section", [11, 11, 10])) + [0, 0, 0])[:4])
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "num_experts", 0):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if getattr(config, "num_experts", 0):  # Qwen2MoeModel
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)  # Qwen3NextModel
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    # gguf-py's add_recurrent_layers, which this gguf version lacks: the same key and array
    writer.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in config.layer_types])
    writer.add_full_attention_interval(getattr(config, "full_attention_interval", 4))
    writer.add_rope_dimension_count(int(config.head_dim * rope.get("partial_rotary_factor", 0.25)))
    writer.add_vocab_size(config.vocab_size)
    add_tokenizer(writer, config, arch, tokenizer)
    for name, tensor in hf_model.state_dict().items():
        data = reorder(name, tensor.detach().float())
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif (kind := _mixer_kind(name)) is not None:
            data = to_gguf(kind, data, column=False)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            data = data + 1
        for gguf_name, part in split(name, data) or gguf_tensors(names, arch, name, data):
            writer.add_tensor(gguf_name, part.contiguous().numpy())
    return finish_writer(writer, path)


def falcon_h1_multiplied(name: str, tensor: torch.Tensor, config: Any) -> torch.Tensor:
    """FalconH1Model.modify_tensors: the muP multipliers folded into the weights, in the
    converter's order of tests (the model then runs with every multiplier 1)."""
    if "down_proj" in name:
        return tensor * config.mlp_multipliers[1]
    if "gate_proj" in name:
        return tensor * config.mlp_multipliers[0]
    if "k_proj" in name:
        return tensor * config.key_multiplier * config.attention_in_multiplier
    if "q_proj" in name or "v_proj" in name:
        return tensor * config.attention_in_multiplier
    if "o_proj" in name:
        return tensor * config.attention_out_multiplier
    if "out_proj" in name:
        return tensor * config.ssm_out_multiplier
    if "in_proj" in name:
        tensor = tensor * config.ssm_in_multiplier
        inner, bc = config.mamba_d_ssm, config.mamba_n_groups * config.mamba_d_state
        bounds = [0, inner, 2 * inner, 2 * inner + bc, 2 * inner + 2 * bc, tensor.shape[0]]  # z, x, B, C, dt
        for multiplier, start, end in zip(config.ssm_multipliers, bounds, bounds[1:]):
            tensor[start:end] *= multiplier
        return tensor
    if "lm_head" in name:
        return tensor * config.lm_head_multiplier
    if "embed_tokens" in name:
        return tensor * config.embedding_multiplier
    return tensor


def write_falcon_h1(hf_model: torch.nn.Module, path: Path, tokenizer: str) -> Path:
    """A transformers Falcon-H1 as llama.cpp's FalconH1Model converter writes it: Mamba2Model's
    mixer tensors and `ssm.*` keys (inner size `mamba_d_ssm`), the attention and MLP under
    Llama's names, every muP multiplier folded into the weights (`falcon_h1_multiplied`), the
    attention sizes and the context length that FalconH1Model sets over Mamba2Model's."""
    import gguf

    config = hf_model.config
    arch = "falcon-h1"
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("falcon-h1 tiny")
    writer.add_context_length(config.max_position_embeddings)  # FalconH1Model's values over Mamba2Model's
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_block_count(config.num_hidden_layers)
    add_ssm_keys(writer, config.mamba_d_conv, config.mamba_d_ssm, config.mamba_d_state,
                 config.mamba_d_ssm // config.mamba_d_head, config.mamba_n_groups)  # fmt: skip
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads  # in real configs
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    add_tokenizer(writer, config, arch, tokenizer)
    for name, tensor in hf_model.state_dict().items():
        data = tensor.detach().float()
        if (name == "lm_head.weight" and config.tie_word_embeddings) or name.endswith(("mup_vector", "inv_freq")):
            continue  # buffers, not checkpoint tensors
        if name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif (kind := _mixer_kind(name)) is not None:
            data = to_gguf(kind, data, groups=config.mamba_n_groups)
        for gguf_name, part in gguf_tensors(names, arch, name, falcon_h1_multiplied(name, data, config)):
            writer.add_tensor(gguf_name, part.contiguous().numpy())
    return finish_writer(writer, path)


# transformers 5.x keeps GraniteMoeHybrid's experts under other names in memory than on disk,
# where the converter reads them: in-memory suffix -> the checkpoint's
_GRANITE_ON_DISK = {".block_sparse_moe.experts.gate_up_proj": ".block_sparse_moe.input_linear.weight",
                    ".block_sparse_moe.experts.down_proj": ".block_sparse_moe.output_linear.weight",
                    ".block_sparse_moe.router.weight": ".block_sparse_moe.router.layer.weight"}  # fmt: skip


def granite_hybrid_checkpoint(hf_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A Bamba's or GraniteMoeHybrid's tensors under the names its saved checkpoint has."""
    out = {}
    for name, tensor in hf_model.state_dict().items():
        suffix = next((s for s in _GRANITE_ON_DISK if name.endswith(s)), None)
        out[name if suffix is None else name.removesuffix(suffix) + _GRANITE_ON_DISK[suffix]] = tensor
    return out


def _granite_hybrid_tensors(names: Any, name: str, data: torch.Tensor, config: Any, attention: bool,
                            experts: bool) -> list[tuple[str, torch.Tensor]]:  # fmt: skip
    """GraniteHybridModel.modify_tensors: the MLP's gate/up halves split (GraniteMoeModel), the
    shared MLP named as a dense MLP without experts, Q/K rows permuted in attention layers
    (LlamaModel.permute), the mixer reshaped (Mamba2Model)."""
    block = name.split(".")[2] if name.startswith("model.layers.") else ""
    if name.endswith(("block_sparse_moe.input_linear.weight", "shared_mlp.input_linear.weight")):
        shared = "shared_mlp" in name
        gate, up = data.split(config.shared_intermediate_size if shared else config.intermediate_size, dim=-2)
        kind = ("_shexp" if experts else "") if shared else "_exps"
        return [(f"blk.{block}.ffn_gate{kind}.weight", gate), (f"blk.{block}.ffn_up{kind}.weight", up)]
    if name.endswith("shared_mlp.output_linear.weight") and not experts:
        return [(f"blk.{block}.ffn_down.weight", data)]
    if attention and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
        data = llama_permute(data, heads)
    elif (kind := _mixer_kind(name)) is not None:
        data = to_gguf(kind, data, groups=config.mamba_n_groups)
    return gguf_tensors(names, "granitehybrid", name, data)


def write_granite_hybrid(hf_model: torch.nn.Module, path: Path, tokenizer: str) -> Path:
    """A transformers GraniteMoeHybrid or Bamba as llama.cpp's GraniteHybridModel converter writes
    both: TextModel's and LlamaModel's keys (no key_length: GraniteModel drops head_dim), Granite's
    multipliers as `attention.scale` / `embedding_scale` / `residual_scale` / `logit_scale` where the
    config has them, the shared MLP width, the `ssm.*` keys, `attention.head_count_kv` per layer (0
    for Mamba2 layers), `rope.scaling.finetuned` true only for Bamba (else context length 2**20),
    the tensors as `_granite_hybrid_tensors` writes them. A Bamba's rotary part is written as
    `rope.dimension_count`, as the converter writes the `attn_rotary_emb` of Bamba's hub configs."""
    import gguf

    config = hf_model.config
    arch, bamba = "granitehybrid", config.model_type == "bamba"
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_HYBRID, config.num_hidden_layers)
    attention = set(config.attn_layer_indices if bamba else
                    [i for i, t in enumerate(config.layer_types) if t in ("full_attention", "attention")])  # fmt: skip
    experts = bool(getattr(config, "num_local_experts", 0))
    rope = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"{config.model_type} tiny")
    writer.add_block_count(config.num_hidden_layers)  # TextModel.set_gguf_parameters
    writer.add_context_length(config.max_position_embeddings if bamba else 2**20)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if not bamba:
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_vocab_size(config.vocab_size)  # LlamaModel
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if not bamba:  # GraniteModel writes each *_multiplier as a scale; GraniteMoeModel the shared MLP
        multipliers = {"attention.scale": config.attention_multiplier, "embedding_scale": config.embedding_multiplier,
                       "residual_scale": config.residual_multiplier, "logit_scale": config.logits_scaling}  # fmt: skip
        for key, value in multipliers.items():
            writer.add_float32(f"{arch}.{key}", value)
        writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
    inner = int(config.mamba_expand * config.hidden_size)  # GraniteHybridModel
    add_ssm_keys(writer, config.mamba_d_conv, inner, config.mamba_d_state, config.mamba_n_heads, config.mamba_n_groups)
    writer.add_head_count_kv([config.num_key_value_heads if i in attention else 0 for i in range(config.num_hidden_layers)])
    writer.add_rope_scaling_finetuned(bamba)
    add_tokenizer(writer, config, arch, tokenizer)
    for name, tensor in granite_hybrid_checkpoint(hf_model).items():
        data = tensor.detach().float()
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith(".dt_bias"):  # Mamba2Model.filter_tensors
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        in_attention = name.startswith("model.layers.") and int(name.split(".")[2]) in attention
        for gguf_name, part in _granite_hybrid_tensors(names, name, data, config, in_attention, experts):
            writer.add_tensor(gguf_name, part.contiguous().numpy())
    return finish_writer(writer, path)


def _nemotron_h_tensors(names: Any, name: str, data: torch.Tensor, config: Any) -> list[tuple[str, torch.Tensor]]:
    """NemotronHModel.modify_tensors on one of transformers' in-memory tensors: `model.` as the
    checkpoint's `backbone.`, Q/K rows permuted (LlamaModel.permute, through GraniteHybridModel),
    the mixer reshaped (Mamba2Model), `dt_bias` and `e_score_correction_bias` renamed as the
    converter renames them, the experts (stacked in memory as the converter stacks them) under
    the name it gives the stack."""
    name = "backbone." + name.removeprefix("model.") if name.startswith("model.") else name
    block = name.split(".")[2] if name.startswith("backbone.layers.") else ""
    if name.endswith((".mixer.experts.up_proj", ".mixer.experts.down_proj")):
        name = f"model.layers.{block}.mlp.experts.{name.rpartition('.')[2]}.weight"
    elif name.endswith((".dt_bias", ".e_score_correction_bias")):
        name = name.removesuffix("_bias") + ".bias"
    elif name.endswith(("q_proj.weight", "k_proj.weight")):
        data = llama_permute(data, config.num_attention_heads if "q_proj" in name else config.num_key_value_heads)
    elif (kind := _mixer_kind(name)) is not None:
        data = to_gguf(kind, data, groups=config.n_groups)
    return gguf_tensors(names, "nemotron_h", name, data)


def write_nemotron_h(hf_model: torch.nn.Module, path: Path, tokenizer: str) -> Path:
    """A transformers NemotronH as llama.cpp's NemotronHModel converter writes it from a hub
    config (its `hybrid_override_pattern` string): `nemotron_h_moe` with MoE layers, else
    `nemotron_h`; GraniteHybridModel's keys (context length 2**20, `ssm.*`, `head_count_kv` per
    layer, 0 but for attention) and NemotronHModel's (`key_length`, `feed_forward_length` per layer,
    0 but for MLP or MoE layers; the expert keys), the tensors as `_nemotron_h_tensors` writes
    them. A config with both MLP and MoE layers has no such file (llama.cpp routes every
    feed-forward layer of a MoE file) and is refused."""
    import gguf

    config = hf_model.config
    kinds = list(config.layers_block_type)
    moe = "moe" in kinds
    if moe and "mlp" in kinds:
        raise ConformanceError("NemotronH with both mlp and moe layers: llama.cpp's files cannot hold it")
    arch = "nemotron_h_moe" if moe else "nemotron_h"
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(model_arch, len(kinds))
    ffn = config.moe_intermediate_size if moe else config.intermediate_size
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("nemotron_h tiny")
    writer.add_block_count(len(kinds))  # TextModel.set_gguf_parameters
    writer.add_context_length(2**20)  # GraniteHybridModel: no rope
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length([ffn if k in ("mlp", "moe") else 0 for k in kinds])  # NemotronHModel's array
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    writer.add_vocab_size(config.vocab_size)  # LlamaModel
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)  # GraniteModel drops head_dim
    add_ssm_keys(writer, config.conv_kernel, config.mamba_num_heads * config.mamba_head_dim, config.ssm_state_size,
                 config.mamba_num_heads, config.n_groups)  # fmt: skip
    writer.add_head_count_kv([config.num_key_value_heads if k == "full_attention" else 0 for k in kinds])
    writer.add_rope_scaling_finetuned(False)
    writer.add_key_length(config.head_dim)  # NemotronHModel
    writer.add_value_length(config.head_dim)
    if moe:
        writer.add_expert_count(config.n_routed_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.moe_shared_expert_intermediate_size)
        writer.add_expert_shared_count(config.n_shared_experts)
        writer.add_expert_weights_norm(config.norm_topk_prob)
        writer.add_expert_weights_scale(config.routed_scaling_factor)
    add_tokenizer(writer, config, arch, tokenizer)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        for gguf_name, part in _nemotron_h_tensors(names, name, tensor.detach().float(), config):
            writer.add_tensor(gguf_name, part.contiguous().numpy())
    return finish_writer(writer, path)
