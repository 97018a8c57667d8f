"""RecurrentHybridModelState: pools sized from each recurrent layer's spec and bound to it,
reset per admitted slot.

Guards against: a re-admitted (preempted) or reused slot starting from the previous request's
state, pools bound to the wrong layers or shared between layers, attention layers of a hybrid
mistaken for recurrent layers, a state dtype other than declared, and a postprocess hook that
accepts rejections in a step without drafts (rollback itself: test_recurrent_rollback.py);
decode steps that a CUDA graph would replay (captured metadata, padded batches) advancing the
wrong slot's state.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slotrunner.core_runner.runner.model_state import CacheSpec
from slotrunner.model_states.recurrent_hybrid import RecurrentHybridModelState
from slotrunner.models.bamba import BambaForCausalLM
from slotrunner.models.llama import LlamaForCausalLM
from slotrunner.registry import tiny_config

MAX_NUM_SEQS = 3


def make_state(model: torch.nn.Module) -> RecurrentHybridModelState:
    # The ModelState reads only max_num_seqs and speculative_config from the engine config.
    config = SimpleNamespace(max_num_seqs=MAX_NUM_SEQS, speculative_config=None, num_state_checkpoints=0)
    state = RecurrentHybridModelState(config, model, torch.device("cpu"))
    state.initialize_cache(CacheSpec(8, 4, torch.float32, torch.device("cpu")))
    return state


def test_pools_bound_to_each_mamba_layer_only():
    model = BambaForCausalLM(tiny_config("BambaForCausalLM"))  # layers 1 and 3 are attention
    state = make_state(model)
    mixers = [layer.mamba for layer in model.model.layers if not layer.is_attention]
    assert state.layers == mixers and len(mixers) == 2
    assert len(state.pools) == 2  # one spec: a stacked conv pool and a stacked SSM pool
    for i, mixer in enumerate(mixers):
        a = mixer.args
        # A row per slot, and the scratch row padding rows of a replayed decode graph advance.
        assert mixer.conv_state.shape == (MAX_NUM_SEQS + 1, a.conv_dim, a.conv_kernel - 1)
        assert mixer.ssm_state.shape == (MAX_NUM_SEQS + 1, a.num_heads, a.head_dim, a.state_size)
        assert mixer.ssm_state.dtype == torch.float32
        assert mixer.conv_state.data_ptr() == state.pools[0][i].data_ptr()
        assert mixer.ssm_state.data_ptr() == state.pools[1][i].data_ptr()
    assert mixers[0].ssm_state.data_ptr() != mixers[1].ssm_state.data_ptr()


def test_add_request_resets_only_its_slot():
    state = make_state(BambaForCausalLM(tiny_config("BambaForCausalLM")))
    for pool in state.pools:
        pool.fill_(1.0)
    state.add_request(1, new_request=None)  # the reset needs nothing from the request
    for pool in state.pools:
        assert not pool[:, 1].any() and pool[:, [0, 2]].eq(1).all()


def test_postprocess_rejects_rejections_without_drafts():
    state = make_state(BambaForCausalLM(tiny_config("BambaForCausalLM")))
    ones = torch.ones(2, dtype=torch.int32)
    state.postprocess_state(None, ones, torch.zeros_like(ones))
    with pytest.raises(RuntimeError, match="rejected draft"):
        state.postprocess_state(None, ones, ones)


def test_model_without_recurrent_layers_is_refused():
    with pytest.raises(ValueError, match="no recurrent layers"):
        make_state(LlamaForCausalLM(tiny_config("LlamaForCausalLM")))


def test_gated_delta_net_layers_get_their_declared_state():
    from slotrunner.models.qwen3_next import Qwen3NextForCausalLM

    model = Qwen3NextForCausalLM(tiny_config("Qwen3NextForCausalLM"))  # layers 1 and 3 are attention
    state = make_state(model)
    nets = [layer.linear_attn for layer in model.model.layers if layer.is_linear]
    assert state.layers == nets and len(nets) == 2
    for net in nets:
        a = net.args
        assert net.conv_state.shape == (MAX_NUM_SEQS + 1, a.conv_dim, a.conv_kernel - 1)
        assert net.recurrent_state.shape == (MAX_NUM_SEQS + 1, a.num_v_heads, a.head_k_dim, a.head_v_dim)
        assert net.recurrent_state.dtype == torch.float32
    assert nets[0].recurrent_state.data_ptr() != nets[1].recurrent_state.data_ptr()
    assert state.cache_bytes(torch.float32) == sum(p.numel() * p.element_size() for p in state.pools)


def test_layers_with_different_specs_get_pools_of_their_own():
    """A model mixing Mamba2 mixers and gated delta-nets: one stacked pool set per spec, each
    layer bound to rows of its own spec's pools, and the reset reaches all of them."""
    from slotrunner.models.bamba import mixer_args
    from slotrunner.models.layers.gated_delta_net.layer import GatedDeltaNet, GatedDeltaNetArgs
    from slotrunner.models.layers.mamba.mixer import MambaMixer2

    gdn_args = GatedDeltaNetArgs.from_hf(tiny_config("Qwen3_5ForCausalLM"), fused_projections=False)
    mamba = mixer_args(tiny_config("BambaForCausalLM"))
    model = torch.nn.ModuleList([MambaMixer2(mamba, 0), GatedDeltaNet(gdn_args, 1), MambaMixer2(mamba, 2)])
    state = make_state(model)
    assert len(state.groups) == 2 and len(state.pools) == 4
    assert model[0].conv_state.data_ptr() != model[2].conv_state.data_ptr()
    assert model[1].recurrent_state.shape[1:] == (gdn_args.num_v_heads, gdn_args.head_k_dim, gdn_args.head_v_dim)
    for pool in state.pools:
        pool.fill_(1.0)
    state.add_request(2, new_request=None)
    assert not model[1].recurrent_state[2].any() and not model[2].ssm_state[2].any()
    assert model[1].conv_state[1].eq(1).all()
    assert state.cache_bytes(torch.float32) == sum(p.numel() * p.element_size() for p in state.pools)


def test_state_spec_rejects_bad_declarations():
    from slotrunner.models.layers.recurrent_state import RecurrentStateSpec, StateTensorSpec

    with pytest.raises(ValueError, match="identifier"):
        StateTensorSpec("conv-state", (4, 3))
    with pytest.raises(ValueError, match="positive"):
        StateTensorSpec("conv_state", (4, 0))
    with pytest.raises(ValueError, match="distinct"):
        RecurrentStateSpec("x", (StateTensorSpec("s", (1,)), StateTensorSpec("s", (2,))))


@pytest.mark.parametrize("arch", ["BambaForCausalLM", "Qwen3NextForCausalLM"])
def test_replayed_decode_steps_equal_eager_and_padding_rows_touch_no_slot(arch, tmp_path, replayed_decode):
    """Decode steps run as a graph replays them (captured metadata, batches padded 3 -> 4 with
    rows for nothing) give the eager engine's tokens: the padding rows advance the scratch row,
    never slot 0 (the padded rows' idx_mapping) or any request's state."""
    from slotrunner import LLM, SamplingParams
    from slotrunner.conformance import build_case

    build_case(tiny_config(arch), tmp_path)
    prompts = [{"prompt_token_ids": [(5 * i + 3 * j) % 90 + 5 for j in range(n)]} for i, n in enumerate((7, 3, 11))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eager = LLM(str(tmp_path), device="cpu", max_model_len=64, max_num_seqs=4, block_size=4)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]

    llm = LLM(str(tmp_path), device="cpu", max_model_len=64, max_num_seqs=4, block_size=4)
    runner = llm.engine.runner
    graphs = replayed_decode(runner.model, runner.model_state, runner.attn_backend, runner.input_buffers, (1, 2, 4), 64)
    graphs.capture()
    runner.cuda_graphs = graphs
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert graphs.padded > 0, "no padded decode step was replayed"
    # A padding row run on slot 0 (its idx_mapping entry) would shift slot 0's conv window and
    # decay its state even for a zero input: request 0's tokens would change.
    assert got == expected
