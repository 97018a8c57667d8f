"""Real-size checkpoints load with default arguments: max_num_seqs is lowered to what the
family's per-request state leaves room for, and the log says so.

Guards against: `LLM(real_whisper_dir)` raising "the KV cache cannot hold one request" because
256 requests' cross-attention caches (4.4 GiB for Whisper tiny) exceed the CPU cache budget;
a user's small max_num_seqs being changed; a decoder-only model (no family state) being capped.
"""

from __future__ import annotations

import logging

import pytest
import transformers

from slotrunner import LLM
from slotrunner.builder import _CPU_KV_CACHE_BYTES, _FAMILY_STATE_SHARE, max_num_seqs_within

# Real dimensions, random (dummy) weights: the sizes are what matters here.
REAL_SIZE = {
    "whisper-tiny": lambda: transformers.WhisperConfig(
        d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6, decoder_attention_heads=6,
        encoder_ffn_dim=1536, decoder_ffn_dim=1536, vocab_size=51864, architectures=["WhisperForConditionalGeneration"],
    ),
    "t5-small": lambda: transformers.T5Config(
        d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8, vocab_size=32128,
        architectures=["T5ForConditionalGeneration"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", REAL_SIZE)
def test_a_real_size_encoder_decoder_loads_with_defaults(name, tmp_path, caplog):
    REAL_SIZE[name]().save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="slotrunner.builder"):
        llm = LLM(str(tmp_path), device="cpu", load_format="dummy")
    config, state = llm.engine.config, llm.engine.runner.model_state
    assert 1 <= config.max_num_seqs < 256
    assert state.cache_bytes(config.dtype) <= _FAMILY_STATE_SHARE * _CPU_KV_CACHE_BYTES
    assert config.num_kv_blocks * config.block_size >= config.max_model_len  # the KV cache keeps the rest
    assert f"max_num_seqs lowered from 256 to {config.max_num_seqs}" in caplog.text


def test_max_num_seqs_within_the_state_share():
    gib = 2**30
    assert max_num_seqs_within(2 * gib, 256 * 18 * 2**20, 256) == 56  # 1 GiB / 18 MiB a request
    assert max_num_seqs_within(2 * gib, 4 * 18 * 2**20, 4) == 4  # a small request count is kept
    assert max_num_seqs_within(2 * gib, 0, 256) == 256  # no family state: nothing to fit
    assert max_num_seqs_within(2 * gib, 8 * gib, 1) == 1  # never 0: the KV sizing then explains


def test_a_decoder_only_model_keeps_max_num_seqs(tiny_llama_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="slotrunner.builder"):
        llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64)
    assert llm.engine.config.max_num_seqs == 256 and "lowered" not in caplog.text


def test_state_checkpoints_take_what_the_family_share_leaves(tmp_path, caplog):
    """Recurrent hybrids' prefix-cache checkpoints (one slot's state each) default to one per
    slot, fewer where the family's share of the budget left after the per-request pools holds
    fewer: they never lower max_num_seqs, and the log says so."""
    from slotrunner.builder import state_checkpoints_within
    from slotrunner.conformance import build_case
    from slotrunner.registry import tiny_config

    assert state_checkpoints_within(1000, 300, 10, 256) == 20  # 500 - 300 left: 20 entries
    assert state_checkpoints_within(1000, 100, 10, 8) == 8
    assert state_checkpoints_within(1000, 500, 10, 8) == 1  # none fit: one, the KV sizing checks the rest
    build_case(tiny_config("BambaForCausalLM"), tmp_path)
    roomy = LLM(str(tmp_path), device="cpu", max_model_len=64, max_num_seqs=8).engine
    assert roomy.config.num_state_checkpoints == 8
    state = roomy.runner.model_state
    per_slot = sum(p[:, 0].numel() * p.element_size() for p in state.pools)
    pools = state.cache_bytes(roomy.config.dtype) - 8 * per_slot
    # A budget whose family share holds the pools and 3 checkpoints.
    budget = int((pools + 3.5 * per_slot) / _FAMILY_STATE_SHARE)
    with caplog.at_level(logging.WARNING, logger="slotrunner.builder"):
        tight = LLM(str(tmp_path), device="cpu", max_model_len=64, max_num_seqs=8, kv_cache_memory_bytes=budget).engine
    assert tight.config.max_num_seqs == 8 and tight.config.num_state_checkpoints == 3
    assert "3 recurrent-state checkpoints" in caplog.text


def test_kv_cache_groups_size_the_cache_in_block_ids_of_their_layers(tmp_path):
    """Guards against a grouped cache sized as if a block id held every layer (no memory gained)
    or only some layers' pages counted (more memory than the budget), and against an explicit
    num_kv_blocks too small for one request of max_model_len in the groups being accepted (the
    request would wait forever). Tiny Gemma 3: 3 sliding : 1 full layer, groups of one layer."""
    from slotrunner.conformance import build_case
    from slotrunner.registry import tiny_config

    build_case(tiny_config("Gemma3ForCausalLM"), tmp_path)
    args = dict(device="cpu", max_model_len=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    off = LLM(str(tmp_path), **args, num_kv_blocks=16, disable_hybrid_kv_cache_manager=True)
    all_layers = off.engine.runner.kv_layout.bytes_per_block(4, off.config.cache_dtype)  # 4 layers' pages
    budget = 100 * all_layers
    roomy = args | {"max_num_seqs": 64}  # the budget, not max_num_seqs requests' worth, decides
    off = LLM(str(tmp_path), **roomy, kv_cache_memory_bytes=budget, disable_hybrid_kv_cache_manager=True)
    on = LLM(str(tmp_path), **roomy, kv_cache_memory_bytes=budget)
    assert off.config.kv_cache_windows == (None,) and on.config.kv_cache_windows == (None, 6, 6, 6)
    assert off.config.num_kv_blocks == 100 and on.config.num_kv_blocks == 400, "a grouped block id is one layer's page"
    assert sum(c.numel() * c.element_size() for c in on.engine.runner.kv_caches) == budget
    needed = on.config.blocks_per_request
    # The full group all 16 blocks; each sliding group its window and an 8-token chunk,
    # ceil((6 - 1 + 8) / 4) + 1 = 5 blocks; and NULL_BLOCK.
    assert needed == 16 + 3 * 5 + 1
    with pytest.raises(ValueError, match=f"needs {needed} blocks in 4 KV-cache groups"):
        LLM(str(tmp_path), **args, num_kv_blocks=needed - 1)
    assert LLM(str(tmp_path), **args, num_kv_blocks=needed).config.num_kv_blocks == needed
