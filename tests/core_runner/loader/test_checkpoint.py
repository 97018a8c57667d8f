"""Loading HF checkpoints: sharded files, dtype choice, random weights, and named errors.

Guards against: shards silently skipped, a tensor missing from the file going unnoticed (the
parameter would keep its init values), a mis-shaped tensor failing with an anonymous error.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from slotrunner import LLM, SamplingParams
from slotrunner.core_runner.loader.model_loader import load_model
from slotrunner.registry import resolve
from slotrunner.core_runner.loader.source import open_model
from slotrunner.models.weights import WeightLoadError

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


def copy_with(tiny_llama_dir, dest, mutate):
    dest.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", dest)
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


def test_sharded_checkpoint_equals_single_file(tiny_llama_dir, tmp_path):
    import json

    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", sharded)
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / fname))
        weight_map.update({k: fname for k in keys})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    single = LLM(str(tiny_llama_dir), device="cpu", max_model_len=32).generate(PROMPT, GREEDY, use_tqdm=False)
    multi = LLM(str(sharded), device="cpu", max_model_len=32).generate(PROMPT, GREEDY, use_tqdm=False)
    assert single[0].outputs[0].token_ids == multi[0].outputs[0].token_ids


def test_missing_shard_is_named(tiny_llama_dir, tmp_path):
    import json

    d = tmp_path / "broken_index"
    d.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match="model-00001-of-00002.safetensors"):
        LLM(str(d), device="cpu")


def test_missing_tensor_is_named(tiny_llama_dir, tmp_path):
    d = copy_with(tiny_llama_dir, tmp_path / "missing", lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(WeightLoadError, match="model.layers.1.mlp.down_proj.weight"):
        LLM(str(d), device="cpu")


def test_missing_fused_shard_is_named(tiny_llama_dir, tmp_path):
    d = copy_with(tiny_llama_dir, tmp_path / "missing_v", lambda t: t.pop("model.layers.0.self_attn.v_proj.weight"))
    with pytest.raises(WeightLoadError, match="model.layers.0.self_attn.v_proj.weight"):
        LLM(str(d), device="cpu")


def test_misshaped_tensor_is_named(tiny_llama_dir, tmp_path):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1]

    d = copy_with(tiny_llama_dir, tmp_path / "misshaped", shrink)
    with pytest.raises(WeightLoadError, match="model.layers.0.self_attn.k_proj.weight"):
        LLM(str(d), device="cpu")


def test_unexpected_tensor_is_named(tiny_llama_dir, tmp_path):
    def add(t):
        t["model.layers.0.extra.weight"] = torch.zeros(3)

    d = copy_with(tiny_llama_dir, tmp_path / "extra", add)
    with pytest.raises(WeightLoadError, match="model.layers.0.extra.weight"):
        LLM(str(d), device="cpu")


def test_dtype_choice_and_random_weights(tiny_llama_dir):
    source = open_model(tiny_llama_dir, torch.bfloat16)
    model = load_model(resolve(source.hf_config).model_cls, source.hf_config, source.weights, torch.bfloat16, CPU)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    source = open_model(tiny_llama_dir, torch.float32)
    dummy = load_model(resolve(source.hf_config).model_cls, source.hf_config, source.weights, torch.float32, CPU, load_format="dummy")
    real = dict(load_model(resolve(source.hf_config).model_cls, source.hf_config, source.weights, torch.float32, CPU).named_parameters())
    for name, p in dummy.named_parameters():
        assert torch.isfinite(p).all() and not torch.equal(p, real[name]), name
    out = LLM(str(tiny_llama_dir), device="cpu", dtype="bfloat16", max_model_len=32).generate(PROMPT, GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="dtype 'float8'"):
        LLM(str(tiny_llama_dir), device="cpu", dtype="float8")
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(tiny_llama_dir), device="cpu", load_format="pt")
