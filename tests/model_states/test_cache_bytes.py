"""ModelState.cache_bytes predicts what initialize_cache allocates, and the KV cache is sized
from what is left.

Guards against: a family's state pools (recurrent conv/SSM state and its prefix-cache
checkpoints, cross-attention caches) taking memory the KV cache was already given -- an
out-of-memory error on a GPU at large max_num_seqs.
"""

from __future__ import annotations

import pytest
import torch

from slotrunner import LLM
from slotrunner.conformance import build_case
from slotrunner.registry import tiny_config
from slotrunner.builder import default_num_kv_blocks


def _allocated_state_bytes(state) -> int:
    tensors = list(getattr(state, "pools", []))
    tensors += [layer.cross_kv for layer in getattr(state, "cross_layers", [])]
    state_cache = getattr(state, "state_cache", None)  # recurrent-state checkpoints for prefix caching
    tensors += state_cache.entries if state_cache is not None else []
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@pytest.mark.parametrize("arch", ["BambaForCausalLM", "BartForConditionalGeneration", "LlamaForCausalLM"])
def test_cache_bytes_equal_what_initialize_cache_allocates(arch, tmp_path):
    build_case(tiny_config(arch), tmp_path)
    llm = LLM(str(tmp_path), device="cpu", max_model_len=64, max_num_seqs=5)
    state = llm.engine.runner.model_state
    predicted = state.cache_bytes(llm.config.dtype)
    assert predicted == _allocated_state_bytes(state)
    assert (predicted > 0) == (arch != "LlamaForCausalLM")
    if arch == "BambaForCausalLM":  # prefix caching on by default: one checkpoint per slot
        assert state.state_cache is not None and state.state_cache.num_entries == 5


def test_kv_budget_leaves_room_for_the_family_state(tiny_llama_dir):
    from slotrunner.core_runner.runner.kv_cache import kv_bytes_per_block
    from slotrunner.builder import _CPU_KV_CACHE_BYTES

    engine = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, max_num_seqs=4).engine
    model, config = engine.runner.model, engine.config  # block size 16, float32, CPU
    args = (config,)
    assert default_num_kv_blocks(model, *args) == 16  # 4 requests x 4 blocks: all of them fit
    per_block = kv_bytes_per_block(model, 16, torch.float32)
    # The family state takes all but 10 blocks' worth of the budget: 10 blocks are left.
    assert default_num_kv_blocks(model, *args, reserved_bytes=_CPU_KV_CACHE_BYTES - 10 * per_block) == 10
    with pytest.raises(ValueError, match="lower max_num_seqs or max_model_len"):
        default_num_kv_blocks(model, *args, reserved_bytes=_CPU_KV_CACHE_BYTES - 3 * per_block)  # < one request
