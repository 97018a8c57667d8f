"""DraftDecodeGraphs: the draft model's one-token forwards through persistent buffers, as a
CUDA-graph replay runs them (on the CPU, the forward runs over the buffers instead of a replay).

Guards against: a draft step replayed with stale inputs (a buffer reallocated, not rewritten),
a row's position, length, block-table row or cache slot written wrong, padding rows left with
a length or a slot (they would write into the cache or read another row's blocks), and the
eager fallback for batches past the largest captured size.
"""

from __future__ import annotations

import numpy as np
import torch

from slotrunner import LLM
from slotrunner.core_runner.attention.backend import AttentionMetadata
from slotrunner.core_runner.attention.forward_context import ForwardContext, forward_context
from slotrunner.core_runner.spec_decode.draft_graphs import DraftDecodeGraphs

from test_draft_model import dirs, baseline, draft_config, make_requests  # noqa: F401  (fixtures)


class BufferReplay(DraftDecodeGraphs):
    """No capture; a "replay" runs the draft over the real rows of the buffers, built only from
    what the buffers hold, and checks that the padding rows are empty."""

    def capture(self) -> None:
        self.padded = 0

    def _replay(self, n: int, rows: int) -> torch.Tensor:
        assert (self.seq_lens[rows:n] == 0).all() and (self.slot_mapping[rows:n] == -1).all(), "padding rows not empty"
        self.padded += n > rows
        seq = self.seq_lens[:rows]
        meta = AttentionMetadata(
            num_reqs=rows, num_tokens=rows, query_start_loc=self.query_start_loc[: rows + 1],
            query_start_loc_np=np.arange(rows + 1), seq_lens=seq, seq_lens_np=seq.numpy().copy(), max_query_len=1,
            max_seq_len=int(seq.max()), block_tables=self.block_tables[:rows], slot_mapping=self.slot_mapping[:rows],
        )  # fmt: skip
        with torch.inference_mode(), forward_context(ForwardContext(self.attn_backend, meta)):
            out = self.model(self.input_ids[:rows], self.positions[:rows], inputs_embeds=None)
        return torch.cat([out, out.new_zeros(n - rows, out.shape[1])])


def test_draft_steps_through_the_buffers_keep_every_draft_accepted(dirs, baseline):  # noqa: F811
    llm = LLM(str(dirs / "target"), device="cpu", max_model_len=64, block_size=4, max_num_seqs=8,
              speculative_config=draft_config(dirs / "target", k=4))  # fmt: skip
    runner = llm.engine.runner
    config, speculator = runner.config, runner.speculator
    # Sizes 1, 3, 6: two rows pad to 3, four or five to 6, more run eagerly.
    speculator.graphs = graphs = BufferReplay(
        speculator.model, runner.attn_backend, (1, 3, 6), config.max_num_seqs, config.max_num_blocks_per_req,
        config.max_model_len, runner.device,
    )  # fmt: skip
    graphs.capture()
    # Every replayed step's hidden states equal the eager forward's over the same rows (run
    # second: it rewrites the same K/V).
    replayed, checked = speculator._decode_forward, []

    def compare(inputs, rows, position, tokens):
        got = replayed(inputs, rows, position, tokens)
        if graphs.padded_size(rows.size) is not None:
            want = speculator._forward(inputs, rows, position, position + 1, tokens)[0]
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            checked.append(rows.size)
        return got

    speculator._decode_forward = compare
    prompts, params = make_requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in baseline]
    assert all(o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens > 0 for o in outs)
    assert graphs.replays == len(checked) > 0 and graphs.padded > 0, (graphs.replays, graphs.padded)
