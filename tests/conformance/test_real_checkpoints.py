"""The conformance command on checkpoints as authors have them: the noise floor real weights
are judged against, GGUF files, and a preemption forced when requests are short.

Guards against: a real checkpoint failed for float32 noise that transformers itself has (or a
floor so wide that a wrong model passes), `--model file.gguf` refused or compared with packed
kernels instead of the model, a "preempting" check that fails the model because its requests
were too short to preempt.
"""

from __future__ import annotations

import pytest
import torch

from slotrunner import registry
from slotrunner.cli import main
from slotrunner.conformance import (
    NOISE_FACTOR,
    batch_variants,
    build_case,
    check_batch_invariance,
    checkpoint_case,
    compare_logits,
    run_case,
    single_thread,
)
from slotrunner.models.llama import LlamaForCausalLM
from slotrunner.registry import tiny_config
from slotrunner.sampling_params import SamplingParams


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


def test_the_floor_widens_the_tolerance_to_noise_factor_times_it():
    ref = torch.zeros(3, 5)
    ours = ref.clone()
    ours[1, 2] = 5e-4  # 5x the fixed tolerance
    assert not compare_logits("x", ours, ref).passed
    assert compare_logits("x", ours, ref, floor=1e-4).passed  # within 10 x 1e-4
    tight = compare_logits("x", ours, ref, floor=1e-5)
    assert not tight.passed and tight.floor == 1e-5 and "1 of 15 values" in tight.detail


@pytest.mark.parametrize("floor", ["float64", "ulp"])
def test_a_measured_floor_is_printed_beside_each_deviation(tiny_llama_dir, floor):
    case = checkpoint_case(tiny_llama_dir, floor=floor)
    report = run_case(case, max_tokens=4)
    assert report.passed, report.table()
    floors = [c.floor for c in report.checks]
    assert all(f is not None and 0 < f < 1e-5 for f in floors), floors  # float32 rounding, nothing more
    header, first = report.table().splitlines()[:2]
    assert header.split() == ["check", "result", "worst", "floor", "detail"]
    assert f"{floors[0]:.2e}" in first


def test_the_ulp_perturbation_restores_every_weight_exactly(tiny_llama_dir):
    from slotrunner.conformance import ConformanceRequest, PerturbedOracle

    case = checkpoint_case(tiny_llama_dir, floor=None)
    before = {k: v.clone() for k, v in case.oracle.hf_model.state_dict().items()}
    request = ConformanceRequest({"prompt_token_ids": [5, 6, 7]})
    moved = PerturbedOracle(case.oracle).logits(request, [5, 6, 7, 8])
    assert 0 < float((moved - case.oracle.logits(request, [5, 6, 7, 8])).abs().max()) < 1e-5
    after = case.oracle.hf_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_auto_measures_no_floor_for_a_tiny_model(tiny_llama_dir):
    assert checkpoint_case(tiny_llama_dir).floor_oracle is None


class ScaledLogits(LlamaForCausalLM):
    """Logits 0.1% too large: tokens agree, the logits do not."""

    def compute_logits(self, hidden):
        return super().compute_logits(hidden) * 1.001


def test_a_wrong_model_fails_against_its_floor(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    registry.register_model("LlamaForCausalLM", ScaledLogits, overwrite=True)
    case = checkpoint_case(tiny_llama_dir, floor="float64")
    report = run_case(case, max_tokens=4)
    prefill = report.checks[0]
    assert not prefill.passed and prefill.worst > 100 * NOISE_FACTOR * prefill.floor, report.table()


def test_short_requests_are_run_longer_until_one_is_preempted(tiny_llama_dir):
    """Two- and three-token requests fit the scarce cache side by side: the preempting variants
    run them to max_model_len, and then preempt."""
    case = checkpoint_case(tiny_llama_dir)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}, {"prompt_token_ids": [10]}]
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=4, ignore_eos=True)] * 2  # fmt: skip
    variants = [v for v in batch_variants(case.max_model_len) if v.must_preempt]
    results = check_batch_invariance(case.make_llm, prompts, params[:3], variants, max_model_len=case.max_model_len)
    for result in results:
        assert result.passed, result
        assert "preemptions (run to max_model_len to force them)" in result.detail, result.detail


def test_the_command_checks_a_gguf_file(tmp_path, capsys):
    pytest.importorskip("gguf")
    from slotrunner.conformance_gguf import write_gguf

    config = tiny_config("Qwen2ForCausalLM")
    config.architectures = ["Qwen2ForCausalLM"]
    path = write_gguf(build_case(config, tmp_path / "hf"), tmp_path / "tiny.gguf")
    assert main(["conformance", "Qwen2ForCausalLM", "--model", str(path), "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("PASS: ") and "batch: async, preempting" in out


def test_a_gguf_file_of_another_architecture_is_named(tmp_path, capsys):
    pytest.importorskip("gguf")
    from slotrunner.conformance_gguf import write_gguf

    config = tiny_config("LlamaForCausalLM")
    config.architectures = ["LlamaForCausalLM"]
    path = write_gguf(build_case(config, tmp_path / "hf"), tmp_path / "tiny.gguf")
    assert main(["conformance", "Qwen2ForCausalLM", "--model", str(path)]) == 2
    assert "holds a LlamaForCausalLM, not a Qwen2ForCausalLM" in capsys.readouterr().err


def _save_processor(arch: str, config, directory) -> None:
    from slotrunner.registry import tiny_configs as tc

    if arch.startswith("Whisper"):
        tc.whisper_feature_extractor(config).save_pretrained(directory)
    elif arch.startswith("Llava"):
        tc.llava_processor(config).save_pretrained(directory)
    elif arch.startswith("Qwen2VL"):  # the image processor and tokenizer: the full processor needs torchvision
        tc.qwen2_vl_image_processor(config).save_pretrained(directory)
        tc.qwen2_vl_tokenizer().save_pretrained(directory)
    else:
        tc.qwen2_audio_processor(config).save_pretrained(directory)


@pytest.mark.parametrize(
    "arch",
    ["WhisperForConditionalGeneration", "LlavaForConditionalGeneration", "Qwen2VLForConditionalGeneration",
     "Qwen2AudioForConditionalGeneration"],
)  # fmt: skip
def test_the_command_builds_media_requests_from_the_saved_processor(arch, tmp_path, capsys):
    """Audio clips for Whisper (its feature extractor), text with image or audio placeholders for
    the media decoders (their processors): every check runs on requests that carry media."""
    config = tiny_config(arch)
    config.architectures = [arch]
    build_case(config, tmp_path)
    _save_processor(arch, config, tmp_path)
    case = checkpoint_case(tmp_path)
    assert all("multi_modal_data" in r.prompt for r in case.requests if r.oracle_inputs)
    assert sum(bool(r.oracle_inputs) for r in case.requests) >= 2
    assert main(["conformance", arch, "--model", str(tmp_path), "--max-tokens", "3"]) == 0, capsys.readouterr().out


def test_a_media_model_without_its_processor_is_explained(tmp_path, capsys):
    config = tiny_config("LlavaForConditionalGeneration")
    config.architectures = ["LlavaForConditionalGeneration"]
    build_case(config, tmp_path)
    assert main(["conformance", "LlavaForConditionalGeneration", "--model", str(tmp_path)]) == 2
    assert "its requests are built with the processor saved beside it" in capsys.readouterr().err


def test_an_image_processor_alone_still_builds_image_requests(tmp_path):
    """Qwen2-VL saved with its image processor and tokenizer only (the full processor needs
    torchvision): the text comes from the tokenizer, the image tensors from the image processor
    (the command's run above then checks slotrunner's own expansion of <|image_pad|>: the oracle
    refuses ids whose image tokens do not match the features)."""
    arch = "Qwen2VLForConditionalGeneration"
    config = tiny_config(arch)
    config.architectures = [arch]
    build_case(config, tmp_path)
    _save_processor(arch, config, tmp_path)
    case = checkpoint_case(tmp_path)
    assert sum("image_grid_thw" in r.oracle_inputs for r in case.requests) == 2
    assert all("<|vision_start|><|image_pad|><|vision_end|>" in r.prompt["prompt"] for r in case.requests if r.oracle_inputs)


def test_the_command_measures_the_floor_it_is_asked_for(tiny_llama_dir, capsys):
    assert main(["conformance", "LlamaForCausalLM", "--model", str(tiny_llama_dir), "--max-tokens", "3", "--floor", "ulp"]) == 0
    header = capsys.readouterr().out.splitlines()[1]
    assert header.split() == ["check", "result", "worst", "floor", "detail"]
    assert main(["conformance", "LlamaForCausalLM", "--model", str(tiny_llama_dir), "--max-tokens", "3"]) == 0
    assert "floor" not in capsys.readouterr().out.splitlines()[1]  # auto: a tiny model has none
