"""Qwen3MoeForCausalLM: Mixtral's decoder with Qwen3's q/k RMSNorm and its own routing flags.

Layer i's MLP is a `SparseMoE` unless i is in `mlp_only_layers` or (i + 1) is not a multiple of
`decoder_sparse_step` (then a dense SwiGLU MLP of `intermediate_size`). The router takes the
softmax over all `num_experts` logits and the top `num_experts_per_tok`, renormalised only when
`norm_topk_prob` (Qwen3-30B-A3B sets it). Experts are SwiGLU MLPs of `moe_intermediate_size`.

Checkpoint names: `model.layers.{i}.mlp.gate.weight`, `.mlp.experts.{e}.gate_proj / up_proj /
down_proj.weight`; dense layers `.mlp.gate_proj / up_proj / down_proj.weight`.
"""

from __future__ import annotations

from torch import nn

from slotrunner.models.layers.moe import ExpertActivation, RouterSpec, SparseMoE
from slotrunner.models.llama import LlamaArgs, LlamaMLP
from slotrunner.models.mixtral import MixtralForCausalLM
from slotrunner.models.weights import GATE_UP_SHARDS, QKV_SHARDS


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    qk_norm = True
    merged = QKV_SHARDS | GATE_UP_SHARDS  # the dense layers' gate/up
    expert_names = {
        "gate_proj.weight": ("w_in", 0),
        "up_proj.weight": ("w_in", 1),
        "down_proj.weight": ("w_out", 0),
    }

    def build_mlp(self, c: object, args: LlamaArgs, layer_idx: int) -> nn.Module:
        sparse = (
            layer_idx not in (c.mlp_only_layers or ())
            and c.num_experts > 0
            and (layer_idx + 1) % c.decoder_sparse_step == 0
        )
        if not sparse:
            return LlamaMLP(args)
        spec = RouterSpec(c.num_experts, c.num_experts_per_tok, "softmax", renormalize=bool(c.norm_topk_prob))
        return SparseMoE(c.hidden_size, c.moe_intermediate_size, spec, ExpertActivation(args.hidden_act))
