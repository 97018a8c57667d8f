"""Phi3ForCausalLM: the Llama implementation, read from Phi-3's config and files.

The math is Llama's with options Llama's flags already cover: a sliding window on every layer
when `sliding_window` is set, partial rotary (`partial_rotary_factor`) and LongRoPE
(`rope_type` "longrope": per-frequency factors, cos and sin times the attention factor). Of the
short and long factor sets, one serves every position: the long one when
`max_position_embeddings` exceeds `original_max_position_embeddings` (transformers' choice for
any sequence past that limit), the short one otherwise; `models/layers/rotary.py` gives the
rule and where it differs from transformers (sequences within the limit on a 128k model).

The checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`, in the order
Llama's fused modules keep them, so the tensors load whole under their own names: no mapping.
"""

from __future__ import annotations

from slotrunner.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    qkv_bias = False  # Phi-3 has no attention biases (and its config no `attention_bias`)
