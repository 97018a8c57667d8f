"""FalconH1ForCausalLM: every layer runs a Mamba2 mixer and attention in parallel on the same
normed input, sums them into the residual, then a SwiGLU MLP.

Falcon-H1's muP scalars, all from the config: embeddings times `embedding_multiplier`; the mixer
input times `ssm_in_multiplier`, its in_proj output times a per-channel `mup_vector` built from
`ssm_multipliers` (z, x, B, C, dt sections), its output times `ssm_out_multiplier`; attention input
times `attention_in_multiplier`, keys times `key_multiplier` (before rotary), output times
`attention_out_multiplier`; MLP gate times `mlp_multipliers[0]`, output times `mlp_multipliers[1]`;
logits times `lm_head_multiplier`. The mixer's output gate differs from Mamba2's: without
`mamba_rms_norm` it is y * silu(z) (no norm); with it, a grouped RMSNorm before
(`mamba_norm_before_gate`, the default) or after the gate. The mixer's in_proj bias follows
`mamba_proj_bias`, its out_proj bias `projectors_bias`.

Checkpoint names: `model.layers.{i}.mamba.*`, `.self_attn.*`, `.feed_forward.*`,
`.input_layernorm`, `.pre_ff_layernorm`, `model.final_layernorm`, `model.embed_tokens`, `lm_head`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slotrunner.models.causal_lm import CausalLM, DecoderStack, StackNames
from slotrunner.models.layers.hf_act import hf_activation
from slotrunner.core_runner.distributed.parallel_state import SINGLE, TensorParallelGroup
from slotrunner.core_runner.distributed.shard import Shard, check_head_split, even_shard
from slotrunner.models.layers.linear import Linear
from slotrunner.models.layers.mamba.parallel import check_mixer_split, in_proj_parts, in_proj_rows
from slotrunner.models.layers.parallel_linear import (
    MergedColumnParallelLinear,
    ShardedWeights,
    merged_column_linear,
    row_linear,
)
from slotrunner.models.layers.lm_head import LogitScale
from slotrunner.models.layers.mamba.mixer import Mamba2MixerArgs, MambaMixer2
from slotrunner.models.layers.norm import RMSNorm
from slotrunner.models.llama import LlamaArgs, LlamaAttention
from slotrunner.models.weights import GATE_UP_SHARDS, QKV_SHARDS


def _intermediate(c: object) -> int:
    return c.mamba_d_ssm if c.mamba_d_ssm is not None else int(c.mamba_expand * c.hidden_size)


def mixer_args(c: object) -> Mamba2MixerArgs:
    return Mamba2MixerArgs.from_mamba_prefixed(c, intermediate_size=_intermediate(c))


def mup_vector(c: object) -> torch.Tensor:  # [in_proj out features]
    inter, group = _intermediate(c), c.mamba_n_groups * c.mamba_d_state
    sizes = [inter, inter, group, group, c.mamba_n_heads]  # z, x, B, C, dt
    return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, c.ssm_multipliers)])


class ScaledLinear(Linear):
    """Linear whose output is multiplied per feature by a fixed (non-checkpoint) vector."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scale: torch.Tensor) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale.to(x.dtype)


class ScaledMergedColumnParallelLinear(MergedColumnParallelLinear):
    """`ScaledLinear` under tensor parallelism: the rank's rows, times their entries of the vector."""

    def __init__(self, in_features: int, parts: dict, bias: bool, tp: TensorParallelGroup, scale: torch.Tensor) -> None:
        super().__init__(in_features, parts, bias, tp)
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale.to(x.dtype)


class FalconOutputGate(nn.Module, ShardedWeights):
    """Replaces the mixer's gated norm: y * silu(z), or RMSNorm per group before/after the gate.
    Under tensor parallelism it holds the rank's `rows` of the mixer's heads; a group spread over
    the ranks (one group, several ranks) has its sum of squares all-reduced."""

    def __init__(
        self, size: int, n_groups: int, eps: float, rms_norm: bool, norm_before_gate: bool, rows: Shard | None = None,
        tp: TensorParallelGroup = SINGLE,
    ) -> None:  # fmt: skip
        super().__init__()
        self.rms_norm = rms_norm
        self.norm_before_gate = norm_before_gate
        self.rows = Shard(0, size, size) if rows is None else rows
        self.full_group = size // n_groups
        self.spans_ranks = self.full_group > self.rows.size
        self.group_size = self.rows.size if self.spans_ranks else self.full_group
        self.tp = tp
        self.eps = eps
        if rms_norm:
            self.weight = nn.Parameter(torch.ones(self.rows.size))

    def load_full(self, param_name: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            self.weight.copy_(self.rows.narrow(tensor, 0))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # [tokens, size] each
        dtype = y.dtype
        h, gate = y.float(), F.silu(z.float())
        if not self.rms_norm:
            return (h * gate).to(dtype)
        if not self.norm_before_gate:
            h = h * gate
        g = h.view(*h.shape[:-1], -1, self.group_size)
        if self.spans_ranks:
            mean_sq = self.tp.all_reduce(g.pow(2).sum(-1, keepdim=True)) / self.full_group
        else:
            mean_sq = g.pow(2).mean(-1, keepdim=True)
        h = (g * torch.rsqrt(mean_sq + self.eps)).view(h.shape) * self.weight.float()
        if self.norm_before_gate:
            h = h * gate
        return h.to(dtype)


class FalconH1Mixer(MambaMixer2):
    def __init__(self, c: object, layer_idx: int) -> None:
        args = mixer_args(c)
        super().__init__(args, layer_idx)
        a, shards = args, self.shards  # whole sizes; this rank's heads (all at tensor_parallel_size 1)
        proj_size = a.intermediate_size + a.conv_dim + a.num_heads
        scale = in_proj_rows(mup_vector(c), a, shards)
        if shards.tp.world_size == 1:
            self.in_proj = ScaledLinear(a.hidden_size, proj_size, a.use_bias, scale)  # [z | xBC | dt]
        else:
            self.in_proj = ScaledMergedColumnParallelLinear(a.hidden_size, in_proj_parts(a, shards), a.use_bias, shards.tp, scale)
        rows = Shard(shards.heads.start * a.head_dim, shards.heads.size * a.head_dim, a.intermediate_size)
        self.norm = FalconOutputGate(
            a.intermediate_size, a.n_groups, a.norm_eps, bool(c.mamba_rms_norm), bool(c.mamba_norm_before_gate),
            rows, shards.tp,
        )  # fmt: skip
        self.out_proj = row_linear(a.intermediate_size, a.hidden_size, bias=bool(c.projectors_bias))


class FalconH1Attention(LlamaAttention):
    def __init__(self, args: LlamaArgs, layer_idx: int, key_multiplier: float) -> None:
        super().__init__(args, layer_idx)
        self.key_multiplier = key_multiplier

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        k = k * self.key_multiplier
        return self.o_proj(self.attn(q, k, v, rotate=self.rotation(positions)))


class FalconH1MLP(nn.Module):
    def __init__(self, c: object) -> None:
        super().__init__()
        bias = bool(getattr(c, "mlp_bias", False))
        sizes = {"gate": c.intermediate_size, "up": c.intermediate_size}
        self.gate_up_proj = merged_column_linear(c.hidden_size, sizes, bias=bias)
        self.act = hf_activation(c.hidden_act)
        self.down_proj = row_linear(c.intermediate_size, c.hidden_size, bias=bias)
        self.gate_multiplier, self.down_multiplier = (float(m) for m in c.mlp_multipliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        y = self.act(gate * self.gate_multiplier) * up
        return self.down_proj(y) * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, c: object, args: LlamaArgs, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mamba = FalconH1Mixer(c, layer_idx)
        self.self_attn = FalconH1Attention(args, layer_idx, float(c.key_multiplier))
        self.pre_ff_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.feed_forward = FalconH1MLP(c)
        self.ssm_in = float(c.ssm_in_multiplier)
        self.ssm_out = float(c.ssm_out_multiplier)
        self.attn_in = float(c.attention_in_multiplier)
        self.attn_out = float(c.attention_out_multiplier)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(h)
        ssm = self.mamba(x * self.ssm_in) * self.ssm_out
        attn = self.self_attn(positions, x * self.attn_in) * self.attn_out
        h = h + (ssm + attn)
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class FalconH1ForCausalLM(CausalLM):
    """Given `inputs_embeds` are taken as they are: `embedding_multiplier` scales lookups only."""

    merged = QKV_SHARDS | GATE_UP_SHARDS

    @classmethod
    def check_tensor_parallel(cls, hf_config: object, world_size: int) -> None:
        """ValueError when the attention heads, the MLP or the mixers' heads or groups cannot be
        split over `world_size` ranks."""
        args, mamba = LlamaArgs.from_hf(hf_config), mixer_args(hf_config)
        check_head_split(args.num_heads, args.num_kv_heads, world_size)
        even_shard(hf_config.intermediate_size, 0, world_size, "intermediate_size")
        check_mixer_split(mamba.num_heads, mamba.n_groups, world_size)

    def __init__(self, hf_config: object) -> None:
        c = hf_config
        args = LlamaArgs.from_hf(c)
        layers = (FalconH1DecoderLayer(c, args, i) for i in range(c.num_hidden_layers))
        norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        names = StackNames(final_norm="final_layernorm")
        stack = DecoderStack(
            names, c.vocab_size, c.hidden_size, layers, norm, embedding_multiplier=float(c.embedding_multiplier)
        )
        super().__init__(stack, args.tie_word_embeddings, LogitScale(multiplier=float(c.lm_head_multiplier)))
