"""The runner's features together on a GPU, for every family (skipped without one).

Each case runs the same greedy requests twice on CUDA in float32: once plainly (eager steps,
synchronous scheduling, no prefix caching) and once with a feature on; the token ids must be
equal. Prompts share long prefixes (so prefix-cache hits land, for recurrent hybrids through
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

ARCHS = ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "DeepseekV2ForCausalLM", "BambaForCausalLM", "Qwen3NextForCausalLM")
PLAIN = dict(enforce_eager=True, async_scheduling=False, enable_prefix_caching=False)
FEATURES = {
    "graphs+async+prefix caching": dict(enforce_eager=False, async_scheduling=True, enable_prefix_caching=True),
    "graphs+ngram drafts": dict(
        enforce_eager=False, async_scheduling=False, enable_prefix_caching=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    ),
}  # fmt: skip


def _prompts() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 200, (70,), generator=gen).tolist()
    motif = torch.randint(3, 200, (6,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, 200, (n,), generator=gen).tolist() for n in (1, 9, 30)]
    prompts += [motif * 8, prefix[:40] + motif * 3]
    return [{"prompt_token_ids": p} for p in prompts]


def _run(directory, **kwargs) -> list[list[int]]:
    llm = LLM(str(directory), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8, block_size=16, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = _prompts()
    # Two passes: the second one meets the first one's cached blocks (and state checkpoints).
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    second = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], params, use_tqdm=False)][::-1]
    assert first == second, "the second pass (cache hits) changed the tokens"
    return first


@pytest.mark.parametrize("arch", ARCHS)
def test_features_keep_greedy_tokens(arch, tmp_path):
    build_case(tiny_config(arch), tmp_path)
    plain = _run(tmp_path, **PLAIN)
    for name, kwargs in FEATURES.items():
        assert _run(tmp_path, **kwargs) == plain, f"{arch}: {name} changed the greedy tokens"
