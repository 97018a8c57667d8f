"""Which in-tree architectures run tensor-parallel, and that each refuses shapes it cannot split.

Guards against: a model class inheriting `check_tensor_parallel` from a parent whose layers it
does not share (it would run tensor_parallel_size > 1 with layers built unsplit or half split),
docs/architecture.md's table drifting from the code, and a check that passes head, expert or
MLP counts the layers cannot divide.
"""

from __future__ import annotations

import pytest

from slotrunner.registry import _import, tiny_config
from slotrunner.registry.table import IN_TREE

# docs/architecture.md, "Tensor parallelism": the architectures whose layers are split by rank.
SUPPORTED = {
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
    "LlavaForConditionalGeneration", "Qwen2VLForConditionalGeneration", "Qwen2AudioForConditionalGeneration",
    "Mamba2ForCausalLM", "BambaForCausalLM", "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM", "FalconH1ForCausalLM",
    "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
    "BartForConditionalGeneration", "WhisperForConditionalGeneration", "T5ForConditionalGeneration",
}  # fmt: skip


def test_exactly_the_documented_architectures_opt_in():
    opted_in = {a for a, e in IN_TREE.items() if getattr(_import(e.model, a), "check_tensor_parallel", None) is not None}
    assert opted_in == SUPPORTED


@pytest.mark.parametrize("architecture", sorted(SUPPORTED))
def test_two_ranks_fit_the_tiny_configs(architecture):
    _import(IN_TREE[architecture].model, architecture).check_tensor_parallel(tiny_config(architecture), 2)


@pytest.mark.parametrize(
    "architecture, overrides, size, message",
    [("LlamaForCausalLM", {"intermediate_size": 129}, 2, "intermediate_size=129 is not divisible"),
     ("Gemma3ForCausalLM", {}, 3, "num_attention_heads=4 is not divisible by tensor_parallel_size=3"),
     ("Gemma3ForCausalLM", {"intermediate_size": 130}, 4, "intermediate_size=130 is not divisible"),
     ("Qwen3MoeForCausalLM", {"num_experts": 5}, 2, "num_experts=5 is not divisible"),
     ("DeepseekV2ForCausalLM", {}, 3, "num_attention_heads=4 is not divisible by tensor_parallel_size=3"),
     ("DeepseekV2ForCausalLM", {"intermediate_size": 129}, 2, "intermediate_size=129 is not divisible"),
     ("DeepseekV3ForCausalLM", {"n_routed_experts": 18}, 4, "n_routed_experts=18 is not divisible"),
     ("DeepseekV3ForCausalLM", {"moe_intermediate_size": 9}, 2, r"moe_intermediate_size \* n_shared_experts=9 is not"),
     ("LlavaForConditionalGeneration", {}, 3, "num_attention_heads=4 is not divisible by tensor_parallel_size=3"),
     ("Mamba2ForCausalLM", {"n_groups": 2}, 4, "mamba n_groups=2 must be 1 .* or divisible by tensor_parallel_size=4"),
     ("BambaForCausalLM", {}, 3, "num_attention_heads=4 is not divisible by tensor_parallel_size=3"),
     ("Qwen3_5ForCausalLM", {}, 3, "num_attention_heads=4 is not divisible by tensor_parallel_size=3"),
     ("Qwen3NextForCausalLM", {"linear_num_key_heads": 1}, 2, "linear_num_key_heads=1 is not divisible"),
     ("Qwen3_5MoeForCausalLM", {"linear_num_value_heads": 6, "linear_num_key_heads": 6}, 4,
      "linear_num_key_heads=6 is not divisible by tensor_parallel_size=4"),
     ("Qwen3_5MoeForCausalLM", {"num_experts": 5}, 2, "num_experts=5 is not divisible"),
     ("Qwen3NextForCausalLM", {"shared_expert_intermediate_size": 49}, 2, "shared_expert_intermediate_size=49 is not"),
     ("WhisperForConditionalGeneration", {}, 3, "decoder_attention_heads=4 is not divisible by tensor_parallel_size=3")],
)  # fmt: skip
def test_shapes_that_do_not_split_are_refused(architecture, overrides, size, message):
    with pytest.raises(ValueError, match=message):
        _import(IN_TREE[architecture].model, architecture).check_tensor_parallel(tiny_config(architecture, **overrides), size)
