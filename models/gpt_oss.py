"""GptOssForCausalLM: Mixtral's decoder with attention sinks, biased projections and a clamped
SwiGLU in its experts.

Attention: q/k/v/o with biases, YaRN RoPE, `layer_types` alternating sliding-window and full
layers, and one learned sink logit per head (`self_attn.sinks`) that joins every query's
softmax as a key with a zero value (the backends' `sinks`). MoE: a router with a bias, top
`num_experts_per_tok` logits softmaxed (= softmax, top-k, renormalise), experts with biases
whose activation is (up + 1) * gate * sigmoid(swiglu_alpha * gate), gate clamped to <=
`swiglu_limit` and up to [-swiglu_limit, swiglu_limit].

Checkpoint names (bf16 checkpoints; MXFP4-quantized experts are refused): `mlp.router.weight /
bias`; `mlp.experts.gate_up_proj` [experts, hidden, 2 * inter] with gate and up *interleaved*
along the last dim and `gate_up_proj_bias` [experts, 2 * inter] likewise; `mlp.experts.down_proj`
[experts, inter, hidden], `down_proj_bias` [experts, hidden]. The loader transposes to
[out, in] and de-interleaves to [gate | up]. GGUF files (`decoder_gguf.py`) come expert by
expert instead, as `mlp.experts.{e}.gate_proj / up_proj / down_proj` `.weight` [out, in] and
`.bias`, which are stacked here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from slotrunner.models.causal_lm import CausalLM
from slotrunner.models.layers.moe import ExpertActivation, RouterSpec, SparseMoE, stack_per_expert
from slotrunner.models.layers.parallel_linear import ShardedWeights, query_heads
from slotrunner.models.llama import LlamaArgs, LlamaAttention
from slotrunner.models.mixtral import MixtralForCausalLM


class GptOssAttention(LlamaAttention, ShardedWeights):
    """Llama's attention (biases on) plus one sink logit per query head (under tensor
    parallelism, per query head of this rank: `load_full` keeps those of the checkpoint's)."""

    def __init__(self, args: LlamaArgs, layer_idx: int) -> None:
        super().__init__(args, layer_idx)
        self.heads = query_heads(args.num_heads, args.num_kv_heads)
        self.sinks = nn.Parameter(torch.empty(self.heads.size))

    def load_full(self, param_name: str, tensor: torch.Tensor) -> None:
        if param_name != "sinks":  # the only parameter of its own; the others live in its layers
            raise ValueError(f"unexpected parameter {param_name!r} of GptOssAttention")
        with torch.no_grad():
            self.sinks.copy_(self.heads.narrow(tensor, 0))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, sinks=self.sinks, rotate=self.rotation(positions)))


def _deinterleave(t: torch.Tensor) -> torch.Tensor:  # [..., 2 * inter] (g0 u0 g1 u1 ...) -> [gate | up]
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


class GptOssForCausalLM(MixtralForCausalLM):
    # per-expert names (GGUF files): parameter, and slot in the gated w_in / b_in (gate, then up)
    expert_names: ClassVar[dict[str, tuple[str, int]]] = {
        "gate_proj.weight": ("w_in", 0), "up_proj.weight": ("w_in", 1), "down_proj.weight": ("w_out", 0),
        "gate_proj.bias": ("b_in", 0), "up_proj.bias": ("b_in", 1), "down_proj.bias": ("b_out", 0),
    }  # fmt: skip

    def __init__(self, hf_config: object) -> None:
        quant = getattr(hf_config, "quantization_config", None)
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
            raise ValueError(f"GptOss: quantized checkpoints ({method}) are not supported; use a bf16 checkpoint")
        super().__init__(hf_config)

    def build_attention(self, args: LlamaArgs, layer_idx: int) -> nn.Module:
        return GptOssAttention(args, layer_idx)

    def build_mlp(self, c: object, args: LlamaArgs, layer_idx: int) -> nn.Module:
        spec = RouterSpec(c.num_local_experts, c.num_experts_per_tok, "softmax", renormalize=True)
        # transformers before 5.2x hard-codes the alpha (1.702) and has no swiglu_alpha field
        alpha, limit = getattr(c, "swiglu_alpha", 1.702), getattr(c, "swiglu_limit", 7.0)
        act = ExpertActivation("silu", swiglu_limit=float(limit), swiglu_alpha=float(alpha))
        return SparseMoE(c.hidden_size, c.intermediate_size, spec, act, router_bias=True, expert_bias=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                head, _, leaf = name.rpartition(".mlp.")
                if leaf.startswith("router."):
                    name, tensor = f"{head}.mlp.gate.{leaf[len('router.'):]}", tensor
                elif leaf == "experts.gate_up_proj":  # [E, hidden, 2I] -> [E, 2I, hidden]
                    name, tensor = f"{head}.mlp.experts.w_in", _deinterleave(tensor).transpose(1, 2)
                elif leaf == "experts.gate_up_proj_bias":
                    name, tensor = f"{head}.mlp.experts.b_in", _deinterleave(tensor)
                elif leaf == "experts.down_proj":  # [E, I, hidden] -> [E, hidden, I]
                    name, tensor = f"{head}.mlp.experts.w_out", tensor.transpose(1, 2)
                elif leaf == "experts.down_proj_bias":
                    name = f"{head}.mlp.experts.b_out"
                yield name, tensor

        return CausalLM.load_weights(self, stack_per_expert(renamed(), ".mlp.experts.", self.expert_names, self.num_experts))
