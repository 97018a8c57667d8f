"""RecurrentHybridModelState: pools sized from each recurrent layer's spec and bound to it,
reset per admitted slot.

Guards against: a re-admitted (preempted) or reused slot starting from the previous request's
state, pools bound to the wrong layers or shared between layers, attention layers of a hybrid
mistaken for recurrent layers, a state dtype other than declared, and a postprocess hook that
silently accepts rejected drafts.
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
    # The ModelState reads only max_num_seqs from the engine config.
    state = RecurrentHybridModelState(SimpleNamespace(max_num_seqs=MAX_NUM_SEQS), model, torch.device("cpu"))
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
        assert mixer.conv_state.shape == (MAX_NUM_SEQS, a.conv_dim, a.conv_kernel - 1)
        assert mixer.ssm_state.shape == (MAX_NUM_SEQS, a.num_heads, a.head_dim, a.state_size)
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


def test_postprocess_rejects_rejected_drafts():
    state = make_state(BambaForCausalLM(tiny_config("BambaForCausalLM")))
    ones = torch.ones(2, dtype=torch.int32)
    state.postprocess_state(None, ones, torch.zeros_like(ones))
    with pytest.raises(RuntimeError, match="rejected draft"):
        state.postprocess_state(None, ones, ones)


def test_model_without_recurrent_layers_is_refused():
    with pytest.raises(ValueError, match="no recurrent layers"):
        make_state(LlamaForCausalLM(tiny_config("LlamaForCausalLM")))
