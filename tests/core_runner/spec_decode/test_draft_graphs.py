"""DraftDecodeGraphs: the draft model's forwards through persistent buffers, as a CUDA-graph
replay runs them (on the CPU, the forward runs over the buffers instead of a replay): the
one-token forwards of drafts 2..k, the catch-up forwards of up to k + 1 tokens a row, one
row's catch-up over its prompt at the next captured token count, and several rows' over theirs.

Guards against: a draft step replayed with stale inputs (a buffer reallocated, not rewritten),
a row's position, length, query start, block-table row or cache slot written wrong, padding
rows or padding tokens left with a length or a slot (they would write into the cache or read
another row's blocks), and the eager fallback for batches past the largest captured size or
rows longer than a catch-up graph (prompt chunks).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slotrunner import LLM, SamplingParams
from slotrunner.core_runner.attention.backend import AttentionMetadata
from slotrunner.core_runner.attention.forward_context import ForwardContext, forward_context
from slotrunner.core_runner.spec_decode.draft_graphs import DraftDecodeGraphs

from test_draft_model import dirs, baseline, draft_config, make_requests  # noqa: F401  (fixtures)

K = 4


def _eager(model, backend, input_ids, positions, qsl_np, seq_lens, block_tables, slot_mapping):
    """The draft's forward over the given rows, with metadata built from them alone."""
    seq_np = seq_lens.numpy().copy()
    meta = AttentionMetadata(
        num_reqs=qsl_np.shape[0] - 1, num_tokens=input_ids.shape[0], query_start_loc=torch.from_numpy(qsl_np.copy()),
        query_start_loc_np=qsl_np.copy(), seq_lens=seq_lens.clone(), seq_lens_np=seq_np,
        max_query_len=int(np.diff(qsl_np).max()), max_seq_len=int(seq_np.max()), block_tables=block_tables.clone(),
        slot_mapping=slot_mapping.clone(),
    )  # fmt: skip
    with torch.inference_mode(), forward_context(ForwardContext(backend, meta)):
        return model(input_ids.clone(), positions.clone(), inputs_embeds=None)


class BufferReplay(DraftDecodeGraphs):
    """No capture; a "replay" runs the draft over the real rows of the buffers, built only from
    what the buffers hold, after checking that the padding is empty; each replay is compared
    with an eager forward over the caller's own tensors."""

    def capture(self) -> None:
        self.padded, self.by_query_len = 0, {q: 0 for q in [*self.query_lens, *self.prefill_lens]}

    def _replay(self, n: int, q: int, tokens: int) -> torch.Tensor:
        qsl, seq = self.query_start_loc[: n + 1], self.seq_lens[:n]
        rows = int((seq > 0).sum())
        assert (seq[rows:] == 0).all() and (qsl[rows + 1 :] == tokens).all(), "padding rows not empty"
        assert (self.slot_mapping[tokens : n * q] == -1).all(), "padding tokens would write the cache"
        assert int(qsl[rows]) == tokens and int(torch.diff(qsl[: rows + 1]).max()) <= q
        self.padded += n > rows
        self.by_query_len[q] += 1
        out = _eager(self.model, self.attn_backend, self.input_ids[:tokens], self.positions[:tokens],
                     qsl[: rows + 1].numpy(), seq[:rows], self.block_tables[:rows], self.slot_mapping[:tokens])  # fmt: skip
        return torch.cat([out, out.new_zeros(n * q - tokens, out.shape[1])])

    def run(self, input_ids, positions, query_start_loc_np, seq_lens, block_tables, slot_mapping):
        got = super().run(input_ids, positions, query_start_loc_np, seq_lens, block_tables, slot_mapping)
        # Run second: it rewrites the same K/V.
        want = _eager(self.model, self.attn_backend, input_ids, positions, query_start_loc_np, seq_lens, block_tables, slot_mapping)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        return got


def _with_buffer_replay(root, with_drafts, prefill_lens: tuple[int, ...] = ()) -> tuple[LLM, BufferReplay]:
    """An engine whose draft (the target itself) runs through BufferReplay at sizes 1, 3, 6: two
    rows pad to 3, four or five to 6, more run eagerly."""
    llm = with_drafts(LLM(str(root / "target"), device="cpu", max_model_len=64, block_size=4, max_num_seqs=8,
                          speculative_config=draft_config(root / "target", k=K)))  # fmt: skip
    runner = llm.engine.runner
    config, speculator = runner.config, runner.speculator
    speculator.graphs = graphs = BufferReplay(
        speculator.model, runner.attn_backend, (1, 3, 6), config.max_num_seqs, config.max_num_blocks_per_req,
        config.max_model_len, runner.device, catch_up_len=K + 1, prefill_lens=prefill_lens,
    )  # fmt: skip
    graphs.capture()
    return llm, graphs


def test_draft_forwards_through_the_buffers_keep_every_draft_accepted(dirs, baseline, with_drafts):  # noqa: F811
    llm, graphs = _with_buffer_replay(dirs, with_drafts)
    prompts, params = make_requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in baseline]
    assert all(o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens > 0 for o in outs)
    # Both kinds replayed, some padded; prompt chunks and the 8-row batches ran eagerly.
    assert graphs.by_query_len[1] > 0 and graphs.by_query_len[K + 1] > 0 and graphs.padded > 0, graphs.by_query_len
    assert graphs.replays == sum(graphs.by_query_len.values())


def test_one_prompt_catches_up_through_the_graph_of_its_length(dirs, baseline, with_drafts):  # noqa: F811
    """Prompts served one at a time: the draft's catch-up over a prompt of 14 tokens replays the
    one-row graph of 16 (2 padding tokens), one of 5 the decode rows' catch-up graph, one of 23
    (past the longest captured) runs eagerly; every draft is still accepted, and every replay
    is checked against an eager forward (BufferReplay)."""
    llm, graphs = _with_buffer_replay(dirs, with_drafts, prefill_lens=(4, 8, 16))
    assert graphs.prefill_lens == [8, 16]  # those longer than a decode row's catch-up
    prompts, params = make_requests()
    lens = [len(p["prompt_token_ids"]) for p in prompts]
    assert {5, 14, 23} <= set(lens), lens
    outs = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in baseline]
    assert all(o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens > 0 for o in outs)
    assert graphs.by_query_len[16] == lens.count(14), graphs.by_query_len
    assert graphs.by_query_len[1] > 0 and graphs.by_query_len[K + 1] > 0, graphs.by_query_len


def test_a_batch_of_prompts_catches_up_through_one_graph(dirs, baseline, with_drafts):  # noqa: F811
    """The eight prompts (1 to 23 tokens) arrive together: the draft's catch-up over all of them
    is one forward of eight rows replayed from the (8 rows, 32 tokens a row) graph, checked
    against an eager forward (BufferReplay); every draft is still accepted."""
    llm, graphs = _with_buffer_replay(dirs, with_drafts, prefill_lens=(8, 16, 32))
    assert (8, 32) in graphs.prompt_keys and graphs.prompt_rows == [2, 4, 8], (graphs.prompt_keys, graphs.prompt_rows)
    replayed, replay = [], graphs._replay
    graphs._replay = lambda n, q, tokens: replayed.append((n, q)) or replay(n, q, tokens)
    prompts, params = make_requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in baseline]
    assert all(o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens > 0 for o in outs)
    assert replayed[0] == (8, 32), replayed[:3]


def test_fits():
    graphs = DraftDecodeGraphs(torch.nn.Identity(), None, (1, 2, 4), 4, 8, 64, torch.device("cpu"), catch_up_len=6)
    assert graphs.fits(3, np.array([1, 6, 2])) and graphs.fits(1, np.array([1]))
    assert not graphs.fits(5, np.array([1])) and not graphs.fits(2, np.array([7, 1]))
    prompt = DraftDecodeGraphs(torch.nn.Identity(), None, (1, 2, 4), 4, 8, 64, torch.device("cpu"), 6, (16, 32))
    assert prompt.fits(1, np.array([32])) and not prompt.fits(1, np.array([33])) and prompt.fits(2, np.array([7, 1]))
    assert prompt.input_ids.shape[0] == 4 * 32  # four rows of 32 tokens: the largest prompt graph
    # Several rows over prompts: padded to 2 or 4 rows of 16 or 32 tokens each.
    assert prompt.prompt_keys == {(1, 16), (1, 32), (2, 16), (2, 32), (4, 16), (4, 32)}
    assert prompt._graph_for(3, 20, 40) == (4, 32) and prompt._graph_for(2, 7, 8) == (2, 16) and prompt._graph_for(1, 9, 9) == (1, 16)
    assert not prompt.fits(5, np.array([7, 1, 1, 1, 1]))  # more rows than any prompt graph holds
    # Rows whose tokens fill less than a quarter of the graph (PROMPT_GRAPH_MIN_FILL) run eagerly.
    assert prompt._graph_for(4, 30, 32) == (4, 32) and prompt._graph_for(4, 30, 31) is None
    big = DraftDecodeGraphs(torch.nn.Identity(), None, (1, 64), 64, 8, 1024, torch.device("cpu"), 6, (256, 512))
    assert (4, 512) in big.prompt_keys and (8, 512) not in big.prompt_keys and (8, 256) in big.prompt_keys  # PROMPT_GRAPH_TOKENS
    assert big.fits(8, np.array([256] + [100] * 7)) and not big.fits(8, np.array([257] + [100] * 7))
    assert not big.fits(8, np.array([256] + [3] * 7))  # decode rows beside one long prompt: mostly padding
    one = DraftDecodeGraphs(torch.nn.Identity(), None, (1, 2, 4), 4, 8, 64, torch.device("cpu"))
    assert one.fits(4, np.array([1])) and not one.fits(1, np.array([2]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_prompt_catch_up_replays_its_graph_and_keeps_every_draft_accepted(dirs, with_drafts):  # noqa: F811
    """On CUDA (fp32, graphs captured for real): prompts of 14, 40 and 100 tokens served one at a
    time; the draft (the target itself) catches up over each through the one-row graph of 16, 64
    and 128 tokens, and every draft is accepted, tokens equal to a run without drafts."""
    common = dict(device="cuda", dtype="float32", max_model_len=256)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * n) % 900 + 5 for i in range(n)]} for n in (14, 40, 100)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [LLM(str(dirs / "target"), **common).generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    llm = with_drafts(LLM(str(dirs / "target"), speculative_config=draft_config(dirs / "target", k=K), **common))
    graphs = llm.engine.runner.speculator.graphs
    assert graphs is not None and {16, 64, 128} <= set(graphs.prefill_lens), graphs.prefill_lens
    replayed, replay = [], graphs._replay
    graphs._replay = lambda n, q, tokens: replayed.append((n, q)) or replay(n, q, tokens)
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens > 0 for o in outs)
    assert {(1, 16), (1, 64), (1, 128)} <= set(replayed), replayed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_prompts_arriving_together_catch_up_through_one_graph(dirs, with_drafts):  # noqa: F811
    """On CUDA (fp32, graphs captured for real): prompts of 14, 40 and 100 tokens served together;
    the draft (the target itself) catches up over the three through the graph of 4 rows of 128
    tokens, and every draft is accepted, tokens equal to a run without drafts."""
    common = dict(device="cuda", dtype="float32", max_model_len=256)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * n) % 900 + 5 for i in range(n)]} for n in (14, 40, 100)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(dirs / "target"), **common).generate(prompts, params, use_tqdm=False)]
    llm = with_drafts(LLM(str(dirs / "target"), speculative_config=draft_config(dirs / "target", k=K), **common))
    graphs = llm.engine.runner.speculator.graphs
    assert graphs is not None and (4, 128) in graphs.prompt_keys, graphs.prompt_keys
    replayed, replay = [], graphs._replay
    graphs._replay = lambda n, q, tokens: replayed.append((n, q)) or replay(n, q, tokens)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens > 0 for o in outs)
    assert replayed[0] == (4, 128), replayed[:3]
