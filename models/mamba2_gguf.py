"""A Mamba2 GGUF file (llama.cpp's `mamba2` architecture) as a Hugging Face checkpoint.

llama.cpp's converter (`Mamba2Model`) writes the mixer's tensors under `blk.{i}.ssm_*` names and
reshapes four of them (the conventions every recurrent mixer shares: `recurrent_gguf.py`); this
reader undoes that and yields transformers' `Mamba2ForCausalLM` names:

| GGUF | as stored | Hugging Face |
|---|---|---|
| `ssm_conv1d.weight` | `[conv_dim, kernel]` (squeezed) | `mixer.conv1d.weight` `[conv_dim, 1, kernel]` |
| `ssm_a` | `[heads, 1]`, A = -exp(A_log) | `mixer.A_log` `[heads]` = log(-A) |
| `ssm_d` | `[heads, 1]` | `mixer.D` `[heads]` |
| `ssm_norm.weight` | `[groups, inner / groups]` | `mixer.norm.weight` `[inner]` |
| `ssm_dt.bias` | `[heads]` | `mixer.dt_bias` |

A_log comes back through log(-A), so it can differ from the original in the last bit (the
model computes -exp(A_log) again). The metadata holds no chunk size, time-step limit or
residual precision: transformers' defaults apply, as llama.cpp assumes them. transformers'
GGUF loader reads `mamba` (Mamba-1) files only, so the tests check this reader against the
model a tiny file was written from.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import Mamba2Config

from slotrunner.core_runner.loader.gguf_file import GGUFFile
from slotrunner.models.llama_gguf import GGUFCheckpoint, make_config, metadata_getter, token_ids
from slotrunner.models.recurrent_gguf import RecurrentCheckpoint, mamba2_mixer_names, whole_name_table

_GLOBAL_NAMES = {"token_embd.weight": "backbone.embeddings.weight", "output_norm.weight": "backbone.norm_f.weight",
                 "output.weight": "lm_head.weight"}  # fmt: skip
_LAYER_NAMES = {"attn_norm.weight": "norm.weight", **mamba2_mixer_names("mixer")}


def read_mamba2_gguf(gguf: GGUFFile, path: str, dtype: torch.dtype, pack: bool = False) -> GGUFCheckpoint:
    """Read an opened `mamba2` GGUF file's config, tokenizer and tensor table (not the data).
    Raises ValueError naming the file for tensors or metadata Mamba2 cannot use."""
    gguf_names = whole_name_table(gguf, path, _GLOBAL_NAMES, _LAYER_NAMES, "backbone.layers", "Mamba2")
    config = _mamba2_config(gguf, gguf_names, path)
    return RecurrentCheckpoint.of(gguf, path, dtype, config, gguf_names, pack, permute_rotary=False)


def _mamba2_config(gguf: GGUFFile, hf_names: Mapping[str, str], path: str) -> Mamba2Config:
    metadata = gguf.metadata
    get = metadata_getter(gguf, "mamba2", path)

    hidden, inner, heads = get("embedding_length"), get("ssm.inner_size"), get("ssm.time_step_rank")
    if heads <= 0 or inner % heads or inner % hidden:
        raise ValueError(f"{path}: ssm.inner_size {inner} does not split into {heads} heads of an expansion of {hidden}.")
    state, groups, kernel = get("ssm.state_size"), get("ssm.group_count", 1), get("ssm.conv_kernel")
    conv_dim = inner + 2 * groups * state
    shapes = {hf: tuple(gguf.tensors[name].shape) for hf, name in hf_names.items()}
    conv = shapes.get("backbone.layers.0.mixer.conv1d.weight")
    if conv is not None and conv != (conv_dim, kernel):
        raise ValueError(f"{path}: ssm_conv1d has shape {conv}, the metadata implies {(conv_dim, kernel)}.")
    fields = dict(
        architectures=["Mamba2ForCausalLM"],
        vocab_size=shapes["backbone.embeddings.weight"][0],
        hidden_size=hidden,
        expand=inner // hidden,
        num_heads=heads,
        head_dim=inner // heads,
        state_size=state,
        n_groups=groups,
        conv_kernel=kernel,
        num_hidden_layers=get("block_count"),
        layer_norm_epsilon=get("attention.layer_norm_rms_epsilon", 1e-5),
        use_conv_bias="backbone.layers.0.mixer.conv1d.bias" in hf_names,
        use_bias="backbone.layers.0.mixer.in_proj.bias" in hf_names,
        tie_word_embeddings="lm_head.weight" not in hf_names,
        **token_ids(metadata),
    )
    return make_config(Mamba2Config, fields, path, "mamba2")
