"""MambaMixer2: the Mamba2 (SSD) mixer layer, shared by Mamba2 and the Mamba hybrids.

in_proj -> [z | xBC | dt]; causal conv1d + SiLU over xBC -> [x | B | C]; selective scan with
A = -exp(A_log), dt = softplus(dt + dt_bias) and the D skip; gated grouped RMSNorm with z;
out_proj. Per-request state -- the conv window and the SSM state -- is declared by `state_spec`
and lives in per-slot pools that `RecurrentHybridModelState` allocates and binds (`conv_state`,
`ssm_state`), as the runner binds `kv_cache` to attention layers. The layer reads the step's
`RecurrentMetadata` from the forward context: decode rows take the single-step kernels, prefill
rows the varlen chunked ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slotrunner.core_runner.attention.forward_context import get_forward_context
from slotrunner.models.layers.mamba.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from slotrunner.models.layers.mamba.parallel import conv1d as parallel_conv1d
from slotrunner.models.layers.mamba.parallel import gated_norm as parallel_gated_norm
from slotrunner.models.layers.mamba.parallel import in_proj as parallel_in_proj
from slotrunner.models.layers.mamba.parallel import mixer_shards, rank_args
from slotrunner.models.layers.parallel_linear import ShardedWeights, row_linear
from slotrunner.models.layers.mamba.selective_state_update import selective_state_update
from slotrunner.models.layers.mamba.ssd_chunk_scan import ssd_chunk_scan_varlen
from slotrunner.models.layers.recurrent_metadata import RecurrentMetadata
from slotrunner.models.layers.recurrent_state import RecurrentLayer, RecurrentStateSpec, StateTensorSpec


def parse_time_step_limit(value: Any) -> tuple[float, float]:
    """config.time_step_limit as two floats; config.json may spell infinity as
    `{"__float__": "Infinity"}` when read without transformers."""

    def num(v: Any) -> float:
        return float(v["__float__"]) if isinstance(v, dict) else float(v)

    if value is None:
        return (0.0, math.inf)
    lo, hi = value
    return (num(lo), num(hi))


@dataclass(frozen=True)
class Mamba2MixerArgs:
    """One Mamba2 mixer's sizes, read once from the model's HF config (field names differ by family)."""

    hidden_size: int
    intermediate_size: int  # num_heads * head_dim
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool
    use_bias: bool  # in_proj / out_proj bias
    norm_eps: float
    activation: str = "silu"
    time_step_limit: tuple[float, float] = (0.0, math.inf)

    def __post_init__(self) -> None:
        if self.num_heads * self.head_dim != self.intermediate_size:
            raise ValueError(
                f"Mamba2 mixer: num_heads ({self.num_heads}) * head_dim ({self.head_dim}) must equal the "
                f"intermediate size ({self.intermediate_size})"
            )
        if self.num_heads % self.n_groups:
            raise ValueError(f"Mamba2 mixer: num_heads={self.num_heads} is not a multiple of n_groups={self.n_groups}")
        if self.conv_kernel < 2:
            raise ValueError(f"Mamba2 mixer: conv_kernel must be >= 2, got {self.conv_kernel}")
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"Mamba2 mixer: activation {self.activation!r} is not supported (supported: silu)")

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @classmethod
    def from_mamba_prefixed(cls, c: Any, intermediate_size: int | None = None) -> Mamba2MixerArgs:
        """From a hybrid's config that names its mixer fields `mamba_*` (Bamba, GraniteMoeHybrid,
        FalconH1); `intermediate_size` overrides `mamba_expand * hidden_size`."""
        return cls(
            hidden_size=c.hidden_size,
            intermediate_size=intermediate_size if intermediate_size is not None else int(c.mamba_expand * c.hidden_size),
            num_heads=c.mamba_n_heads,
            head_dim=c.mamba_d_head,
            state_size=c.mamba_d_state,
            n_groups=c.mamba_n_groups,
            conv_kernel=c.mamba_d_conv,
            chunk_size=c.mamba_chunk_size,
            use_conv_bias=bool(c.mamba_conv_bias),
            use_bias=bool(c.mamba_proj_bias),
            norm_eps=c.rms_norm_eps,
            activation=getattr(c, "hidden_act", "silu"),
            time_step_limit=parse_time_step_limit(getattr(c, "time_step_limit", None)),
        )

    @property
    def conv_state_shape(self) -> tuple[int, int]:  # per slot
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:  # per slot
        return (self.num_heads, self.head_dim, self.state_size)


class MambaMixer2(RecurrentLayer, ShardedWeights):
    def __init__(self, args: Mamba2MixerArgs, layer_idx: int) -> None:
        super().__init__()
        # Under tensor parallelism this rank's heads (and groups): `self.args` holds its sizes, so
        # the state spec and the forward see only them (mamba/parallel.py); all of them otherwise.
        shards = mixer_shards(args.num_heads, args.n_groups)
        self.shards = shards  # a subclass replacing a layer builds it for the same shards
        self.heads = shards.heads
        self.args = rank_args(args, shards)
        self.layer_idx = layer_idx
        a = self.args
        self.in_proj = parallel_in_proj(args, shards)
        # Holds the depthwise taps under the checkpoint's names; the forward uses the kernels.
        self.conv1d = parallel_conv1d(args, shards)
        self.dt_bias = nn.Parameter(torch.empty(a.num_heads))
        self.A_log = nn.Parameter(torch.empty(a.num_heads))
        self.D = nn.Parameter(torch.empty(a.num_heads))
        self.norm = parallel_gated_norm(args, shards)
        self.out_proj = row_linear(args.intermediate_size, args.hidden_size, bias=args.use_bias)
        # Per-slot pools, bound by RecurrentHybridModelState.initialize_cache (bind_state).
        self.conv_state: torch.Tensor | None = None  # [max_num_seqs, conv_dim, conv_kernel - 1]
        self.ssm_state: torch.Tensor | None = None  # [max_num_seqs, num_heads, head_dim, state_size] float32

    def load_full(self, param_name: str, tensor: torch.Tensor) -> None:
        """dt_bias, A_log, D: one value per head, this rank's heads kept."""
        param = getattr(self, param_name)
        with torch.no_grad():
            param.copy_(self.heads.narrow(tensor, 0))

    def state_spec(self) -> RecurrentStateSpec:
        # The SSM state accumulates over the whole sequence: float32 whatever the model dtype
        # (the conv window holds raw inputs, so the model dtype loses nothing there).
        conv = StateTensorSpec("conv_state", self.args.conv_state_shape)
        ssm = StateTensorSpec("ssm_state", self.args.ssm_state_shape, torch.float32)
        return RecurrentStateSpec("mamba2", (conv, ssm))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> same
        meta = get_forward_context().family_attn
        assert isinstance(meta, RecurrentMetadata), (
            f"Mamba layer {self.layer_idx}: the forward context carries {type(meta).__name__}, not RecurrentMetadata "
            "(is the model served by RecurrentHybridModelState?)"
        )
        self.bound_states()
        a = self.args
        z, xbc, dt = self.in_proj(hidden).split([a.intermediate_size, a.conv_dim, a.num_heads], dim=-1)
        y = torch.empty(hidden.shape[0], a.num_heads, a.head_dim, dtype=hidden.dtype, device=hidden.device)
        if meta.num_decodes:
            self._scan(xbc, dt, meta.decode_token_idx, meta.decode_state_indices, y, decode=True, meta=meta)
        self.run_draft_steps(
            meta.draft_steps, lambda idx, slots: self._scan(xbc, dt, idx, slots, y, decode=True, meta=meta)
        )
        if meta.num_prefills:
            self._scan(xbc, dt, meta.prefill_token_idx, meta.prefill_state_indices, y, decode=False, meta=meta)
        return self.out_proj(self.norm(y.view(hidden.shape[0], -1), z))

    def _scan(
        self,
        xbc: torch.Tensor,  # [num_tokens, conv_dim]
        dt: torch.Tensor,  # [num_tokens, num_heads]
        token_idx: torch.Tensor | None,  # the rows' tokens; None: all of them, in order
        slots: torch.Tensor,  # [rows] int64, slot of each row
        y: torch.Tensor,  # [num_tokens, num_heads, head_dim], written at token_idx
        decode: bool,
        meta: RecurrentMetadata,
    ) -> None:
        a = self.args
        if token_idx is not None:
            xbc, dt = xbc.index_select(0, token_idx), dt.index_select(0, token_idx)
        weight = self.conv1d.weight.view(a.conv_dim, a.conv_kernel)
        A = -torch.exp(self.A_log.float())
        if decode:
            xbc = causal_conv1d_update(xbc, weight, self.conv1d.bias, self.conv_state, slots, a.activation)
        else:
            xbc = causal_conv1d_varlen(
                xbc, weight, self.conv1d.bias, self.conv_state, meta.prefill_query_start_loc, slots,
                meta.prefill_has_initial_state, a.activation,
            )  # fmt: skip
        group = a.n_groups * a.state_size
        x, B, C = xbc.split([a.intermediate_size, group, group], dim=-1)
        x = x.view(-1, a.num_heads, a.head_dim)
        B = B.view(-1, a.n_groups, a.state_size)
        C = C.view(-1, a.n_groups, a.state_size)
        common = dict(D=self.D, dt_bias=self.dt_bias, dt_softplus=True, dt_limit=a.time_step_limit)
        if decode:
            out = selective_state_update(self.ssm_state, x, dt, A, B, C, slots, **common)
        else:
            out = ssd_chunk_scan_varlen(
                x, dt, A, B, C, a.chunk_size, self.ssm_state, meta.prefill_query_start_loc, slots,
                meta.prefill_has_initial_state, **common,
            )  # fmt: skip
        if token_idx is None:
            y.copy_(out)
        else:
            y.index_copy_(0, token_idx, out)
