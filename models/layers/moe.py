"""Mixture-of-experts in plain torch: top-k routers and stacked expert weights.

Experts are held stacked -- `w_in` [num_experts, (2 if gated) * intermediate, hidden] (gate rows
first, then up) and `w_out` [num_experts, hidden, intermediate] -- and run one expert at a time
over the tokens routed to it. Correct first: a loop over the experts hit by this step (the
`unique().tolist()` is a host sync on GPU; a fused kernel is the later fast path).

Routers return `(topk_weights [tokens, top_k] float32, topk_ids [tokens, top_k])`:
- `softmax_topk`: top-k of the logits, softmax over those k (Mixtral, GraniteMoE);
- `sigmoid_topk`: sigmoid scores, experts chosen on scores + correction bias (optionally within
  the best `topk_group` of `n_group` groups), weights from the uncorrected scores, optionally
  renormalised, times `routed_scaling_factor` (DeepSeek-V3, NemotronH).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from slotrunner.models.layers.hf_act import hf_activation


def softmax_topk(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = router_logits.float().topk(top_k, dim=-1)
    return torch.softmax(values, dim=-1), ids


def sigmoid_topk(
    router_logits: torch.Tensor,  # [tokens, num_experts]
    top_k: int,
    correction_bias: torch.Tensor | None = None,  # [num_experts]
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = router_logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group > 1:
        tokens, num_experts = choice.shape
        grouped = choice.view(tokens, n_group, num_experts // n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [tokens, n_group]
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
        choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(tokens, num_experts)
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


class StackedExperts(nn.Module):
    """`num_experts` MLPs: gated (down(act(gate(x)) * up(x))) or plain (down(act(up(x))))."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str, gated: bool) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gated = gated
        self.w_in = nn.Parameter(torch.empty(num_experts, (2 if gated else 1) * intermediate_size, hidden_size))
        self.w_out = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = hf_activation(act)

    def forward(
        self,
        x: torch.Tensor,  # [tokens, hidden]
        topk_weights: torch.Tensor,  # [tokens, top_k]
        topk_ids: torch.Tensor,  # [tokens, top_k]
    ) -> torch.Tensor:  # [tokens, hidden]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in torch.unique(topk_ids).tolist():
            token_idx, pos = torch.where(topk_ids == expert)
            h = F.linear(x[token_idx], self.w_in[expert])
            if self.gated:
                gate, up = h.chunk(2, dim=-1)
                h = self.act(gate) * up
            else:
                h = self.act(h)
            h = F.linear(h, self.w_out[expert])
            out.index_add_(0, token_idx, h.float() * topk_weights[token_idx, pos, None].float())
        return out.to(x.dtype)


def stack_per_expert(
    weights: Iterable[tuple[str, torch.Tensor]],
    experts_prefix: str,  # e.g. ".mixer.experts."
    names: dict[str, tuple[str, int]],  # "up_proj.weight" -> ("w_in", 0): param, and slot in a gated w_in
    num_experts: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoints that store experts one by one (`...experts.{e}.up_proj.weight`): pass every
    other tensor through, and yield each stacked parameter once all its experts are read. A
    layer whose experts are incomplete raises, naming what is missing."""
    pending: dict[tuple[str, str], dict[tuple[int, int], torch.Tensor]] = {}
    for name, tensor in weights:
        head, sep, tail = name.partition(experts_prefix)
        expert, _, leaf = tail.partition(".")
        if not sep or not expert.isdigit() or leaf not in names:
            yield name, tensor
            continue
        param, part = names[leaf]
        pending.setdefault((head + experts_prefix, param), {})[(int(expert), part)] = tensor
    for (prefix, param), parts in pending.items():
        num_parts = 1 + max(p for (p_name, p) in names.values() if p_name == param)
        missing = [(e, p) for e in range(num_experts) for p in range(num_parts) if (e, p) not in parts]
        if missing:
            raise ValueError(f"{prefix}: checkpoint lacks expert tensors (expert, part) {missing[:5]} of {param!r}")
        yield prefix + param, torch.stack(
            [torch.cat([parts[(e, p)] for p in range(num_parts)], dim=0) for e in range(num_experts)]
        )
