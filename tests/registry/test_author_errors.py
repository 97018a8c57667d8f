"""Errors a model author hits, each a message that names the thing to fix.

Guards against: a second registration silently replacing the first (or failing without saying
who holds the name); a ModelState missing a hook (or checkpointing its state for prefix
caching without saving it), or a model class missing compute_logits /
load_weights, surfacing as an AttributeError inside a step; a lazily registered "module:Class"
with a typo failing as a bare ModuleNotFoundError; a checkpoint tensor the model does not
consume, or a weight the checkpoint lacks, reported without the mapping to fix; a broken plugin
taking the other architectures (and the engine) down with it.
"""

from __future__ import annotations

import logging
import shutil
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from slotrunner import LLM, registry
from slotrunner.core_runner.runner.model_state import ModelState
from slotrunner.models.llama import LlamaForCausalLM
from slotrunner.models.weights import WeightLoadError


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch):
    monkeypatch.setattr(registry, "_registry", dict(registry.IN_TREE))
    monkeypatch.setattr(registry, "_sources", {})
    monkeypatch.setattr(registry, "_plugins_loaded", False)


def write_plugin(tmp_path, monkeypatch, module: str, source: str, entry: str) -> None:
    """An installed-looking plugin: `module`.py plus a dist-info with one entry point."""
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    dist = tmp_path / f"{module}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[slotrunner.plugins]\n{module} = {entry}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)


# -- the registry ----------------------------------------------------------------------------


def test_registering_a_taken_name_says_who_holds_it():
    with pytest.raises(ValueError) as e:
        registry.register_model("LlamaForCausalLM", "my_plugin.llama:MyLlama")
    message = str(e.value)
    assert "'LlamaForCausalLM' is already registered" in message
    assert "slotrunner.models.llama:LlamaForCausalLM, in-tree" in message
    assert "another name, or pass overwrite=True" in message


def test_a_plugin_taking_an_in_tree_name_is_skipped_and_named(tmp_path, monkeypatch, caplog):
    write_plugin(tmp_path, monkeypatch, "greedy_plugin", """
        from slotrunner.registry import register_model
        def register():
            register_model("LlamaForCausalLM", "greedy_plugin:Nothing")
    """, "greedy_plugin:register")
    with caplog.at_level(logging.WARNING, logger="slotrunner.registry"):
        registry.load_plugins()
    assert "plugin 'greedy_plugin' (greedy_plugin:register) failed to load" in caplog.text
    assert "'LlamaForCausalLM' is already registered" in caplog.text
    assert registry.resolve(LlamaConfig(architectures=["LlamaForCausalLM"])).model_cls is LlamaForCausalLM


def test_a_second_plugin_registration_names_the_first_plugin(tmp_path, monkeypatch):
    write_plugin(tmp_path, monkeypatch, "first_plugin", """
        from slotrunner.registry import register_model
        def register():
            register_model("SharedName", "slotrunner.models.llama:LlamaForCausalLM")
    """, "first_plugin:register")
    registry.load_plugins()
    with pytest.raises(ValueError, match=r"'SharedName' is already registered \(model slotrunner.models.llama:"
                                         r"LlamaForCausalLM, plugin 'first_plugin' \(first_plugin:register\)\)"):
        registry.register_model("SharedName", LlamaForCausalLM)


def test_a_broken_plugin_leaves_the_engine_working(tmp_path, monkeypatch, caplog, tiny_llama_dir):
    write_plugin(tmp_path, monkeypatch, "broken_plugin", """
        import no_such_dependency_anywhere
        def register():
            pass
    """, "broken_plugin:register")
    with caplog.at_level(logging.WARNING, logger="slotrunner.registry"):
        archs = registry.supported_architectures()
    assert "broken_plugin" in caplog.text and "no_such_dependency_anywhere" in caplog.text
    assert "LlamaForCausalLM" in archs
    out = LLM(str(tiny_llama_dir), device="cpu", max_model_len=32).generate({"prompt_token_ids": [5, 6]}, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0


def test_a_plugin_model_that_fails_to_import_breaks_only_its_architecture(tmp_path, monkeypatch):
    """Registration is lazy: the model module is imported when its architecture is used, and
    the error names the architecture and the registered path. Listing goes on around it."""
    write_plugin(tmp_path, monkeypatch, "lazy_plugin", """
        from slotrunner.registry import register_model
        def register():
            register_model("TypoModel", "lazy_plugin_models.typo:TypoForCausalLM",
                           tiny_config="slotrunner.registry.tiny_configs:llama")
    """, "lazy_plugin:register")
    with pytest.raises(ImportError, match="model class registered for 'TypoModel' as 'lazy_plugin_models.typo:TypoForCausalLM'"):
        registry.resolve(LlamaConfig(architectures=["TypoModel"]))
    rows = {arch: state for arch, _, state in registry.describe_architectures()}
    assert rows["TypoModel"].startswith("unresolved (ImportError") and rows["LlamaForCausalLM"] == "DefaultModelState"


def test_a_missing_class_in_an_existing_module_is_named():
    registry.register_model("Misnamed", "slotrunner.models.llama:LlamaForCausalLm")
    with pytest.raises(ImportError, match="module 'slotrunner.models.llama' has no attribute 'LlamaForCausalLm'"):
        registry.resolve(LlamaConfig(architectures=["Misnamed"]))


def test_a_malformed_path_is_refused_at_registration():
    with pytest.raises(ValueError, match="'package.module:Name' string, got 'slotrunner.models.llama.LlamaForCausalLM'"):
        registry.register_model("Dotted", "slotrunner.models.llama.LlamaForCausalLM")


def test_a_model_class_without_the_runner_methods_is_named(tmp_path, monkeypatch):
    class NoLogits(torch.nn.Module):
        def load_weights(self, weights):
            return set()

    with pytest.raises(TypeError, match="NoLogits .*does not define compute_logits"):
        registry.register_model("NoLogits", NoLogits)
    write_plugin(tmp_path, monkeypatch, "half_model", """
        import torch
        class HalfModel(torch.nn.Module):
            def compute_logits(self, hidden):
                return hidden
    """, "half_model:HalfModel")
    registry.register_model("HalfModel", "half_model:HalfModel")
    with pytest.raises(TypeError, match="HalfModel \\(model class of 'HalfModel'\\) does not define load_weights"):
        registry.resolve(LlamaConfig(architectures=["HalfModel"]))


def test_a_model_state_missing_a_hook_is_named_where_it_is_defined(tmp_path, monkeypatch):
    with pytest.raises(TypeError, match="Forgetful subclasses ModelState but does not implement: add_request"):

        class Forgetful(ModelState):
            def remove_request(self, slot):
                pass

            def prepare_inputs(self, batch):
                pass

    # Registered lazily, the same error comes when the architecture is resolved.
    write_plugin(tmp_path, monkeypatch, "forgetful_state", """
        from slotrunner.core_runner.runner.model_state import ModelState
        class ForgetfulState(ModelState):
            def remove_request(self, slot):
                pass
    """, "forgetful_state:ForgetfulState")
    registry.register_model("ForgetfulLlama", LlamaForCausalLM, "forgetful_state:ForgetfulState")
    with pytest.raises(TypeError, match="ForgetfulState subclasses ModelState but does not implement: add_request"):
        registry.resolve(LlamaConfig(architectures=["ForgetfulLlama"]))


def test_a_model_state_that_checkpoints_state_without_saving_it_is_named_where_it_is_defined():
    with pytest.raises(TypeError, match="Amnesiac sets checkpoints_state but does not implement save_state_checkpoints"):

        class Amnesiac(ModelState):
            checkpoints_state = True

            def add_request(self, slot, new_request):
                pass


# -- weights ---------------------------------------------------------------------------------


def edited_checkpoint(src, dst, edit):
    dst.mkdir()
    shutil.copy(src / "config.json", dst)
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def test_a_tensor_the_model_does_not_consume_is_named_with_the_fix(tiny_llama_dir, tmp_path):
    def add(t):
        t["model.layers.0.post_attention_layernorm.bias"] = torch.zeros(64)

    with pytest.raises(WeightLoadError) as e:
        LLM(edited_checkpoint(tiny_llama_dir, tmp_path / "extra", add), device="cpu")
    message = str(e.value)
    assert "'model.layers.0.post_attention_layernorm.bias' is not consumed by LlamaForCausalLM" in message
    assert "nearest model parameter: 'model.layers.0.post_attention_layernorm.weight'" in message
    assert "LlamaForCausalLM.load_weights" in message and "ignore_unexpected" in message


def test_a_tensor_mapped_to_a_missing_fused_parameter_is_named(tiny_llama_dir, tmp_path):
    """gate_proj / up_proj fuse into gate_up_proj; a bias for them has nowhere to go."""

    def add(t):
        t["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(128)

    with pytest.raises(WeightLoadError, match="'model.layers.0.mlp.gate_proj.bias' is not consumed by LlamaForCausalLM: "
                                              "the `merged` mapping of LlamaForCausalLM.load_weights sends it to "
                                              "'model.layers.0.mlp.gate_up_proj.bias'"):
        LLM(edited_checkpoint(tiny_llama_dir, tmp_path / "extra_bias", add), device="cpu")


def test_a_weight_the_checkpoint_lacks_is_named_with_the_fix(tiny_llama_dir, tmp_path):
    def drop(t):
        del t["model.norm.weight"], t["model.layers.1.self_attn.k_proj.weight"]

    with pytest.raises(WeightLoadError) as e:
        LLM(edited_checkpoint(tiny_llama_dir, tmp_path / "missing", drop), device="cpu")
    message = str(e.value)
    assert "checkpoint lacks 2 weight(s) of LlamaForCausalLM" in message
    assert "'model.layers.1.self_attn.k_proj.weight'" in message and "'model.norm.weight'" in message
    assert "map the names in LlamaForCausalLM.load_weights" in message


def test_a_transposed_weight_is_recognised(tiny_llama_dir, tmp_path):
    def transpose(t):
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"].t().contiguous()

    with pytest.raises(WeightLoadError, match=r"shape \(128, 64\), the model expects \(64, 128\) \(its transpose: "
                                              r"an \[in, out\] Conv1D-style weight\?"):
        LLM(edited_checkpoint(tiny_llama_dir, tmp_path / "transposed", transpose), device="cpu")
