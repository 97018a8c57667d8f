"""The registry: lazy table, resolution order, register_model and plugin discovery.

Guards against: an unknown architecture failing with a bare KeyError, silently replacing an
architecture registered twice, resolution picking the wrong ModelState, plugins never loaded.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from transformers import LlamaConfig

from slotrunner import registry
from slotrunner.model_states.default import DefaultModelState
from slotrunner.core_runner.runner.model_state import ModelInputs, ModelState
from slotrunner.models.llama import LlamaForCausalLM


class OtherState(DefaultModelState):
    family = "test"


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch):
    """The in-tree table only, plugins not yet loaded: installed plugins (the example one in
    CI) load again into this copy, and nothing registered here outlives the test."""
    monkeypatch.setattr(registry, "_registry", dict(registry.IN_TREE))
    monkeypatch.setattr(registry, "_sources", {})
    monkeypatch.setattr(registry, "_plugins_loaded", False)


def config(arch: str, **kw) -> LlamaConfig:
    return LlamaConfig(architectures=[arch], **kw)


def test_in_tree_architectures_resolve_to_default_state():
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        resolved = registry.resolve(config(arch))
        assert resolved.model_state_cls is DefaultModelState
        assert resolved.model_cls.__name__ == arch


def test_unknown_architecture_lists_supported():
    with pytest.raises(registry.UnknownArchitectureError, match="'Nope' is not supported; supported: .*Qwen3ForCausalLM"):
        registry.resolve(config("Nope"))
    with pytest.raises(registry.UnknownArchitectureError, match="no 'architectures'"):
        registry.resolve(LlamaConfig())


def test_register_twice_needs_overwrite():
    registry.register_model("MyLlama", LlamaForCausalLM)
    with pytest.raises(ValueError, match="'MyLlama' is already registered .*overwrite=True"):
        registry.register_model("MyLlama", LlamaForCausalLM)
    registry.register_model("MyLlama", LlamaForCausalLM, OtherState, overwrite=True)
    assert registry.resolve(config("MyLlama")).model_state_cls is OtherState


def test_register_rejects_non_model_state():
    with pytest.raises(TypeError, match="must subclass ModelState"):
        registry.register_model("Bad", LlamaForCausalLM, model_state_cls=dict)
    registry.register_model("LazyBad", LlamaForCausalLM, model_state_cls="collections:OrderedDict")
    with pytest.raises(TypeError, match="model_state_cls for 'LazyBad' must subclass ModelState"):
        registry.resolve(config("LazyBad"))


def test_resolution_order():
    class Declaring(LlamaForCausalLM):
        model_state_cls = OtherState

    registry.register_model("Declaring", Declaring)
    assert registry.resolve(config("Declaring")).model_state_cls is OtherState, "model declaration"
    registry.register_model("Explicit", Declaring, DefaultModelState)
    assert registry.resolve(config("Explicit")).model_state_cls is DefaultModelState, "registry entry first"
    registry.register_model("Plain", LlamaForCausalLM)
    cfg = config("Plain")
    cfg.is_encoder_decoder = True  # the config is never sniffed for a family
    assert registry.resolve(cfg).model_state_cls is DefaultModelState, "default"


def test_in_tree_entries_name_their_model_state():
    """Guards against an in-tree architecture depending on config sniffing for its family."""
    assert all(entry.model_state for entry in registry.IN_TREE.values())


def test_model_protocol_is_checked_at_resolve():
    """A family's ModelState names what it needs of the model; a model class lacking a member is
    refused when the architecture resolves, with the member's name, not inside a step."""
    from typing import Protocol

    class NeedsEncode(Protocol):
        def encode(self, x): ...

    class StrictState(DefaultModelState):
        model_protocol = NeedsEncode

    class WithEncode(LlamaForCausalLM):
        def encode(self, x):
            return x

    registry.register_model("Lacking", LlamaForCausalLM, StrictState)
    with pytest.raises(TypeError, match="lacks encode, which StrictState requires"):
        registry.resolve(config("Lacking"))
    registry.register_model("Having", WithEncode, StrictState)
    assert registry.resolve(config("Having")).model_state_cls is StrictState


def test_model_state_missing_hook_is_named():
    """Every hook has a default except add_request, which carries the preemption rule."""
    with pytest.raises(TypeError, match="does not implement: add_request"):

        class Incomplete(ModelState):
            def remove_request(self, slot):
                pass


def test_model_inputs_become_keyword_arguments():
    from dataclasses import dataclass

    import torch

    @dataclass(frozen=True)
    class Extra(ModelInputs):
        encoder_out: torch.Tensor

    t = torch.zeros(2)
    assert Extra(t).as_kwargs() == {"encoder_out": t}
    assert ModelInputs().as_kwargs() == {}


def test_plugin_entry_point_is_discovered(tmp_path, monkeypatch):
    pkg = tmp_path / "my_plugin.py"
    pkg.write_text(textwrap.dedent("""
        from slotrunner.registry import register_model
        def register():
            register_model("PluginLlama", "slotrunner.models.llama:LlamaForCausalLM")
    """))
    dist = tmp_path / "my_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[slotrunner.plugins]\nmy_plugin = my_plugin:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "PluginLlama" in registry.supported_architectures()
    assert registry.resolve(config("PluginLlama")).model_cls is LlamaForCausalLM
    sys.modules.pop("my_plugin", None)


def test_in_tree_families_declare_their_model_protocol():
    """The encoder-decoder and multimodal states name what they call on their models, and every
    in-tree model of those families passes the check (a missing method fails at resolve)."""
    from slotrunner.model_states.encoder_decoder import EncoderDecoderModel, EncoderDecoderModelState
    from slotrunner.model_states.multimodal import MultimodalModel, MultimodalModelState

    assert EncoderDecoderModelState.model_protocol is EncoderDecoderModel
    assert MultimodalModelState.model_protocol is MultimodalModel
    for arch in registry.IN_TREE:
        registry.resolve(registry.tiny_config(arch), arch)

    class NoStore(torch.nn.Module):
        def compute_logits(self, hidden):
            return hidden

        def load_weights(self, weights):
            return set()

        def encode(self, x):
            return x

    registry.register_model("NoStore", NoStore, EncoderDecoderModelState)
    with pytest.raises(TypeError, match="lacks store_cross_kv, which EncoderDecoderModelState requires"):
        registry.resolve(config("NoStore"))
