"""The CPU's one-call-a-layer decode (`models/layers/native_decode.py`) against the modules.

Guards against: a native step whose bits differ from the module path (a kernel called on other
inputs, another order, a stride or pointer off, the first layer's residual taken wrong), so a
request's tokens or logprobs would depend on whether its step held a prefill; the native path
taking a step it cannot serve (a prefill chunk, a layer of another form) or never being taken.
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from slotrunner import LLM, SamplingParams  # noqa: E402
from slotrunner.conformance_gguf import write_gguf  # noqa: E402
from slotrunner.conformance_oracle import build_case  # noqa: E402
from slotrunner.core_runner.cpu.native import native_unavailable_reason  # noqa: E402
from slotrunner.models.layers import native_decode  # noqa: E402
from slotrunner.registry import tiny_config  # noqa: E402

pytestmark = pytest.mark.skipif(native_unavailable_reason() is not None, reason=str(native_unavailable_reason()))

PROMPTS = [[5, 6, 7, 8], list(range(20, 61)), [9] * 3, list(range(70, 95))]


def _file(tmp_path, architecture: str, matrix_type: str, **overrides):
    sizes = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = tiny_config(architecture, **{**sizes, **overrides})
    return write_gguf(build_case(config, tmp_path / "hf"), tmp_path / "m.gguf", matrix_type=matrix_type)


def _run(llm: LLM, native: bool, params) -> tuple[list, int]:
    """Outputs with the native path on or off, and how many forwards took it."""
    stack = next(m for m in llm.engine.runner.model.modules() if getattr(m, "native_decode", None) is not None)
    taken, run = [0], native_decode.NativeDecodeStack.run

    def counting(self, positions, x):
        out = run(self, positions, x) if native else None
        taken[0] += out is not None
        return out

    llm.reset_prefix_cache()  # both runs compute every prompt token the same way
    native_decode.NativeDecodeStack.run = counting
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        native_decode.NativeDecodeStack.run = run
    assert stack.native_decode is not None
    return [(o.outputs[0].token_ids, [{k: v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs]) for o in outs], taken[0]


@pytest.mark.parametrize(
    "architecture,matrix_type", [("LlamaForCausalLM", "Q4_1"), ("Qwen2ForCausalLM", "Q8_0"), ("Qwen3ForCausalLM", "Q8_0")]
)
@pytest.mark.parametrize("threads", [1, 2])
def test_native_decode_steps_give_the_module_bits(tmp_path, architecture, matrix_type, threads):
    """Greedy tokens and top logprobs bit for bit, in steps that mix decodes with prefill chunks
    (taken by the modules) and in decode-only steps (taken natively); Qwen2 adds q/k/v biases,
    Qwen3 q/k norms."""
    llm = LLM(str(_file(tmp_path, architecture, matrix_type)), device="cpu", dtype="float32", max_model_len=128,
              max_num_batched_tokens=32, max_num_seqs=4)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        native, taken = _run(llm, True, params)
        modules, not_taken = _run(llm, False, params)
    finally:
        torch.set_num_threads(saved)
    assert taken >= 8 and not_taken == 0
    assert native == modules


def test_drafts_verify_natively_with_the_same_bits(tmp_path):
    """Rows of a decode and its n-gram drafts (a few query tokens each) take the native path too;
    outputs equal the modules' and the run without speculation."""
    path = str(_file(tmp_path, "LlamaForCausalLM", "Q8_0"))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    spec = LLM(path, device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})  # fmt: skip
    native, taken = _run(spec, True, params)
    modules, _ = _run(spec, False, params)
    plain, _ = _run(LLM(path, device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4), True, params)
    assert taken > 0
    assert native == modules
    assert [ids for ids, _ in native] == [ids for ids, _ in plain]


def test_layers_outside_the_form_keep_the_modules(tmp_path):
    """Gemma 2's layers (four norms, soft caps) are not the native layer's form: every step takes
    the modules."""
    path = _file(tmp_path, "Gemma2ForCausalLM", "Q8_0", head_dim=256, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                 final_logit_softcapping=30.0, tie_word_embeddings=True)  # fmt: skip
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=128)
    _, taken = _run(llm, True, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1))
    assert taken == 0
