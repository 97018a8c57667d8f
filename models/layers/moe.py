"""Mixture-of-experts layers any model builds from: the router, the routed experts, the block.

- `RouterSpec` + `select_experts` (moe_router.py, beside `route()`, their one-launch kernel):
  which `top_k` experts each token goes to, with what weights.
  Scores are the softmax (Mixtral, Qwen3-MoE, GraniteMoE, GPT-OSS) or the sigmoid (DeepSeek-V3,
  NemotronH) of the router logits; experts are chosen on the scores plus an optional
  correction bias (`e_score_correction_bias`: it steers the choice, never the weights),
  optionally only within the best `topk_group` of `n_group` expert groups (DeepSeek-V3: a
  group scores the sum of its two best; DeepSeek-V2's `group_limited_greedy`: its best); the
  chosen scores are optionally renormalised to sum to 1 (`norm_topk_prob`) and times
  `routed_scaling_factor`.
- `TopKRouter`: the gate's linear (checkpoint `gate.weight`, GPT-OSS's `bias`) + the selection,
  one `route()` launch on a GPU.
- `FusedExperts`: the experts' stacked weights -- `w_in` [num_experts, (2 if gated) *
  intermediate, hidden] (gate rows first, then up) and `w_out` [num_experts, hidden,
  intermediate] -- run by `fused_moe` (fused_moe.py: two grouped GEMMs on a GPU, a per-expert
  loop on CPU).
- `ExpertParallelExperts`: under tensor parallelism, a rank's share of the experts, whole
  (`fused_experts` picks it, or `FusedExperts` at tensor_parallel_size 1).
- `SparseMoE`: gate -> experts, plus shared experts every token passes through.
- `stack_per_expert`: checkpoints that store the experts one by one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from slotrunner.core_runner.cpu.packed import PackedWeight
from slotrunner.core_runner.distributed.parallel_state import TensorParallelGroup, current_tp
from slotrunner.core_runner.distributed.shard import even_shard
from slotrunner.models.layers.fused_moe import ExpertActivation, fused_moe
from slotrunner.models.layers.moe_router import RouterSpec, route
from slotrunner.models.layers.parallel_linear import ShardedWeights


class TopKRouter(nn.Module):
    """logits = x @ weight.T (+ bias), then `select_experts` (both in one launch: `route`). Parameters are named as the
    checkpoints name them: `weight` [num_experts, hidden], `bias` [num_experts] (GPT-OSS),
    `e_score_correction_bias` [num_experts] (DeepSeek-V3, NemotronH)."""

    def __init__(
        self,
        hidden_size: int,
        spec: RouterSpec,
        bias: bool = False,
        correction_bias: bool = False,
        fp32_logits: bool = False,  # logits from float32 copies of x and weight (DeepSeek-V3, NemotronH)
    ) -> None:
        super().__init__()
        self.spec = spec
        self.fp32_logits = fp32_logits
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(spec.num_experts)) if bias else None
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(spec.num_experts), requires_grad=False) if correction_bias else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x [num_tokens, hidden]
        return route(x, self.weight, self.spec, self.bias, self.e_score_correction_bias, self.fp32_logits)


class FusedExperts(nn.Module):
    """`num_experts` MLPs, gated (down(act(gate(x)) * up(x))) or plain (down(act(up(x)))), as
    stacked weights; biases optional (GPT-OSS)."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, act: ExpertActivation, bias: bool = False
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.act = act
        n_in = (2 if act.gated else 1) * intermediate_size
        self.w_in = nn.Parameter(torch.empty(num_experts, n_in, hidden_size))
        self.w_out = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.b_in = nn.Parameter(torch.zeros(num_experts, n_in)) if bias else None
        self.b_out = nn.Parameter(torch.zeros(num_experts, hidden_size)) if bias else None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
        topk_ids: torch.Tensor,  # [num_tokens, top_k]
        add: torch.Tensor | None = None,  # [num_tokens, hidden]: added to the sum (shared experts)
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return fused_moe(x, self.w_in, self.w_out, topk_weights, topk_ids, self.act, self.b_in, self.b_out, add=add)


class ExpertParallelExperts(FusedExperts, ShardedWeights):
    """Tensor parallelism for a MoE layer: this rank holds num_experts / world_size whole
    experts (the router stays replicated). It computes the (token, expert) pairs routed to its
    experts and an all-reduce adds the ranks' partial sums, so the output is whole on every rank.
    Pairs routed elsewhere keep their shape (graph-safe, no host sync): they go to the rank's
    first expert with weight 0, which costs their compute there."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, act: ExpertActivation, bias: bool,
        tp: TensorParallelGroup,
    ) -> None:  # fmt: skip
        self.own = even_shard(num_experts, tp.rank, tp.world_size, "num_experts")
        super().__init__(self.own.size, hidden_size, intermediate_size, act, bias)
        self.tp = tp

    def load_full(self, param_name: str, tensor: torch.Tensor | PackedWeight) -> None:
        if isinstance(tensor, PackedWeight):
            tensor = tensor.dequantize()
        part = self.own.narrow(tensor, 0)  # [local experts, ...]
        param = getattr(self, param_name)
        if tuple(part.shape) != tuple(param.shape):
            raise ValueError(f"rank's experts have shape {tuple(part.shape)}, expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(part)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
        topk_ids: torch.Tensor,  # [num_tokens, top_k] global expert ids
        add: torch.Tensor | None = None,  # [num_tokens, hidden], whole: added after the all-reduce
    ) -> torch.Tensor:  # [num_tokens, hidden], summed over every rank's experts
        local_ids = topk_ids - self.own.start
        mine = (local_ids >= 0) & (local_ids < self.own.size)
        weights = torch.where(mine, topk_weights, torch.zeros_like(topk_weights))
        out = fused_moe(x, self.w_in, self.w_out, weights, local_ids.masked_fill(~mine, 0), self.act, self.b_in, self.b_out)
        out = self.tp.all_reduce(out)
        return out if add is None else out + add


def fused_experts(
    num_experts: int, hidden_size: int, intermediate_size: int, act: ExpertActivation, bias: bool = False
) -> FusedExperts:
    """All the experts at tensor_parallel_size 1; this rank's share of them above."""
    tp = current_tp()
    if tp.world_size == 1:
        return FusedExperts(num_experts, hidden_size, intermediate_size, act, bias)
    return ExpertParallelExperts(num_experts, hidden_size, intermediate_size, act, bias, tp)


class SparseMoE(nn.Module):
    """The MoE block: `gate` routes each token to its experts, `experts` computes their
    weighted sum, `shared_experts` (any module, e.g. an MLP) adds what every token gets."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,  # per expert
        spec: RouterSpec,
        act: ExpertActivation,
        shared_experts: nn.Module | None = None,
        router_bias: bool = False,
        correction_bias: bool = False,
        fp32_logits: bool = False,
        expert_bias: bool = False,
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden_size, spec, router_bias, correction_bias, fp32_logits)
        self.experts = fused_experts(spec.num_experts, hidden_size, intermediate_size, act, expert_bias)
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> [num_tokens, hidden]
        topk_weights, topk_ids = self.gate(x)
        shared = None if self.shared_experts is None else self.shared_experts(x)
        return self.experts(x, topk_weights, topk_ids, add=shared)  # the add in the experts' last launch


def stack_per_expert(
    weights: Iterable[tuple[str, torch.Tensor]],
    experts_prefix: str,  # e.g. ".mixer.experts."
    names: dict[str, tuple[str, int]],  # "up_proj.weight" -> ("w_in", 0): param, and slot in a gated w_in
    num_experts: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoints that store experts one by one (`...experts.{e}.up_proj.weight`): pass every
    other tensor through, and yield each stacked parameter as soon as all its experts are read
    (so one layer's experts at a time are held, not the model's). A layer whose experts are
    incomplete raises, naming what is missing."""
    num_parts = {param: 1 + max(p for (p_name, p) in names.values() if p_name == param) for param, _ in names.values()}
    pending: dict[tuple[str, str], dict[tuple[int, int], torch.Tensor]] = {}
    for name, tensor in weights:
        head, sep, tail = name.partition(experts_prefix)
        expert, _, leaf = tail.partition(".")
        if not sep or not expert.isdigit() or leaf not in names:
            yield name, tensor
            continue
        param, part = names[leaf]
        if int(expert) >= num_experts:
            raise ValueError(f"checkpoint tensor {name!r}: expert {expert} of a model with {num_experts} experts")
        key = (head + experts_prefix, param)
        parts = pending.setdefault(key, {})
        parts[(int(expert), part)] = tensor
        if len(parts) == num_experts * num_parts[param]:
            del pending[key]
            yield key[0] + param, torch.stack(
                [torch.cat([parts[(e, p)] for p in range(num_parts[param])], dim=0) for e in range(num_experts)]
            )
    for (prefix, param), parts in pending.items():
        missing = [(e, p) for e in range(num_experts) for p in range(num_parts[param]) if (e, p) not in parts]
        raise ValueError(f"{prefix}: checkpoint lacks expert tensors (expert, part) {missing[:5]} of {param!r}")
