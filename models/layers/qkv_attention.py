"""QKVAttention: the attention block of the Llama-style decoders, from fused q/k/v to o_proj.

fused q/k/v projection -> optional per-head q/k RMSNorm -> rotary -> paged attention (the
`Attention` layer binds the KV cache) -> o_proj. Llama, Mistral, Qwen2/3, Phi-3, the MoE decoders
and Gemma differ only in what they build it from (scale, window, soft cap, norm form, rotary),
so each architecture's attention class is a constructor over this one forward. Submodule names
follow the checkpoints (`qkv_proj` is merged from q/k/v_proj by the loader).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from slotrunner.core_runner.attention.backend import AttentionSpec, Rotate
from slotrunner.core_runner.attention.layer import Attention
from slotrunner.models.layers.parallel_linear import qkv_linear, rank_spec, row_linear


class QKVAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        spec: AttentionSpec,
        layer_idx: int,
        rotary_emb: nn.Module,  # (positions, q, k) -> (q, k); with q/k norms also `norm_and_rotate`
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norms: tuple[nn.Module, nn.Module] | None = None,  # per-head RMSNorm of q and of k
    ) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.qkv_proj = qkv_linear(hidden_size, spec, qkv_bias)
        self.o_proj = row_linear(spec.num_heads * spec.head_dim, hidden_size, o_bias)
        spec = rank_spec(spec)  # under tensor parallelism: this rank's heads, and KV cache for them
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qk_norm = qk_norms is not None
        if qk_norms is not None:
            self.q_norm, self.k_norm = qk_norms
        self.rotary_emb = rotary_emb
        self.attn = Attention(spec, layer_idx)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        return self.forward_qkv(positions, self.qkv_proj(x))

    def forward_normed(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(positions, h), x + residual) with h, x + residual = norm(x, residual): the
        decoder layer's residual add and norm in the q/k/v projection's launch where it can
        (`Linear.forward_normed`); a subclass with its own forward gets the norm first."""
        if type(self).forward is not QKVAttention.forward:
            x, residual = norm(x, residual)
            return self(positions, x), residual
        qkv, residual = self.qkv_proj.forward_normed(x, residual, norm)
        return self.forward_qkv(positions, qkv), residual

    def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:  # [num_tokens, q + 2 kv]
        """The layer after its q/k/v projection."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, rotate=self.rotation(positions)))

    def rotation(self, positions: torch.Tensor) -> Rotate:
        """This layer's rotary embedding at `positions`, for the attention backend to apply
        (`Attention.forward(..., rotate=)`): the Triton backend hands it the K/V cache write, which
        the rotary launch then makes too (a launch a layer fewer)."""
        return functools.partial(self._rotate, positions)

    def _rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, kv) -> tuple[torch.Tensor, torch.Tensor]:
        """q [num_tokens, num_heads, head_dim] and k [.., num_kv_heads, ..] rotated (after their
        per-head norms; one kernel for both norms and RoPE where Triton runs), `kv` written."""
        if self.qk_norm:
            return self.rotary_emb.norm_and_rotate(positions, q, k, self.q_norm, self.k_norm, kv)
        return self.rotary_emb(positions, q, k, kv)
