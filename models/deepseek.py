"""DeepseekV2ForCausalLM and DeepseekV3ForCausalLM: multi-head latent attention + DeepSeekMoE.

One implementation; V2 and V3 differ in data only.

Attention (`DeepseekAttention`): q from `q_proj`, or through a low-rank `q_a_proj` ->
`q_a_layernorm` -> `q_b_proj` when `q_lora_rank` is set; `kv_a_proj_with_mqa` gives the latent
(then `kv_a_layernorm`) and one rope key shared by the heads; `MLAAttention`
(models/layers/mla_attention.py) caches latent + rope key and expands or absorbs through
`kv_b_proj`. The softmax scale is qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under
YaRN; YaRN's cos/sin factor is mscale(factor, mscale) / mscale(factor, mscale_all_dim) (both as
transformers computes them, `RopeConfig`). DeepSeek rotates interleaved channel pairs (x0, x1),
(x2, x3), ... (V2 always; V3 when `rope_interleave`, its default): the loader reorders the rope
rows of q and of the rope key, evens then odds, which makes that rotation the neox one the
shared rotary kernel applies -- q.k is unchanged, as both sides are reordered alike.

MLP: layers below `first_k_dense_replace` are dense SwiGLU MLPs; the others are `SparseMoE`
with `n_shared_experts * moe_intermediate_size` of shared experts. V2 routes by softmax, top-k
without renormalisation, optionally `group_limited_greedy` (groups scored by their best
expert); V3 by sigmoid plus `e_score_correction_bias` for the choice, groups scored by their
two best, `norm_topk_prob`; both times `routed_scaling_factor`, router logits in float32.

Multi-token prediction layers (V3's `num_nextn_predict_layers`, stored as
`model.layers.{num_hidden_layers + k}.*`) are loaded into `mtp` when the checkpoint has them,
skipped when it does not; generation does not run them (no MTP speculator yet), but their
attention declares its latent cache like every layer, so the runner allocates it (one layer's
worth more per block) where an MTP draft would write.

Tensor parallelism splits attention by head (`DeepseekAttention`; the latent cache is whole on
every rank), holds n_routed_experts / N whole experts per rank with the router replicated
(`SparseMoE` under TP), and splits the shared experts and the dense layers' MLP by rows like
Llama's. An fp8 KV cache (kv_cache_dtype="fp8") keeps the latent and the rope key in float8
e4m3, half the bytes a decode step reads (models/layers/mla_decode.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from slotrunner.core_runner.cpu.packed import PackedWeight
from slotrunner.core_runner.distributed.shard import check_head_split, even_shard
from slotrunner.models.causal_lm import CausalLM, DecoderStack, StackNames
from slotrunner.models.layers.linear import Linear, VocabEmbedding
from slotrunner.models.layers.mla_attention import MLAAttention
from slotrunner.models.layers.moe import ExpertActivation, RouterSpec, SparseMoE, stack_per_expert
from slotrunner.models.layers.norm import RMSNorm
from slotrunner.models.layers.parallel_linear import column_linear, query_heads, row_linear
from slotrunner.models.layers.rotary import RopeConfig, RotaryEmbedding
from slotrunner.models.llama import LlamaArgs, LlamaMLP
from slotrunner.models.mixtral import MoeDecoderLayer
from slotrunner.models.weights import GATE_UP_SHARDS, WeightLoader


def _mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


@dataclass(frozen=True)
class MLAArgs:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    max_position: int
    rope: RopeConfig
    scale: float
    rope_interleave: bool

    @classmethod
    def from_hf(cls, c: object, rope_interleave: bool) -> MLAArgs:
        rope_dim = c.qk_rope_head_dim
        if getattr(c, "head_dim", None) != rope_dim:
            # YaRN's correction range is computed over head_dim channels; transformers' DeepSeek
            # configs set it to qk_rope_head_dim, and only that width is rotated.
            raise ValueError(f"DeepSeek config: head_dim {getattr(c, 'head_dim', None)} must equal qk_rope_head_dim {rope_dim}")
        rope = RopeConfig.from_hf(c)
        params = {**(getattr(c, "rope_scaling", None) or {}), **(getattr(c, "rope_parameters", None) or {})}
        scale = (c.qk_nope_head_dim + rope_dim) ** -0.5
        if params.get("rope_type", params.get("type", "default")) not in (None, "default") and params.get("mscale_all_dim"):
            scale *= _mscale(float(params["factor"]), float(params["mscale_all_dim"])) ** 2
        return cls(
            hidden_size=c.hidden_size,
            num_heads=c.num_attention_heads,
            q_lora_rank=c.q_lora_rank,
            kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=rope_dim,
            v_head_dim=c.v_head_dim,
            rms_norm_eps=c.rms_norm_eps,
            attention_bias=bool(getattr(c, "attention_bias", False)),
            max_position=c.max_position_embeddings,
            rope=rope,
            scale=scale,
            rope_interleave=rope_interleave,
        )


class DeepseekAttention(nn.Module):
    """Multi-head latent attention, split by head under tensor parallelism (as vLLM splits it):
    q_proj / q_b_proj and kv_b_proj are column-parallel (each rank's rows are its heads' rows),
    o_proj row-parallel; q_a_proj, kv_a_proj_with_mqa and their norms are replicated, so every
    rank computes the whole latent and rope key and caches them for its own heads."""

    def __init__(self, a: MLAArgs, layer_idx: int) -> None:
        super().__init__()
        self.a = a
        # MLA is MQA over the latent: one "KV head", which every rank keeps whole.
        self.num_local_heads = query_heads(a.num_heads, 1).size
        qk_head_dim = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank is None:
            self.q_proj = column_linear(a.hidden_size, a.num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(a.hidden_size, a.q_lora_rank, bias=a.attention_bias)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, a.rms_norm_eps)
            self.q_b_proj = column_linear(a.q_lora_rank, a.num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(a.hidden_size, a.kv_lora_rank + a.qk_rope_head_dim, bias=a.attention_bias)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, a.rms_norm_eps)
        self.kv_b_proj = column_linear(a.kv_lora_rank, a.num_heads * (a.qk_nope_head_dim + a.v_head_dim), bias=False)
        self.o_proj = row_linear(a.num_heads * a.v_head_dim, a.hidden_size, bias=a.attention_bias)
        self.rotary_emb = RotaryEmbedding(a.qk_rope_head_dim, a.max_position, a.rope)
        self.attn = MLAAttention(
            self.num_local_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank, a.scale, layer_idx
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        a = self.a
        q = self.q_proj(x) if a.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(q.shape[0], self.num_local_heads, -1)  # [num_tokens, local heads, nope + rope]
        q_nope, q_pe = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [num_tokens, rank], new: the norm reads the strided view
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        # kv_b_proj.weight: [local heads * (nope + v), rank], this rank's heads' W_UK / W_UV.
        o = self.attn(q_nope, q_pe, latent, k_pe.squeeze(1), self.kv_b_proj.weight)  # [num_tokens, local heads, v]
        return self.o_proj(o.flatten(1))


def _deinterleave(rows: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """The last `rope_dim` rows of each group along dim 1 (rows: [groups, width, ...]) reordered
    evens then odds: interleaved pairs become the neox halves (given row indices, the permutation)."""
    perm = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])
    rope = rows[:, rows.shape[1] - rope_dim :]
    return torch.cat([rows[:, : rows.shape[1] - rope_dim], rope[:, perm]], dim=1)


class DeepseekMTPLayer(nn.Module):
    """One multi-token-prediction module of a V3 checkpoint (`model.layers.{n + k}.*`): the next
    token's embedding and the main model's last hidden state, each normed (`enorm`, `hnorm`),
    joined by `eh_proj` into one decoder layer, then `shared_head` (norm, head)."""

    def __init__(self, args: LlamaArgs, layer: nn.Module, with_embedding: bool, with_head: bool) -> None:
        super().__init__()
        h = args.hidden_size
        self.embed_tokens = VocabEmbedding(args.vocab_size, h) if with_embedding else None
        self.enorm = RMSNorm(h, args.rms_norm_eps)
        self.hnorm = RMSNorm(h, args.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.layer = layer
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, args.rms_norm_eps)
        self.shared_head.head = Linear(h, args.vocab_size, bias=False) if with_head else None


class DeepseekV2ForCausalLM(CausalLM):
    merged = GATE_UP_SHARDS  # dense and shared-expert gate/up
    expert_names: ClassVar[dict[str, tuple[str, int]]] = {
        "gate_proj.weight": ("w_in", 0),
        "up_proj.weight": ("w_in", 1),
        "down_proj.weight": ("w_out", 0),
    }

    @classmethod
    def check_tensor_parallel(cls, hf_config: object, world_size: int) -> None:
        """ValueError when a layer cannot be split over `world_size` ranks (called before any
        rank is started): the attention heads, the routed experts (whole ones per rank), the
        shared experts' and the dense layers' MLP rows."""
        c = hf_config
        check_head_split(c.num_attention_heads, 1, world_size)  # one latent "KV head", on every rank
        even_shard(c.n_routed_experts, 0, world_size, "n_routed_experts")
        if c.n_shared_experts:
            shared = c.moe_intermediate_size * c.n_shared_experts
            even_shard(shared, 0, world_size, "moe_intermediate_size * n_shared_experts")
        if c.first_k_dense_replace:
            even_shard(c.intermediate_size, 0, world_size, "intermediate_size")

    def __init__(self, hf_config: object) -> None:
        c = hf_config
        args = LlamaArgs.from_hf(c)
        self.mla_args = MLAArgs.from_hf(c, self.rope_interleave(c))
        layers = (self.build_layer(c, args, i) for i in range(c.num_hidden_layers))
        norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        stack = DecoderStack(StackNames(), args.vocab_size, args.hidden_size, layers, norm, residual_in_norm=True)
        super().__init__(stack, args.tie_word_embeddings)
        self.hf_config = c
        self.args = args
        self.num_experts = c.n_routed_experts
        self.mtp: nn.ModuleList | None = None  # built by load_weights when the checkpoint has MTP layers

    @staticmethod
    def rope_interleave(c: object) -> bool:
        return True  # V2 rotates complex pairs

    def build_layer(self, c: object, args: LlamaArgs, layer_idx: int) -> nn.Module:
        return MoeDecoderLayer(args, DeepseekAttention(self.mla_args, layer_idx), self.build_mlp(c, args, layer_idx))

    def build_mlp(self, c: object, args: LlamaArgs, layer_idx: int) -> nn.Module:
        if layer_idx < (c.first_k_dense_replace or 0):
            return LlamaMLP(args)
        spec, correction_bias = self.router_spec(c)
        shared = None
        if c.n_shared_experts:
            shared = LlamaMLP(dataclasses.replace(args, intermediate_size=c.moe_intermediate_size * c.n_shared_experts))
        act = ExpertActivation(args.hidden_act)
        return SparseMoE(
            c.hidden_size, c.moe_intermediate_size, spec, act, shared, correction_bias=correction_bias, fp32_logits=True
        )

    def router_spec(self, c: object) -> tuple[RouterSpec, bool]:
        method = getattr(c, "topk_method", "greedy") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported (supported: greedy, group_limited_greedy)")
        grouped = method == "group_limited_greedy"
        spec = RouterSpec(
            c.n_routed_experts, c.num_experts_per_tok, "softmax", renormalize=False,
            n_group=(c.n_group or 1) if grouped else 1, topk_group=(c.topk_group or 1) if grouped else 1,
            routed_scaling_factor=float(c.routed_scaling_factor), group_scoring="max",
        )  # fmt: skip
        return spec, False

    # -- loading ------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        n = self.hf_config.num_hidden_layers
        mtp: dict[str, torch.Tensor] = {}

        def main() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in self._prepared(weights):
                m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
                if m and int(m.group(1)) >= n:
                    mtp[f"{int(m.group(1)) - n}.{m.group(2)}"] = tensor
                    continue
                yield name, tensor

        loaded = WeightLoader(self, merged=self.merged).load(main())
        if mtp:
            loaded |= {f"mtp.{name}" for name in self._load_mtp(mtp)}
        return loaded

    def _prepared(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors as the modules hold them: experts stacked, rope rows reordered."""

        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.replace(".mlp.experts.gate_up_proj", ".mlp.experts.w_in")
                yield name.replace(".mlp.experts.down_proj", ".mlp.experts.w_out"), tensor

        a = self.mla_args
        for name, tensor in stack_per_expert(renamed(), ".mlp.experts.", self.expert_names, self.num_experts):
            rows = None
            if a.rope_interleave and name.endswith((".q_proj.weight", ".q_b_proj.weight")):
                qk = a.qk_nope_head_dim + a.qk_rope_head_dim
                rows = _deinterleave(torch.arange(tensor.shape[0]).view(-1, qk), a.qk_rope_head_dim).flatten()
            elif a.rope_interleave and ".kv_a_proj_with_mqa." in name:
                rows = _deinterleave(torch.arange(tensor.shape[0]).unsqueeze(0), a.qk_rope_head_dim).flatten()
            if rows is not None:  # a row permutation, so a packed GGUF matrix stays packed
                tensor = tensor.select_rows(rows) if isinstance(tensor, PackedWeight) else tensor[rows]
            yield name, tensor

    def _load_mtp(self, tensors: dict[str, torch.Tensor]) -> set[str]:
        """Build the MTP layers the checkpoint holds (`{k}.*` names) and load them."""
        c, args = self.hf_config, self.args
        count = 1 + max(int(name.split(".", 1)[0]) for name in tensors)
        ref = self.stack.token_embedding.weight
        with torch.device(ref.device):
            layers = nn.ModuleList(
                DeepseekMTPLayer(
                    args,
                    self.build_layer(c, args, c.num_hidden_layers + k),
                    with_embedding=f"{k}.embed_tokens.weight" in tensors,
                    with_head=f"{k}.shared_head.head.weight" in tensors,
                )
                for k in range(count)
            )
        layers.to(ref.dtype).requires_grad_(False)
        # The decoder layer's tensors sit beside enorm/eh_proj in the file; here under `.layer`.
        own = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")
        renamed = ((k if k.split(".", 1)[1].startswith(own) else k.replace(".", ".layer.", 1), t) for k, t in tensors.items())
        holder = _MTPHolder(layers)
        loaded = WeightLoader(holder, merged=self.merged).load(renamed)
        self.mtp = layers
        return loaded


class _MTPHolder(nn.Module):
    """Names the MTP layers as the checkpoint does (`{k}.*`) for one WeightLoader pass."""

    def __init__(self, layers: nn.ModuleList) -> None:
        super().__init__()
        for k, layer in enumerate(layers):
            self.add_module(str(k), layer)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @staticmethod
    def rope_interleave(c: object) -> bool:
        return bool(getattr(c, "rope_interleave", True))

    def router_spec(self, c: object) -> tuple[RouterSpec, bool]:
        spec = RouterSpec(
            c.n_routed_experts, c.num_experts_per_tok, "sigmoid", renormalize=bool(c.norm_topk_prob),
            n_group=c.n_group or 1, topk_group=c.topk_group or 1, routed_scaling_factor=float(c.routed_scaling_factor),
        )  # fmt: skip
        return spec, True
