"""The runner's features together on a GPU, for every family (skipped without one).

Each case runs the same greedy requests twice on CUDA in float32: once plainly (eager steps,
synchronous scheduling, no prefix caching) and once with a feature on; the token ids must be
equal, or part only at a near-tie of the plain run (NEAR_TIE). Prompts share long prefixes (so prefix-cache hits land, for recurrent hybrids through
their state checkpoints) and repeat themselves (so n-gram drafts are proposed and some are
accepted).

Guards against: a feature that is exact on the CPU reference backend but not through the
compiled Triton kernels and replayed CUDA graphs: a cached prefix read from the wrong block,
a state checkpoint restored into the wrong slot, a sliding-window block freed while a graph
still reads it, rejected drafts left in a recurrent state.
"""

from __future__ import annotations

import pytest
import torch

from slotrunner import LLM, SamplingParams
from slotrunner.conformance import build_case
from slotrunner.registry import tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ARCHS = (
    "Qwen3ForCausalLM", "Gemma3ForCausalLM", "DeepseekV2ForCausalLM", "BambaForCausalLM", "Qwen3NextForCausalLM",
    "Qwen2VLForConditionalGeneration",  # the multimodal family fed text (M-RoPE positions; draft steps in graphs)
)  # fmt: skip
PLAIN = dict(enforce_eager=True, async_scheduling=False, enable_prefix_caching=False)
FEATURES = {
    "graphs+async+prefix caching": dict(enforce_eager=False, async_scheduling=True, enable_prefix_caching=True),
    "graphs+ngram drafts": dict(
        enforce_eager=False, async_scheduling=False, enable_prefix_caching=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    ),
    # The default on CUDA: every step overlaps where the family allows (EngineConfig.overlap_drafts:
    # Qwen3, Qwen2-VL); elsewhere those that carry or propose drafts are processed first.
    "graphs+async+ngram drafts": dict(
        enforce_eager=False, async_scheduling=True, enable_prefix_caching=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    ),
}  # fmt: skip


def _prompts() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(5, 200, (70,), generator=gen).tolist()
    motif = torch.randint(5, 200, (6,), generator=gen).tolist()
    prompts = [prefix + torch.randint(5, 200, (n,), generator=gen).tolist() for n in (1, 9, 30)]
    prompts += [motif * 8, prefix[:40] + motif * 3]
    return [{"prompt_token_ids": p} for p in prompts]


# Two runs of one fp32 model can split a greedy near-tie differently (other batch shapes, other
# GEMM kernels, other summation orders): a row may diverge only where the plain run's two best
# tokens are this close in logprob, and is not compared past that point.
NEAR_TIE = 1e-3


def _run(directory, name: str = "plain", **kwargs) -> list[tuple[list[int], list[float]]]:
    """Greedy ids and, per output position, the gap between the two best logprobs."""
    llm = LLM(str(directory), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8, block_size=16, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = _prompts()

    def rows(outs):
        return [(o.outputs[0].token_ids, [_gap(p) for p in o.outputs[0].logprobs]) for o in outs]

    # Two passes: the second one meets the first one's cached blocks (and state checkpoints).
    first = rows(llm.generate(prompts, params, use_tqdm=False))
    second = rows(llm.generate(prompts[::-1], params, use_tqdm=False))[::-1]
    _assert_same(second, first, f"{name}: the second pass (cache hits)")
    return first


def _gap(position) -> float:
    best = sorted((lp.logprob for lp in position.values()), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def _assert_same(got, want, what: str) -> None:
    for row, ((ids, _), (want_ids, gaps)) in enumerate(zip(got, want)):
        if ids == want_ids:
            continue
        j = next((j for j, (a, b) in enumerate(zip(ids, want_ids)) if a != b), min(len(ids), len(want_ids)))
        assert j < len(gaps) and gaps[j] < NEAR_TIE, (
            f"{what} changed row {row} at output token {j} ({ids[j:j + 3]} vs {want_ids[j:j + 3]}), "
            f"where the best two tokens were {gaps[j] if j < len(gaps) else float('nan'):.2e} apart"
        )


@pytest.mark.parametrize("arch", ARCHS)
def test_features_keep_greedy_tokens(arch, tmp_path):
    build_case(tiny_config(arch), tmp_path)
    plain = _run(tmp_path, **PLAIN)
    for name, kwargs in FEATURES.items():
        _assert_same(_run(tmp_path, f"{arch}: {name}", **kwargs), plain, f"{arch}: {name}")


def test_steps_on_another_stream_are_refused_and_the_engine_carries_on(tmp_path):
    """Guards against: a step launched under `torch.cuda.stream(other)` racing its output copy and
    staging event, which are queued on the stream the engine was built on (async_output.step_stream):
    the step fails with a message naming both streams, its requests end with "abort", and the
    engine serves the next call on its own stream."""
    from slotrunner.core_runner.engine.engine import StepFailedError

    build_case(tiny_config("Qwen3ForCausalLM"), tmp_path)
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_model_len=64, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = llm.generate([{"prompt_token_ids": [5, 9, 11]}], params, use_tqdm=False)[0].outputs[0].token_ids
    with torch.cuda.stream(torch.cuda.Stream()):
        with pytest.raises((StepFailedError, RuntimeError), match="CUDA stream current when it was built"):
            llm.generate([{"prompt_token_ids": [5, 9, 11]}], params, use_tqdm=False)
    assert llm.generate([{"prompt_token_ids": [5, 9, 11]}], params, use_tqdm=False)[0].outputs[0].token_ids == want
