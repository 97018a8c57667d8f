"""GatedDeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5.

in_proj -> q, k, v (concatenated: the conv's channels), z (output gate), b (beta = sigmoid(b)),
a (g = -exp(A_log) * softplus(a + dt_bias), the log decay); a depthwise causal conv1d + SiLU
over [q | k | v] (no bias); the gated delta rule per value head over L2-normalised q and k
(chunked for prefill rows, one step for decode rows); a per-head RMSNorm of the output times
SiLU(z); out_proj. Per-request state, declared by `state_spec` and bound by the recurrent-state
ModelState: the conv window [conv_dim, conv_kernel - 1] (model dtype) and the matrix state
[num_v_heads, head_k_dim, head_v_dim] (float32: it accumulates over the whole sequence).

Projections as the checkpoints store them: Qwen3-Next fuses `in_proj_qkvz` and `in_proj_ba`,
grouped per key head ([q | k | v of its value heads | z of its value heads], [b | a]); Qwen3.5
has `in_proj_qkv` (q, k, v back to back), `in_proj_z`, `in_proj_b`, `in_proj_a`. Under tensor
parallelism each rank builds and runs the layer for its heads only (`parallel.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from slotrunner.core_runner.attention.forward_context import get_forward_context
from slotrunner.models.layers.gated_delta_net import parallel
from slotrunner.models.layers.gated_delta_net.chunk import chunk_gated_delta_rule
from slotrunner.models.layers.gated_delta_net.recurrent import recurrent_gated_delta_rule
from slotrunner.models.layers.mamba.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from slotrunner.models.layers.parallel_linear import ShardedWeights, column_linear, row_linear
from slotrunner.models.layers.recurrent_metadata import RecurrentMetadata
from slotrunner.models.layers.recurrent_state import RecurrentLayer, RecurrentStateSpec, StateTensorSpec


@dataclass(frozen=True)
class GatedDeltaNetArgs:
    """One gated delta-net's sizes, read once from the HF config (`linear_*` fields)."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    norm_eps: float
    fused_projections: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba, else Qwen3.5's four
    activation: str = "silu"

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"gated delta-net: linear_num_value_heads={self.num_v_heads} must be a multiple of "
                f"linear_num_key_heads={self.num_k_heads}"
            )
        if self.conv_kernel < 2:
            raise ValueError(f"gated delta-net: linear_conv_kernel_dim must be >= 2, got {self.conv_kernel}")
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"gated delta-net: activation {self.activation!r} is not supported (supported: silu)")

    @classmethod
    def from_hf(cls, c: object, fused_projections: bool) -> GatedDeltaNetArgs:
        return cls(
            hidden_size=c.hidden_size,
            num_k_heads=c.linear_num_key_heads,
            num_v_heads=c.linear_num_value_heads,
            head_k_dim=c.linear_key_head_dim,
            head_v_dim=c.linear_value_head_dim,
            conv_kernel=c.linear_conv_kernel_dim,
            norm_eps=c.rms_norm_eps,
            fused_projections=fused_projections,
            activation=getattr(c, "hidden_act", "silu"),
        )

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


class GatedHeadNorm(nn.Module):
    """RMSNorm over each head's output (weight as is, not 1 + w), then times SiLU(gate):
    normalise in float32, scale in the input dtype, gate in float32, as transformers does."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [..., head_dim] each
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(RecurrentLayer, ShardedWeights):
    def __init__(self, args: GatedDeltaNetArgs, layer_idx: int) -> None:
        super().__init__()
        # Under tensor parallelism this rank's heads: `self.args` holds its sizes, so the state
        # spec and the forward see only them (gated_delta_net/parallel.py); all of them otherwise.
        shards = parallel.delta_net_shards(args.num_k_heads, args.num_v_heads)
        self.v_heads = shards.v_heads
        self.args = parallel.rank_args(args, shards)
        self.layer_idx = layer_idx
        a = args  # the whole layer's sizes: the factories narrow them to the rank's
        if a.fused_projections:
            per_k = a.num_v_heads // a.num_k_heads
            self.in_proj_qkvz = parallel.grouped_linear(a, 2 * a.head_k_dim + 2 * per_k * a.head_v_dim)
            self.in_proj_ba = parallel.grouped_linear(a, 2 * per_k)
        else:
            self.in_proj_qkv = parallel.qkv_in_proj(a, shards)
            self.in_proj_z = column_linear(a.hidden_size, a.value_dim, bias=False)
            self.in_proj_b = column_linear(a.hidden_size, a.num_v_heads, bias=False)
            self.in_proj_a = column_linear(a.hidden_size, a.num_v_heads, bias=False)
        # Holds the depthwise taps under the checkpoint's name; the forward uses the kernels.
        self.conv1d = parallel.conv1d(a, shards)
        self.dt_bias = nn.Parameter(torch.ones(self.args.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.args.num_v_heads))
        self.norm = GatedHeadNorm(a.head_v_dim, a.norm_eps)  # one head's width: whole on every rank
        self.out_proj = row_linear(a.value_dim, a.hidden_size, bias=False)
        # Per-slot pools, bound by the recurrent-state ModelState (bind_state).
        self.conv_state: torch.Tensor | None = None  # [max_num_seqs, conv_dim, conv_kernel - 1]
        self.recurrent_state: torch.Tensor | None = None  # [max_num_seqs, num_v_heads, head_k_dim, head_v_dim] float32

    def load_full(self, param_name: str, tensor: torch.Tensor) -> None:
        """dt_bias, A_log: one value per value head, this rank's heads kept."""
        param = getattr(self, param_name)
        with torch.no_grad():
            param.copy_(self.v_heads.narrow(tensor, 0))

    def state_spec(self) -> RecurrentStateSpec:
        a = self.args
        conv = StateTensorSpec("conv_state", (a.conv_dim, a.conv_kernel - 1))
        recurrent = StateTensorSpec("recurrent_state", (a.num_v_heads, a.head_k_dim, a.head_v_dim), torch.float32)
        return RecurrentStateSpec("gated_delta_net", (conv, recurrent))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [num_tokens, hidden] -> mixed_qkv [num_tokens, conv_dim], z [num_tokens, num_v_heads,
        head_v_dim], b and a [num_tokens, num_v_heads]."""
        a, n = self.args, x.shape[0]
        if not a.fused_projections:
            z = self.in_proj_z(x).view(n, a.num_v_heads, a.head_v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        per_k = a.num_v_heads // a.num_k_heads  # value heads per key head
        qkvz = self.in_proj_qkvz(x).view(n, a.num_k_heads, -1)
        q, k, v, z = qkvz.split([a.head_k_dim, a.head_k_dim, per_k * a.head_v_dim, per_k * a.head_v_dim], dim=-1)
        b, a_ = self.in_proj_ba(x).view(n, a.num_k_heads, 2 * per_k).split([per_k, per_k], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return mixed, z.reshape(n, a.num_v_heads, a.head_v_dim), b.reshape(n, -1), a_.reshape(n, -1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> same
        meta = get_forward_context().family_attn
        assert isinstance(meta, RecurrentMetadata), (
            f"gated delta-net layer {self.layer_idx}: the forward context carries {type(meta).__name__}, not "
            "RecurrentMetadata (is the model served by RecurrentHybridModelState?)"
        )
        self.bound_states()
        a = self.args
        mixed, z, b, a_ = self._project(hidden)
        beta = b.sigmoid().float().contiguous()  # sigmoid in the model dtype, as transformers does
        g = -self.A_log.float().exp() * F.softplus(a_.float() + self.dt_bias.float())
        core = torch.empty(hidden.shape[0], a.num_v_heads, a.head_v_dim, dtype=hidden.dtype, device=hidden.device)
        if meta.num_decodes:
            self._run(mixed, g, beta, meta.decode_token_idx, meta.decode_state_indices, core, decode=True, meta=meta)
        self.run_draft_steps(
            meta.draft_steps, lambda idx, slots: self._run(mixed, g, beta, idx, slots, core, decode=True, meta=meta)
        )
        if meta.num_prefills:
            self._run(mixed, g, beta, meta.prefill_token_idx, meta.prefill_state_indices, core, decode=False, meta=meta)
        out = self.norm(core, z).view(hidden.shape[0], a.value_dim)
        return self.out_proj(out)

    def _run(
        self,
        mixed: torch.Tensor,  # [num_tokens, conv_dim]
        g: torch.Tensor,  # [num_tokens, num_v_heads] float32
        beta: torch.Tensor,  # [num_tokens, num_v_heads] float32
        token_idx: torch.Tensor | None,  # the rows' tokens; None: all of them, in order
        slots: torch.Tensor,  # [rows] int64, slot of each row
        core: torch.Tensor,  # [num_tokens, num_v_heads, head_v_dim], written at token_idx
        decode: bool,
        meta: RecurrentMetadata,
    ) -> None:
        a = self.args
        if token_idx is not None:
            mixed, g, beta = mixed.index_select(0, token_idx), g.index_select(0, token_idx), beta.index_select(0, token_idx)
        weight = self.conv1d.weight.view(a.conv_dim, a.conv_kernel)
        if decode:
            mixed = causal_conv1d_update(mixed, weight, None, self.conv_state, slots, a.activation)
        else:
            mixed = causal_conv1d_varlen(
                mixed, weight, None, self.conv_state, meta.prefill_query_start_loc, slots,
                meta.prefill_has_initial_state, a.activation,
            )  # fmt: skip
        q, k, v = mixed.split([a.key_dim, a.key_dim, a.value_dim], dim=-1)
        q = q.view(-1, a.num_k_heads, a.head_k_dim)
        k = k.view(-1, a.num_k_heads, a.head_k_dim)
        v = v.view(-1, a.num_v_heads, a.head_v_dim)
        if decode:
            out = recurrent_gated_delta_rule(q, k, v, g, beta, self.recurrent_state, slots)
        else:
            out = chunk_gated_delta_rule(
                q, k, v, g, beta, self.recurrent_state, meta.prefill_query_start_loc, slots,
                meta.prefill_has_initial_state,
            )  # fmt: skip
        if token_idx is None:
            core.copy_(out)
        else:
            core.index_copy_(0, token_idx, out)
