"""Tensor parallelism end to end on CPU: two ranks in two processes talking through gloo.

`LLM(..., tensor_parallel_size=2)` makes this process rank 0 and spawns rank 1 (a tiny Llama);
a second run starts both ranks as a launcher (torchrun) would, through RANK / WORLD_SIZE /
MASTER_* (a tiny GPT-OSS: experts with biases split over the ranks, per-head attention sinks,
attention biases, sliding windows). The recurrent hybrids (Bamba; Qwen3-Next and Qwen3.5's
gated delta-nets), T5 and the DeepSeek family (multi-head latent attention split by head over a
latent cache every rank keeps whole) run in engines of their own after those close.

Guards against: a sharded forward that differs from the single-device one (a head or MLP row
computed by the wrong rank, a missing all-reduce, partial sums added twice, logits gathered in
the wrong order or with the padding kept), ranks whose slot or sampling tables drift apart
under chunked prefill, prefix-cache hits and preemption (rank 1 would then attend the wrong
blocks), families without sharded layers running anyway, head counts that do not divide
failing deep inside a rank, a dead rank leaving rank 0 waiting forever, and close() leaving
processes or the process group behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from slotrunner import LLM, SamplingParams
from slotrunner.conformance import LOGITS_ATOL, LOGITS_RTOL, build_case, compare_greedy
from slotrunner.conformance_oracle import hf_greedy, hf_logits
from slotrunner.core_runner.engine.engine import StepFailedError
from slotrunner.core_runner.runner.kv_cache import kv_bytes_per_block
from slotrunner.models.layers.mla_attention import MLAAttention
from slotrunner.registry import tiny_config

MAX_TOKENS = 6
ENGINE = dict(device="cpu", max_model_len=32, max_num_seqs=4, block_size=4, max_num_batched_tokens=12, num_kv_blocks=12)
ALONE = [[5, 9, 13, 17, 21], list(range(30, 41)), [50 + 3 * i for i in range(20)]]
# A mixed batch: two prompts sharing their first 8 tokens (prefix-cache hits), prompts longer
# than the step budget (chunked prefill), more KV blocks wanted than the 12 there are (preemption).
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
REPEATING = [7, 8, 9, 10] * 4  # the n-gram speculator finds drafts in it
SHARED = list(range(100, 108))
BATCH = [SHARED + [7, 8, 9], SHARED + [11, 12], list(range(200, 219)), list(range(300, 317))]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tp_llama")
    hf_model = build_case(tiny_config("LlamaForCausalLM", tie_word_embeddings=False), directory)
    return directory, hf_model


@pytest.fixture(scope="module")
def one_rank(case):
    return LLM(str(case[0]), **ENGINE)


@pytest.fixture(scope="module")
def two_ranks(case):
    llm = LLM(str(case[0]), tensor_parallel_size=2, **ENGINE)
    yield llm
    llm.close()


def _greedy(n: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _record_hidden(llm: LLM) -> tuple[dict, callable]:
    """Rank 0's hidden state at every (request, position) it computed (every rank holds the
    whole hidden state; only the vocabulary is split)."""
    rows: dict[tuple[str, int], torch.Tensor] = {}

    def observe(batch, hidden):
        positions = batch.positions.tolist()
        for r, req_id in enumerate(batch.req_ids):
            for t in range(int(batch.query_start_loc_np[r]), int(batch.query_start_loc_np[r + 1])):
                rows[(req_id, positions[t])] = hidden[t].clone()

    return rows, llm.engine.runner.add_step_observer(observe)


def test_two_ranks_match_transformers_and_one_rank_at_every_position(case, one_rank, two_ranks):
    directory, hf_model = case
    head = load_file(str(directory / "model.safetensors"))["lm_head.weight"]  # the whole vocabulary
    for i, prompt in enumerate(ALONE):
        rows, remove = _record_hidden(two_ranks)
        try:
            out = two_ranks.generate({"prompt_token_ids": prompt}, _greedy(), use_tqdm=False)[0]
        finally:
            remove()
        ids = list(out.outputs[0].token_ids)
        seq = prompt + ids
        hidden = torch.stack([rows[(out.request_id, p)] for p in range(len(seq) - 1)])
        ref = hf_logits(hf_model, seq)[: len(seq) - 1]
        torch.testing.assert_close(hidden @ head.T, ref, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
        assert compare_greedy(f"request {i}", ids, hf_greedy(hf_model, prompt, MAX_TOKENS), ref, len(prompt)).passed
        single = one_rank.generate({"prompt_token_ids": prompt}, _greedy(), use_tqdm=False)[0]
        assert ids == list(single.outputs[0].token_ids)


def test_two_ranks_stay_in_step_through_chunks_cache_hits_and_preemption(one_rank, two_ranks):
    prompts = [{"prompt_token_ids": p} for p in BATCH]
    params = _greedy(6, logprobs=3)
    before = two_ranks.engine.scheduler.num_preemptions
    ours = two_ranks.generate(prompts, params, use_tqdm=False)
    assert two_ranks.engine.scheduler.num_preemptions > before, "the batch must preempt to test it"
    assert any(o.num_cached_tokens for o in ours), "the shared prefix must hit the prefix cache"
    ref = one_rank.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ours, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert abs(la[t].logprob - lb[t].logprob) <= LOGITS_ATOL
    # Seeded sampling: the same Gumbel noise on every rank, over the same gathered logits.
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=4, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in two_ranks.generate(prompts, seeded, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in one_rank.generate(prompts, seeded, use_tqdm=False)
    ]


def test_rank_zero_holds_half_of_the_model_and_of_the_kv_cache(one_rank, two_ranks):
    ours, full = two_ranks.engine.runner, one_rank.engine.runner
    assert ours.model.model.embed_tokens.weight.shape[0] == 500  # vocab 1000 over two ranks
    # [2, blocks, block_size, kv_heads, head_dim]: the tiny Llama's 2 KV heads, one per rank
    assert [tuple(c.shape) for c in full.kv_caches] == [(2, 12, 4, 2, 16)] * 2
    assert [tuple(c.shape) for c in ours.kv_caches] == [(2, 12, 4, 1, 16)] * 2


@pytest.mark.parametrize("architecture, family", [("GPT2LMHeadModel", "default decoder")])
def test_a_family_without_sharded_layers_is_refused_naming_it(architecture, family, tmp_path):
    """Every in-tree architecture shards; the example plugin's GPT-2 declares no
    `check_tensor_parallel`, so it stands for an architecture that does not."""
    pytest.importorskip("slotrunner_example_plugin", reason="the example plugin (scripts/test.sh installs it)")
    build_case(tiny_config(architecture), tmp_path)
    with pytest.raises(ValueError, match=f"tensor_parallel_size=2: {architecture} \\({family} family\\) does not run"):
        LLM(str(tmp_path), device="cpu", tensor_parallel_size=2)


def test_heads_that_do_not_divide_are_refused_before_starting_ranks(case):
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        LLM(str(case[0]), device="cpu", tensor_parallel_size=3)


def test_a_second_parallel_engine_in_one_process_is_refused_until_the_first_closes(case, two_ranks):
    with pytest.raises(ValueError, match="process group already exists in this process: close the other"):
        LLM(str(case[0]), tensor_parallel_size=2, **ENGINE)
    assert two_ranks.generate({"prompt_token_ids": [5, 6]}, _greedy(2), use_tqdm=False)[0].outputs[0].token_ids


LAUNCHED = """
import json, sys
from slotrunner import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, **json.loads(sys.argv[2]))
# Only rank 0 gets here: on rank 1 the constructor served rank 0's steps, then ended the process.
max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 6
out = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[3])],
                   SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2), use_tqdm=False)
print("OUT", json.dumps([[list(o.outputs[0].token_ids), [{str(t): l.logprob for t, l in lp.items()}
                                                        for lp in o.outputs[0].logprobs]] for o in out]))
print("ACCEPTED", sum(o.metrics.num_accepted_tokens for o in out))
print("OVERLAP", int(llm.engine.scheduler.overlap_drafts))
llm.close()
"""


def _launch_two_ranks(directory, engine: dict, prompts: list, max_tokens: int = MAX_TOKENS) -> str:
    """Rank 0's stdout of LAUNCHED run torchrun-style on two ranks (asserting both succeed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))  # fmt: skip
        cmd = [sys.executable, "-c", LAUNCHED, str(directory), json.dumps(engine), json.dumps(prompts), str(max_tokens)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "OUT" not in outs[1][0]  # rank 1 ran no code after LLM(...)
    return outs[0][0]


def test_overlapped_steps_with_drafts_stay_in_step_across_ranks(case, one_rank):
    """Async scheduling with n-gram drafts on two ranks: rank 0 schedules steps behind steps with
    drafts (EngineConfig.overlap_drafts) while every other rank processes each step at once; both
    must move the same rows back by the same rejected drafts (SchedulerOutput.behind_drafts), or
    their collectives would mix different positions."""
    engine = ENGINE | {"speculative_config": SPECULATIVE, "async_scheduling": True}
    prompts, max_tokens = ALONE + [REPEATING], 14
    out = _launch_two_ranks(case[0], engine, prompts, max_tokens)
    assert "OVERLAP 1" in out and int(out.split("ACCEPTED ", 1)[1].split()[0]) > 0, out
    ours = json.loads(out.split("OUT ", 1)[1].split("\n", 1)[0])
    ref = one_rank.generate([{"prompt_token_ids": p} for p in prompts], _greedy(max_tokens, logprobs=2), use_tqdm=False)
    for (ids, logprobs), r in zip(ours, ref):
        assert ids == list(r.outputs[0].token_ids)
        for la, lb in zip(logprobs, r.outputs[0].logprobs):
            assert all(abs(v - lb[int(t)].logprob) <= LOGITS_ATOL for t, v in la.items())


def test_an_external_launcher_runs_the_same_script_on_every_rank(tmp_path):
    """A tiny GPT-OSS (4 of its experts per rank; the router replicated), started torchrun-style,
    with n-gram speculative decoding: the drafts' verification reads the same gathered logits on
    every rank, and the accepted counts reach rank 1's host tables too."""
    build_case(tiny_config("GptOssForCausalLM", tie_word_embeddings=False), tmp_path)
    grouped = ENGINE | {"num_kv_blocks": 24}  # two KV-cache groups: one request needs 15 block ids
    engine = grouped | {"speculative_config": SPECULATIVE}
    prompts = ALONE + [REPEATING]
    out = _launch_two_ranks(tmp_path, engine, prompts)
    ours = json.loads(out.split("OUT ", 1)[1].split("\n", 1)[0])
    assert int(out.split("ACCEPTED ", 1)[1].split()[0]) > 0, "no draft was accepted: nothing tested"
    one_rank_moe = LLM(str(tmp_path), **grouped)  # plain decoding: drafts change no token
    ref = one_rank_moe.generate([{"prompt_token_ids": p} for p in prompts], _greedy(logprobs=2), use_tqdm=False)
    for (ids, logprobs), r in zip(ours, ref):
        assert ids == list(r.outputs[0].token_ids)
        for la, lb in zip(logprobs, r.outputs[0].logprobs):
            assert {int(t) for t in la} == set(lb)
            assert all(abs(v - lb[int(t)].logprob) <= LOGITS_ATOL for t, v in la.items())


def test_ctrl_c_in_a_step_lets_every_rank_finish_it_then_interrupts(one_rank, two_ranks):
    """Guards against: Ctrl-C raising on rank 0 between two collectives of a step (rank 1 would
    wait in the logits' gather while rank 0 sends the next step: the ranks out of step for good)."""
    fired = []

    def interrupt(batch, hidden):  # rank 0, after the forward, before the logits are gathered
        if not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    remove = two_ranks.engine.runner.add_step_observer(interrupt)
    # Ctrl-C as Python handles it by default: the engine hands the held signal to the handler it
    # found, whatever an earlier test or library of this process left installed.
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            two_ranks.generate({"prompt_token_ids": ALONE[1]}, _greedy(), use_tqdm=False)
    finally:
        remove()
        signal.signal(signal.SIGINT, found)
    assert fired, "the step observer never ran: no Ctrl-C was sent"
    ours = two_ranks.generate({"prompt_token_ids": ALONE[1]}, _greedy(), use_tqdm=False)[0]
    ref = one_rank.generate({"prompt_token_ids": ALONE[1]}, _greedy(), use_tqdm=False)[0]
    assert ours.outputs[0].token_ids == ref.outputs[0].token_ids


def test_a_dead_rank_fails_the_next_step_instead_of_hanging(two_ranks):
    """The last test of the fixture's engine: it leaves it broken (close() still works)."""
    worker = two_ranks.engine.tensor_parallel.workers[0]
    worker.kill()
    worker.join(10)
    start = time.monotonic()
    with pytest.raises(StepFailedError, match="tensor-parallel rank 1 exited"):
        two_ranks.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(), use_tqdm=False)
    with pytest.raises(StepFailedError, match="build a new LLM"):
        two_ranks.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(), use_tqdm=False)
    assert time.monotonic() - start < 10
    two_ranks.close()
    # The process group is gone: another parallel engine could start in this process.
    assert not torch.distributed.is_initialized()
    # And no handle keeps it alive: a held one kept gloo's threads running until the interpreter
    # tore them down at exit, where a rank aborted now and then.
    tp = two_ranks.engine.tensor_parallel.tp
    assert tp.device_group is None and tp.cpu_group is None, "close() kept the process groups' handles"


def _two_ranks_equal_one(directory, engine: dict, prompts: list) -> None:
    """Greedy ids and logprobs of TP=2 equal TP=1's for `prompts` (the TP=2 engine is closed)."""
    params = _greedy(logprobs=2)
    ref = LLM(str(directory), **engine).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(directory), tensor_parallel_size=2, **engine)
    try:
        ours = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()
    for a, b in zip(ours, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys() and all(abs(la[t].logprob - lb[t].logprob) <= LOGITS_ATOL for t in la)


def test_a_recurrent_hybrid_splits_its_mamba_heads_and_their_state(tmp_path):
    """After the fixture's engine closed (one process group per process). Bamba: Mamba2 mixers (one B/C group, so the gated norm spans the ranks) between attention
    layers; chunked prefill carries each rank's conv window and SSM state across chunks."""
    build_case(tiny_config("BambaForCausalLM", tie_word_embeddings=False), tmp_path)
    engine = ENGINE | {"max_num_batched_tokens": 7, "max_num_seqs": 2}
    prompts = [{"prompt_token_ids": p} for p in ALONE]
    _two_ranks_equal_one(tmp_path, engine, prompts)


@pytest.mark.parametrize("architecture", ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"])
def test_a_gated_delta_net_hybrid_splits_its_heads_and_their_state(architecture, tmp_path):
    """Qwen3-Next (fused projections grouped per key head), Qwen3.5 (separate ones, dense MLPs),
    Qwen3.5-MoE: each rank keeps one of the two key heads, its two value heads and their conv
    window and matrix state, half the gated attention's heads, 4 of the 8 experts. One mixed
    batch with n-gram speculative decoding: the rank's state carried across chunks, restored from
    a prefix-cache checkpoint, rebuilt after preemption and rolled back past rejected drafts."""
    hf_model = build_case(tiny_config(architecture, tie_word_embeddings=False), tmp_path)
    one_rank = LLM(str(tmp_path), **ENGINE)
    # A prompt, its own continuation, the prompt again: the n-gram speculator drafts that
    # continuation, which the tiny random model accepts at least in part (a repeated pattern it does not).
    seed = REPEATING[:4]
    echo = seed + list(one_rank.generate({"prompt_token_ids": seed}, _greedy(), use_tqdm=False)[0].outputs[0].token_ids)
    echo += seed
    prompts = [{"prompt_token_ids": p} for p in [*BATCH, echo]]
    params = _greedy(logprobs=2)
    ref = one_rank.generate(prompts, params, use_tqdm=False)  # plain decoding: drafts change no token
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE, speculative_config=SPECULATIVE)
    try:
        ours = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0, "the batch must preempt to test it"
    finally:
        llm.close()
    assert any(o.num_cached_tokens for o in ours), "the shared prefix must hit the prefix cache"
    assert sum(o.metrics.num_accepted_tokens for o in ours) > 0, "no draft was accepted: nothing tested"
    for i, (a, b) in enumerate(zip(ours, ref)):
        ids, prompt = list(a.outputs[0].token_ids), prompts[i]["prompt_token_ids"]
        assert ids == list(b.outputs[0].token_ids)
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys() and all(abs(la[t].logprob - lb[t].logprob) <= LOGITS_ATOL for t in la)
        # Greedy as transformers decodes, checked in one forward: its logits over prompt + ids pick
        # each of ids (or a near-tie) -- cheaper than its generate, with its slow reference kernels.
        hf_ref = hf_logits(hf_model, prompt + ids)
        picked = hf_ref[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert compare_greedy(f"request {i}", ids, picked, hf_ref, len(prompt)).passed


def test_an_encoder_decoder_splits_its_decoder_and_replicates_its_encoder(tmp_path):
    """T5: each rank runs the whole encoder, keeps its heads' cross K/V per slot and its heads'
    columns of the decoder's relative position bias; chunked decoder prefill, a mixed batch."""
    build_case(tiny_config("T5ForConditionalGeneration"), tmp_path)
    engine = ENGINE | {"max_num_batched_tokens": 7, "max_num_seqs": 2, "enable_prefix_caching": False}
    prompts = [{"encoder_prompt": {"prompt_token_ids": p[:12]}, "decoder_prompt": {"prompt_token_ids": p[12:]}}
               for p in ALONE]  # fmt: skip
    _two_ranks_equal_one(tmp_path, engine, prompts)


# DeepSeek multi-head latent attention: the tiny configs' 4 heads, 2 per rank.
DEEPSEEK = {
    "v2": ("DeepseekV2ForCausalLM", {}),  # q_proj (no q LoRA), group-limited greedy routing, 2 shared experts
    "v2-q-lora": ("DeepseekV2ForCausalLM", {"q_lora_rank": 24, "topk_method": "greedy"}),
    "v3": ("DeepseekV3ForCausalLM", {}),  # q LoRA, sigmoid routing in groups with a correction bias
}
# Each tiny DeepSeek falls into a loop within 12 tokens after it, so n-gram drafts get accepted.
LOOPING = [3, 3, 3, 3]


def _count_mla_paths(llm: LLM) -> dict[str, int]:
    """How often rank 0's first MLA layer ran each path (rank 1 runs the same steps)."""
    attn = next(m for m in llm.engine.runner.model.modules() if isinstance(m, MLAAttention))
    calls = {"_prefill": 0, "_decode": 0}
    for name in calls:
        method = getattr(attn, name)

        def counted(*args, _name=name, _method=method):
            calls[_name] += 1
            return _method(*args)

        setattr(attn, name, counted)
    return calls


@pytest.mark.parametrize("variant", DEEPSEEK)
def test_deepseek_splits_its_attention_heads_and_keeps_the_whole_latent_on_every_rank(variant, tmp_path):
    """After the fixture's engine closed. Each rank attends with half the heads (its rows of
    q_proj / q_b_proj and kv_b_proj, o_proj row-parallel) over the whole latent cache; experts
    split whole, shared experts and the dense layer by rows. The mixed batch (chunked prefill,
    prefix-cache hits, preemption) with n-gram drafts runs both MLA paths: the expanded one
    (prefill chunks, rows with drafts) and the absorbed decode with each rank's kv_b_proj slice.

    Guards against: a rank's W_UK / W_UV not its own heads' rows, the replicated latent or rope
    key computed differently on the ranks, a latent cache divided by the ranks (each holds all of
    it: it is sized per rank as on one device), and tokens or logprobs that differ from one rank
    or from transformers."""
    architecture, overrides = DEEPSEEK[variant]
    hf_model = build_case(tiny_config(architecture, **overrides), tmp_path)
    prompts = BATCH + [LOOPING]
    params = [_greedy(logprobs=2)] * len(BATCH) + [_greedy(12, logprobs=2)]
    one = LLM(str(tmp_path), **ENGINE)  # plain decoding: drafts change no token
    ref = one.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE, speculative_config=SPECULATIVE)
    try:
        paths = _count_mla_paths(llm)
        ours = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0, "the batch must preempt to test it"
        runner = llm.engine.runner
        heads = {m.num_heads for m in runner.model.modules() if isinstance(m, MLAAttention)}
        caches = [tuple(c.shape) for c in runner.kv_caches]
        block_bytes = kv_bytes_per_block(runner.model, ENGINE["block_size"], torch.float32)
    finally:
        llm.close()
    assert paths["_prefill"] > 0 and paths["_decode"] > 0, f"both MLA paths must run: {paths}"
    assert any(o.num_cached_tokens for o in ours), "the shared prefix must hit the prefix cache"
    assert sum(o.metrics.num_accepted_tokens for o in ours) > 0, "no draft was accepted: nothing tested"
    assert heads == {2}  # of 4
    # [blocks, block_size, kv_lora_rank + qk_rope_head_dim]: not halved, as on one device.
    assert caches == [tuple(c.shape) for c in one.engine.runner.kv_caches] == [(12, 4, 40)] * 3
    assert block_bytes == kv_bytes_per_block(one.engine.runner.model, ENGINE["block_size"], torch.float32)
    for prompt, a, b in zip(prompts, ours, ref):
        ids = list(a.outputs[0].token_ids)
        assert ids == list(b.outputs[0].token_ids)
        hf = hf_logits(hf_model, prompt + ids).log_softmax(-1)[len(prompt) - 1 : -1]  # [tokens, vocab]
        for step, (la, lb) in enumerate(zip(a.outputs[0].logprobs, b.outputs[0].logprobs)):
            assert la.keys() == lb.keys()
            assert hf[step].max() - hf[step, ids[step]] <= 2 * LOGITS_ATOL, "not transformers' greedy token"
            for t in la:
                assert abs(la[t].logprob - lb[t].logprob) <= LOGITS_ATOL
                assert abs(la[t].logprob - hf[step, t].item()) <= LOGITS_ATOL


def test_deepseek_shapes_it_cannot_run_are_refused_before_starting_ranks(tmp_path, monkeypatch):
    """Heads that do not divide raise in this process before any rank is started (not in every
    rank after loading)."""
    build_case(tiny_config("DeepseekV2ForCausalLM"), tmp_path)

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started before the refusal")

    monkeypatch.setattr("slotrunner.builder.join_tensor_parallel", no_ranks)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        LLM(str(tmp_path), device="cpu", tensor_parallel_size=3)


def test_deepseek_with_a_float8_latent_cache_on_two_ranks_equals_one(tmp_path):
    """The float8 latent cache is whole on every rank, as the bf16 one: TP=2 gives TP=1's tokens."""
    build_case(tiny_config("DeepseekV2ForCausalLM"), tmp_path)
    prompts = [[5 + (7 * i + 3 * j) % 200 for j in range(n)] for i, n in enumerate((9, 17, 4))]
    _two_ranks_equal_one(tmp_path, dict(ENGINE, kv_cache_dtype="fp8"), [{"prompt_token_ids": p} for p in prompts])
