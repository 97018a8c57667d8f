"""The public API: LLM.generate's shapes and every bad-input path.

Guards against: outputs out of input order, a bad prompt leaving half-added requests behind
(the engine must stay usable), errors that don't say what is wrong.
"""

from __future__ import annotations

import json
import shutil

import pytest

from slotrunner import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, block_size=4)


def ids(*tokens):
    return {"prompt_token_ids": list(tokens)}


def test_outputs_in_input_order_with_per_prompt_params(llm):
    prompts = [ids(5, 6, 7), ids(9), ids(11, 12)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 1, 4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[5, 6, 7], [9], [11, 12]]
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 1, 4]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert all(o.outputs[0].text == "" for o in outs), "no tokenizer: text stays empty"


def test_stop_token_ids_end_a_request(llm):
    first = llm.generate(ids(5, 6, 7), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = first[2]
    out = llm.generate(ids(5, 6, 7), SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == first[: first.index(stop_at) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at


def test_generation_stops_at_max_model_len(llm):
    out = llm.generate(ids(*range(3, 63)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "prompt, match",
    [
        (ids(*range(3, 67)), "max_model_len"),  # 64 tokens: no room for output
        ({"prompt_token_ids": []}, "empty"),
        (ids(5, 1000), "outside the vocabulary"),
        (ids(5, -1), "outside the vocabulary"),
        ({"prompt_token_ids": [5, True]}, "list of ints"),  # a bool is an int subclass, not a token
        ({"prompt_token_ids": [5, 6.0]}, "list of ints"),
        ("some text", "no tokenizer"),
        ({"prompt_token_ids": [1], "multi_modal_data": {}}, "unsupported field"),
        (42, "string or a dict"),
    ],
)
def test_bad_prompt_is_rejected_and_engine_stays_usable(llm, prompt, match):
    good = ids(5, 6, 7)
    before = llm.generate(good, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=match) as info:
        llm.generate([good, prompt], GREEDY, use_tqdm=False)
    assert "prompt 1" in str(info.value)
    assert not llm.engine.has_unfinished_requests(), "the good prompt of the failed call was withdrawn"
    assert llm.generate(good, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(seed="x"), "seed"),
        (dict(stop_token_ids=[-3]), "stop_token_ids"),
        (dict(stop=[""]), "stop"),
        (dict(n=2, temperature=0), "n=2"),
    ],
)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_mismatched_params_list(llm):
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([ids(5), ids(6)], [GREEDY] * 3, use_tqdm=False)


def test_model_directory_errors(tmp_path, tiny_llama_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"), device="cpu")
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path), device="cpu")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", no_weights)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(no_weights), device="cpu")
    unknown = tmp_path / "unknown"
    shutil.copytree(tiny_llama_dir, unknown)
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (unknown / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported; supported: .*LlamaForCausalLM"):
        LLM(str(unknown), device="cpu")


def test_max_model_len_above_the_model_is_rejected(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(str(tiny_llama_dir), device="cpu", max_model_len=10_000)
