"""Qwen3-Next / Qwen3.5 model construction and loading, beyond what conformance compares.

Guards against: configs the model cannot serve accepted silently (a layer type it does not
know, value heads that are not a multiple of key heads), Qwen3-Next's fused projections read as
Qwen3.5's four (or the reverse), and real checkpoints refused for their multi-token-prediction
heads (`mtp.*`), which transformers ignores too; and the Triton kernels, interpreted on CPU,
wired into the model wrong (strides of the conv output's q/k/v views, a prefill chunk that does
not continue from the state its previous chunk left).
"""

from __future__ import annotations

import pytest
import torch

from slotrunner.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
from slotrunner.registry import tiny_config


def test_unknown_layer_type_is_refused():
    config = tiny_config("Qwen3_5ForCausalLM")
    config.layer_types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer_types"):
        Qwen3_5ForCausalLM(config)


def test_value_heads_must_be_a_multiple_of_key_heads():
    config = tiny_config("Qwen3NextForCausalLM")
    config.linear_num_value_heads = 3
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        Qwen3NextForCausalLM(config)


def test_projections_follow_the_architecture():
    nxt = Qwen3NextForCausalLM(tiny_config("Qwen3NextForCausalLM")).model.layers[0].linear_attn
    q35 = Qwen3_5MoeForCausalLM(tiny_config("Qwen3_5MoeForCausalLM")).model.layers[0].linear_attn
    assert hasattr(nxt, "in_proj_qkvz") and hasattr(nxt, "in_proj_ba") and not hasattr(nxt, "in_proj_qkv")
    assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"} <= set(dict(q35.named_children()))


def test_mtp_heads_in_the_checkpoint_are_skipped():
    import transformers

    config = tiny_config("Qwen3_5MoeForCausalLM")
    torch.manual_seed(0)
    checkpoint = list(transformers.Qwen3_5MoeForCausalLM(config).state_dict().items())  # stacked experts
    model = Qwen3_5MoeForCausalLM(config)
    loaded = model.load_weights(checkpoint + [("mtp.fc.weight", torch.zeros(4, 4))])
    assert not any(name.startswith("mtp.") for name in loaded)
    with pytest.raises(ValueError, match="bogus"):  # only the MTP heads are skipped
        Qwen3_5MoeForCausalLM(config).load_weights(checkpoint + [("model.bogus.weight", torch.zeros(1))])


def _check_interpreted_model():
    """Every kernel interpreted (the delta rule's chunked and one-step kernels, the short conv,
    attention, MoE, rotary, norms, input preparation) against transformers' logits, for two
    requests batched with chunked prefill: one request's decode rows run beside the other's
    prefill chunks, which end inside a delta-rule chunk (CHUNK = 16) and continue from it."""
    import sys
    import tempfile
    from pathlib import Path

    from slotrunner import LLM
    from slotrunner.conformance import compare_logits, tiny_case
    from slotrunner.conformance_recorder import greedy_params, run_batch
    from slotrunner.core_runner.triton_utils import use_triton

    assert use_triton(torch.device("cpu")), "the interpreter switch did not take"
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "conformance"))
    from test_gated_delta_net import with_long_memory

    with tempfile.TemporaryDirectory() as d:
        hf = with_long_memory(tiny_case("Qwen3NextForCausalLM", Path(d))).oracle.hf_model
        llm = LLM(d, device="cpu", max_model_len=64, max_num_seqs=2, block_size=4, max_num_batched_tokens=7,
                  enable_prefix_caching=False)  # fmt: skip
        prompts = [[5, 17, 300], [(13 * i) % 900 + 4 for i in range(19)]]
        runs = run_batch(llm, [{"prompt_token_ids": p} for p in prompts], [greedy_params(4)] * 2)
        for prompt, run in zip(prompts, runs):
            ids = prompt + run.output_token_ids[:-1]
            with torch.no_grad():
                ref = hf(input_ids=torch.tensor([ids])).logits[0].float()
            result = compare_logits("interpreted", run.logits.float(), ref)
            assert result.passed, result.detail


def test_interpreted_kernels_match_transformers(run_interpreted):
    run_interpreted(_check_interpreted_model)
