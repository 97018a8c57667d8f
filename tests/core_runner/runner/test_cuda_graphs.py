"""CUDA graphs and the sync-free decode step, on a GPU (skipped elsewhere); on the CPU, which
steps replay which graph (decode with drafts included), through a replay emulation.

Guards against: a replayed graph reading stale inputs (buffers reallocated instead of rewritten),
padding rows of a padded batch writing into the KV cache or leaking into real rows, a graph
captured at one size replayed for another, a host-device sync slipping into the decode step.
"""

from __future__ import annotations

import pytest
import torch

from slotrunner import LLM, SamplingParams
from slotrunner.registry import tiny_config

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Prompt lengths chosen so the decode batch shrinks through sizes that are and are not captured.
PROMPT_LENS = (3, 17, 40, 5, 33, 64, 9, 1, 23, 50, 12)
OUTPUT_LENS = (30, 12, 25, 7, 30, 3, 18, 30, 9, 21, 15)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from slotrunner.conformance import build_case

    d = tmp_path_factory.mktemp("qwen3")
    build_case(tiny_config("Qwen3ForCausalLM"), d)
    return d


def _run(model_dir, dtype: str, enforce_eager: bool) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cuda", dtype=dtype, enforce_eager=enforce_eager, max_model_len=128, max_num_seqs=16)
    assert (llm.engine.runner.cuda_graphs is None) == enforce_eager
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 200, (n,), generator=gen).tolist()} for n in PROMPT_LENS]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in OUTPUT_LENS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_equal_eager(qwen3_dir, dtype):
    assert _run(qwen3_dir, dtype, enforce_eager=False) == _run(qwen3_dir, dtype, enforce_eager=True)


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dependent_launches_change_no_bit(qwen3_dir, dtype, monkeypatch):
    """Programmatic dependent launch (triton_utils.pdl_launch; on a Hopper or newer) against
    plain launches, graphs and eager: the same tokens and the same logprobs, bitwise. Guards
    against a kernel launched dependent that touches memory before its wait."""
    from slotrunner.core_runner import triton_utils

    def run(pdl: bool, eager: bool):
        monkeypatch.setattr(triton_utils, "PDL", pdl)
        llm = LLM(str(qwen3_dir), device="cuda", dtype=dtype, enforce_eager=eager, max_model_len=128, max_num_seqs=16)
        gen = torch.Generator().manual_seed(3)
        prompts = [{"prompt_token_ids": torch.randint(0, 200, (n,), generator=gen).tolist()} for n in PROMPT_LENS]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=1) for m in OUTPUT_LENS]
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return [(o.token_ids, o.cumulative_logprob) for o in outs]

    if torch.cuda.get_device_capability()[0] >= 9:
        monkeypatch.setattr(triton_utils, "PDL", True)
        assert triton_utils.pdl_launch(torch.device("cuda")), "a Hopper launches the decode path's kernels dependent"
    for eager in (False, True):
        assert run(True, eager) == run(False, eager), f"eager={eager}"


@needs_cuda
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_longest_first_decode_grid_changes_no_bit(qwen3_dir, kv_cache_dtype, monkeypatch):
    """The decode launch over its rows longest first (TileConfig.decode_longest_first: the runner
    stages AttentionMetadata.decode_order, graphs read it) against batch order, graphs and eager:
    the same tokens and logprobs, bitwise. Guards against a staged order that misses a row or
    names a padding row, and a captured graph left reading the capture's order."""
    from slotrunner.core_runner.attention.tile_config import TileConfig
    from slotrunner.core_runner.attention.triton_attn import TritonBackend
    from slotrunner.core_runner.runner import model_runner

    def run(longest_first: bool, eager: bool):
        backend = TritonBackend(TileConfig(decode_longest_first=longest_first))
        monkeypatch.setattr(model_runner, "select_attn_backend", lambda device: backend)
        llm = LLM(str(qwen3_dir), device="cuda", dtype="bfloat16", enforce_eager=eager, max_model_len=128, max_num_seqs=16,
                  kv_cache_dtype=kv_cache_dtype)
        assert llm.engine.runner.attn_backend.orders_decode_rows == longest_first
        gen = torch.Generator().manual_seed(5)
        prompts = [{"prompt_token_ids": torch.randint(0, 200, (n,), generator=gen).tolist()} for n in PROMPT_LENS]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=1) for m in OUTPUT_LENS]
        return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in llm.generate(prompts, params, use_tqdm=False)]

    for eager in (False, True):
        assert run(True, eager) == run(False, eager), f"eager={eager}"


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_request_prefill_graphs_equal_eager(qwen3_dir, dtype):
    """Prompts served one at a time (each prefill a step of one row, padded to a captured token
    count; one chunked in two): the tokens of eager steps, and each prefill replayed a graph."""
    gen = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": torch.randint(0, 200, (n,), generator=gen).tolist()} for n in (2, 9, 16, 30, 100)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = []
    for eager in (False, True):
        llm = LLM(str(qwen3_dir), device="cuda", dtype=dtype, enforce_eager=eager, max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=64)  # fmt: skip
        graphs, replayed = llm.engine.runner.cuda_graphs, []
        if not eager:
            assert graphs.prefill_lens == [16, 32, 64], graphs.prefill_lens
            run = graphs.run
            graphs.run = lambda batch: replayed.append(batch.num_tokens_padded) or run(batch)
        runs.append([llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts])
        if not eager:
            assert {16, 32, 64} <= set(replayed), replayed
    assert runs[0] == runs[1]


@needs_cuda
def test_decode_step_does_not_sync(qwen3_dir, run_decode_steps_without_sync):
    llm = LLM(str(qwen3_dir), device="cuda", dtype="bfloat16", max_model_len=128, max_num_seqs=16)
    engine = llm.engine
    sp = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=40, ignore_eos=True)
    for i, n in enumerate(PROMPT_LENS[:6]):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(1, n + 1))}, sp)
    for _ in range(3):  # prefill steps may sync (prompt tables); decode steps must not
        engine.step()
    assert run_decode_steps_without_sync(engine, 10) == 10


@needs_cuda
def test_prefill_and_mixed_steps_do_not_sync(qwen3_dir, run_decode_steps_without_sync):
    """Eager steps overlap the GPU too: a step with prefill chunks (a new request's prompt
    copied to the device, its blocks' tables, the prefill attention) and decode rows beside them
    must not wait for the GPU. On one H100 an 8,192-token prefill step launches its kernels in
    ~15 ms and runs them in ~23: a sync would serialize the two."""
    llm = LLM(str(qwen3_dir), device="cuda", dtype="bfloat16", max_model_len=128, max_num_seqs=16,
              max_num_batched_tokens=48)  # fmt: skip
    engine, scheduler = llm.engine, llm.engine.scheduler
    sp = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=30, ignore_eos=True)
    checked = 0
    for first in (1, 100):  # the same shapes twice, other tokens (no prefix-cache hit): the first compiles the kernels
        for i, n in enumerate(PROMPT_LENS[:3]):
            engine.add_request(f"{first}-w{i}", {"prompt_token_ids": list(range(first, first + n))}, sp)
        while scheduler.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.running):
            engine.step()
        for i, n in enumerate(PROMPT_LENS[3:8]):  # chunked prefills beside the first requests' decode rows
            engine.add_request(f"{first}-r{i}", {"prompt_token_ids": list(range(first, first + n))}, sp)
        if first == 100:
            checked = run_decode_steps_without_sync(engine, 6, decode_only=False)
            break
        while scheduler.has_unfinished_requests():
            engine.step()
    assert checked == 6


@needs_cuda
def test_whisper_graphs_equal_eager(tmp_path):
    """Encoder-decoders replay decode graphs too: the cross-attention metadata (each row's slot
    and encoder length) must be rewritten in the captured buffers, not rebuilt."""
    import numpy as np

    from slotrunner.conformance import build_case
    from slotrunner.registry.tiny_configs import whisper_feature_extractor

    config = tiny_config("WhisperForConditionalGeneration")
    config.architectures = ["WhisperForConditionalGeneration"]
    build_case(config, tmp_path)
    whisper_feature_extractor(config).save_pretrained(str(tmp_path))
    rng = np.random.RandomState(0)
    clips = [(rng.randn(n).astype(np.float32) * 0.1, 16000) for n in (400, 16000, 3000, 9000, 800, 12000, 5000)]
    prompts = [{"multi_modal_data": {"audio": clip}} for clip in clips]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 9, 30, 14, 25, 3, 17)]
    runs = []
    for eager in (False, True):
        llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", enforce_eager=eager, max_model_len=64, max_num_seqs=8)
        assert (llm.engine.runner.cuda_graphs is None) == eager
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]


@needs_cuda
@pytest.mark.parametrize("arch", ["BartForConditionalGeneration", "T5ForConditionalGeneration"])
def test_encoder_decoder_draft_and_prefill_graphs_equal_eager(arch, tmp_path, with_drafts):
    """Encoder-decoders replay the graphs of steps whose rows carry n-gram drafts and of one
    request's prefill chunk: their cross-attention launch (no causal mask) reads each row's query
    tokens, cache row and encoder length from the device. Tokens equal eager steps; every such
    graph replays at least once."""
    from slotrunner.conformance import build_case

    build_case(tiny_config(arch), tmp_path)
    motif = [7, 19, 23, 44, 12]
    prompts = [{"encoder_prompt": {"prompt_token_ids": [40 + i, 8, 9 + i, 60]}, "decoder_prompt": {"prompt_token_ids": d}}
               for i, d in enumerate([motif * 4 + [30], motif * 3 + [31], [5, 9, 11], motif * 5])]  # fmt: skip
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 12, 25, 30)]
    runs, replays = [], {}
    for eager in (False, True):
        llm = with_drafts(LLM(str(tmp_path), device="cuda", dtype="bfloat16", enforce_eager=eager, max_model_len=128,
                              max_num_seqs=4, speculative_config=SPEC))  # fmt: skip
        graphs = llm.engine.runner.cuda_graphs
        assert (graphs is None) == eager
        if graphs is not None:  # count the replays by tokens a row
            run = graphs.run
            graphs.run = lambda batch, run=run: replays.setdefault(batch.num_tokens_padded // batch.num_reqs_padded, []).append(1) or run(batch)
        one = [llm.generate([p], params[i], use_tqdm=False)[0].outputs[0].token_ids for i, p in enumerate(prompts)]
        runs.append((one, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]))
    assert runs[0] == runs[1]
    assert 1 + SPEC["num_speculative_tokens"] in replays and any(q > 4 for q in replays), sorted(replays)


@needs_cuda
@pytest.mark.parametrize("arch", ["BambaForCausalLM", "GraniteMoeHybridForCausalLM", "Qwen3NextForCausalLM"])
def test_recurrent_hybrid_graphs_equal_eager_and_decode_does_not_sync(arch, tmp_path, run_decode_steps_without_sync):
    """Recurrent hybrids replay decode graphs: the rows' state indices are rewritten in the
    captured buffer, padding rows advance the scratch slot; the decode step never syncs (the
    MoE of GraniteMoeHybrid and the state-update kernels included)."""
    from slotrunner.conformance import build_case

    build_case(tiny_config(arch), tmp_path)
    assert _run(tmp_path, "bfloat16", enforce_eager=False) == _run(tmp_path, "bfloat16", enforce_eager=True)
    llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", max_model_len=128, max_num_seqs=16)
    engine = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, n in enumerate(PROMPT_LENS[:5]):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(1, n + 1))}, sp)
    for _ in range(3):
        engine.step()
    assert run_decode_steps_without_sync(engine, 5) == 5


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.mark.parametrize("enforce", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2VLForConditionalGeneration", "BartForConditionalGeneration",
                                  "T5ForConditionalGeneration"])
def test_draft_steps_replay_their_graphs(tmp_path, replayed_decode, enforce, arch):
    """Decode steps whose rows carry n-gram drafts replay the graphs captured at 1 + k tokens a
    row (rows with fewer drafts padded), padded to a captured batch size; steps with a prefill
    chunk run eagerly. Tokens equal a run without speculation. With the family's
    `cuda_graphs_with_drafts` off, such steps run eagerly and the tokens are the same. Qwen2-VL:
    the multimodal family, its M-RoPE positions written per token of the draft rows. BART, T5:
    the encoder-decoder family, its cross-attention rows rewritten in the captured metadata (T5:
    a relative position bias over the draft rows)."""
    from slotrunner.conformance import build_case

    build_case(tiny_config(arch), tmp_path)
    motif = [7, 19, 23, 44, 12]  # no media placeholder id (3, 4 in the tiny configs)
    prompts = [{"prompt_token_ids": motif * 6 + [i + 30]} for i in range(3)] + [{"prompt_token_ids": [5, 9, 11]}]
    if "ConditionalGeneration" in arch and "VL" not in arch:  # the motif in the decoder's prompt; encoder inputs differ
        prompts = [{"encoder_prompt": {"prompt_token_ids": [40 + i, 8, 9 + i]}, "decoder_prompt": p} for i, p in enumerate(prompts)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 12, 30, 30)]
    common = dict(device="cpu", max_model_len=128, max_num_seqs=4, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in LLM(str(tmp_path), **common).generate(prompts, params, use_tqdm=False)]

    llm = LLM(str(tmp_path), speculative_config=SPEC, **common)
    runner = llm.engine.runner
    state = runner.model_state
    if enforce:
        state.cuda_graphs_with_drafts = False  # this instance only
    q = 1 + SPEC["num_speculative_tokens"] if state.cuda_graphs_with_drafts else 1
    graphs = replayed_decode(runner.model, state, runner.attn_backend, runner.input_buffers, (1, 2, 4), 128, q)
    graphs.capture()
    runner.cuda_graphs = graphs
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert state.cuda_graphs_with_drafts != enforce
    if enforce:
        assert set(graphs.replays) == {1}, graphs.replays
    else:
        assert graphs.replays[q] > 0 and graphs.padded > 0, graphs.replays


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2VLForConditionalGeneration", "BambaForCausalLM",
                                  "T5ForConditionalGeneration"])
def test_one_request_prefill_replays_its_graph(tmp_path, replayed_decode, arch):
    """A step that is one request's prefill chunk alone replays the one-row graph of the next
    captured token count (padding tokens dropped, never cached): prompts of 3..100 tokens, a
    chunked 150-token prompt (chunks of 64), a prefix-cache hit (the rest of the prompt after
    the cached blocks); tokens equal eager steps. Several prompts in one step, and families
    whose prefill needs more than token ids (media) or keeps state (a recurrent hybrid), run
    their prefill eagerly."""
    from slotrunner.conformance import build_case
    from slotrunner.core_runner.runner.model_runner import multi_token_rows_capturable

    build_case(tiny_config(arch), tmp_path)
    gen = torch.Generator().manual_seed(1)
    lens = (3, 17, 40, 64, 100, 150, 150)
    prompts = [{"prompt_token_ids": torch.randint(10, 200, (n,), generator=gen).tolist()} for n in lens]
    prompts[-1] = {"prompt_token_ids": prompts[-2]["prompt_token_ids"][:120] + [5] * 30}  # shares 120 tokens
    if arch.startswith("T5"):  # the decoder's prompt carries the lengths; one encoder input (cached blocks need it equal)
        prompts = [{"encoder_prompt": {"prompt_token_ids": [40, 8, 9]}, "decoder_prompt": p} for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    common = dict(device="cpu", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)

    def one_at_a_time(llm) -> list[list[int]]:
        return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]

    want = one_at_a_time(LLM(str(tmp_path), enforce_eager=True, **common))
    llm = LLM(str(tmp_path), **common)
    runner = llm.engine.runner
    state = runner.model_state
    graphs = replayed_decode(runner.model, state, runner.attn_backend, runner.input_buffers, (1, 2, 4), 256, 1,
                             prefill=state.cuda_graphs_for_prefill and multi_token_rows_capturable(runner.model))  # fmt: skip
    graphs.capture()
    runner.cuda_graphs = graphs
    assert one_at_a_time(llm) == want
    if not state.cuda_graphs_for_prefill:  # media or recurrent state: prefill stays eager
        assert set(graphs.replays) == {1}, graphs.replays
        return
    assert graphs.prefill_lens == [16, 32, 64], graphs.prefill_lens  # up to the token budget
    assert graphs.replays[16] >= 1 and graphs.replays[32] >= 1 and graphs.replays[64] >= 6, graphs.replays
    # every step of several prompts' prefill runs eagerly: two prompts at once replay no prefill graph
    graphs.replays.clear()
    outs = llm.generate(prompts[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want[:2]
    assert set(graphs.replays) == {1}, graphs.replays


def test_full_decode_steps_of_an_unlisted_row_limit_replay_a_graph(tmp_path, replayed_decode):
    """Guards against: with max_num_seqs=6 (then between two default sizes), the default sizes
    were cut to 1, 2, 4 and every decode step of 5 or 6 rows ran eagerly (on one H100, 240 tok/s
    on a small bench workload). The limit itself is captured (sizes 1, 2, 4 here): six requests
    decode in graphs at 6."""
    from slotrunner.conformance import build_case
    build_case(tiny_config("Qwen3ForCausalLM"), tmp_path)
    prompts = [{"prompt_token_ids": [5 + i, 9, 11, 13]} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    common = dict(device="cpu", max_model_len=64, max_num_seqs=6)
    want = [o.outputs[0].token_ids for o in LLM(str(tmp_path), **common).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(tmp_path), **common)
    runner = llm.engine.runner
    graphs = replayed_decode(runner.model, runner.model_state, runner.attn_backend, runner.input_buffers,
                             (1, 2, 4, 8, 16), 64, 1)  # fmt: skip
    assert graphs.sizes == [1, 2, 4, 6] and graphs.padded_size(5) == 6 and graphs.padded_size(7) is None
    graphs.capture()
    runner.cuda_graphs = graphs
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert graphs.replays[1] >= 7, graphs.replays  # every decode step after the one prefill step


@pytest.mark.parametrize(("arch", "want"), [("Qwen3ForCausalLM", 4), ("DeepseekV2ForCausalLM", 1), ("BambaForCausalLM", 1),
                                           ("BartForConditionalGeneration", 4)])
def test_which_models_capture_draft_steps(arch, want, tmp_path):
    """Guards against: capturing decode-with-drafts steps of a model whose cache layer lays
    multi-token rows out on the host (MLA's per-row expansion: a replay would keep the capture's
    lengths -- seen on one H200 as wrong tokens after a prefix-cache hit) or whose family keeps
    draft steps eager (recurrent state checkpoints per draft)."""
    from slotrunner.conformance import build_case
    from slotrunner.core_runner.runner.model_runner import draft_graph_query_len

    build_case(tiny_config(arch), tmp_path)
    llm = LLM(str(tmp_path), device="cpu", max_model_len=64, speculative_config=SPEC)
    runner = llm.engine.runner
    assert draft_graph_query_len(runner.model, runner.model_state, SPEC["num_speculative_tokens"]) == want
    assert draft_graph_query_len(runner.model, runner.model_state, 0) == 1


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_draft_model_graphs_equal_eager(qwen3_dir, dtype, with_drafts):
    """A draft equal to the target, its one-token forwards replayed from its own graphs (and the
    target's verify steps from the draft-step graphs): the tokens of eager steps, every draft
    accepted in fp32."""
    spec = {"method": "draft_model", "model": str(qwen3_dir), "num_speculative_tokens": 3}
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 200, (n,), generator=gen).tolist()} for n in PROMPT_LENS]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in OUTPUT_LENS]
    runs = []
    for eager in (False, True):
        llm = LLM(str(qwen3_dir), device="cuda", dtype=dtype, enforce_eager=eager, max_model_len=128, max_num_seqs=16,
                  speculative_config=spec)  # fmt: skip
        # Drafts every step in both runs: the gate's timing-dependent choices would make the
        # two runs' steps differ (and bf16 rounds a verify step differently from a plain one).
        with_drafts(llm)
        graphs = llm.engine.runner.speculator.graphs
        assert (graphs is None) == eager
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
        if not eager:
            assert graphs.replays > 0
        if dtype == "float32":
            assert all(o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens for o in outs)
    assert runs[0] == runs[1]


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shared_prefix_steps_replay_their_graphs(tmp_path, dtype):
    """Requests over one cached 300-token prompt: their decode steps replay the graphs captured
    with the shared-prefix launch, and give the same ids and logprobs, bit for bit, as an engine
    whose steps never take it (disable_cascade_attn=True)."""
    from slotrunner.conformance import build_case

    config = tiny_config("Qwen3ForCausalLM")
    config.max_position_embeddings = 512
    build_case(config, tmp_path)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(5, 200, (300,), generator=gen).tolist()
    prompts = [{"prompt_token_ids": prefix + torch.randint(5, 200, (1 + 5 * i,), generator=gen).tolist()} for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=20 + i, ignore_eos=True, logprobs=1) for i in range(12)]

    def run(disable_cascade_attn: bool) -> tuple[list, list[int]]:
        llm = LLM(str(tmp_path), device="cuda", dtype=dtype, max_model_len=512, max_num_seqs=16, block_size=16,
                  disable_cascade_attn=disable_cascade_attn)  # fmt: skip
        graphs = llm.engine.runner.cuda_graphs
        shared, replay = [], graphs.run
        graphs.run = lambda batch: (shared.append(batch.shared_prefix_len), replay(batch))[1]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [list(p.items()) for p in o.outputs[0].logprobs]) for o in outs], shared

    got, shared = run(False)
    assert sum(1 for s in shared if s) >= 10 and set(shared) <= {0, 256}, shared
    want, shared = run(True)
    assert not any(shared)
    assert got == want
