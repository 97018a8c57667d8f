"""Conformance against Hugging Face `transformers`: the harness behind tests/conformance/.

A case is a tiny random-weight HF model saved to a directory. The checks load that directory in
slotrunner and in transformers and compare:

- logits at every real position -- the prefill rows and every decode step -- within a
  tolerance of transformers' forward over the same token sequence;
- greedy tokens, margin-aware: where the two argmaxes differ, transformers' choice must be
  within tolerance of slotrunner's best logit (random tiny models have near-ties).

Everything here runs on CPU in float32 in well under a second per case.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

LOGITS_ATOL = 1e-4  # fp32; transformers' own kernels differ from each other by up to ~2e-5
LOGITS_RTOL = 1e-4


def perturb_constants(model: torch.nn.Module, seed: int = 0) -> None:
    """Multiply constant-initialised tensors (norm weights = 1, biases = 0) by (1 + N(0, 0.1))
    and add N(0, 0.02), so a bug that ignores them cannot hide behind their init values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.detach().flatten()
            if flat.numel() and bool((flat == flat[0]).all()):
                noise = torch.randn(p.shape, generator=gen)
                p.mul_(1 + 0.1 * noise.to(p.dtype)).add_(0.02 * torch.randn(p.shape, generator=gen).to(p.dtype))


def build_case(hf_config: Any, directory: str | Path, seed: int = 0) -> torch.nn.Module:
    """Instantiate `hf_config` in transformers with fixed seed, perturb constants, save it to
    `directory` (weights saved once: random init differs between transformers versions)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    perturb_constants(model, seed)
    model.eval()
    model.save_pretrained(str(directory))
    return model


@dataclass
class RecordedRun:
    """One request run alone through slotrunner: its tokens and the logits of every position."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    logits: torch.Tensor  # [prompt_len + num_output - 1, vocab]: row p predicts token p + 1


class LogitsRecorder:
    """Captures the hidden states of every forward of a single-request run, by position."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.rows: dict[int, torch.Tensor] = {}
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        positions = args[1]
        for pos, row in zip(positions.tolist(), out):
            self.rows[pos] = row.detach().clone()

    def logits(self) -> torch.Tensor:
        hidden = torch.stack([self.rows[p] for p in sorted(self.rows)])
        with torch.inference_mode():
            return self.model.compute_logits(hidden).float()

    def close(self) -> None:
        self._handle.remove()


def run_recorded(llm: Any, prompt_token_ids: list[int], max_tokens: int) -> RecordedRun:
    """Greedy-generate one prompt alone and record the logits at every position."""
    from slotrunner.sampling_params import SamplingParams

    model = llm.engine.runner.model
    recorder = LogitsRecorder(model)
    try:
        out = llm.generate(
            [{"prompt_token_ids": prompt_token_ids}],
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            use_tqdm=False,
        )[0]
        logits = recorder.logits()
    finally:
        recorder.close()
    tokens = out.outputs[0].token_ids
    # The last sampled token is never fed back, so its position has no row.
    expected_rows = len(prompt_token_ids) + len(tokens) - 1
    assert logits.shape[0] == expected_rows, f"recorded {logits.shape[0]} positions, expected {expected_rows}"
    return RecordedRun(prompt_token_ids, tokens, logits)


def hf_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits over one unpadded sequence: [len, vocab]."""
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        out = hf_model(input_ids=ids, position_ids=torch.arange(len(token_ids))[None])
    return out.logits[0].float()


def hf_greedy(hf_model: torch.nn.Module, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        seq = hf_model.generate(
            torch.tensor([prompt_token_ids]),
            attention_mask=torch.ones(1, len(prompt_token_ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return seq[0, len(prompt_token_ids) :].tolist()


@dataclass
class CheckResult:
    name: str
    passed: bool
    worst: float  # the largest deviation seen (logits: max |diff|; tokens: largest margin accepted)
    detail: str = ""


@dataclass
class CaseReport:
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def table(self) -> str:
        lines = [f"{'check':<28} {'result':<6} {'worst':>10}  detail"]
        for c in self.checks:
            lines.append(f"{c.name:<28} {'ok' if c.passed else 'FAIL':<6} {c.worst:>10.2e}  {c.detail}")
        return "\n".join(lines)


def compare_logits(name: str, ours: torch.Tensor, ref: torch.Tensor, atol: float = LOGITS_ATOL, rtol: float = LOGITS_RTOL) -> CheckResult:
    diff = (ours - ref).abs()
    bound = atol + rtol * ref.abs()
    bad = diff > bound
    worst = float(diff.max()) if diff.numel() else 0.0
    detail = f"{int(bad.sum())} of {bad.numel()} values out of tolerance" if bad.any() else f"{ref.shape[0]} positions"
    return CheckResult(name, not bool(bad.any()), worst, detail)


def compare_greedy(name: str, ours: list[int], ref: list[int], ref_logits: torch.Tensor, prompt_len: int, atol: float = LOGITS_ATOL) -> CheckResult:
    """Tokens equal, or at the first difference a near-tie in the reference's logits (then the
    continuations legitimately diverge and the comparison stops there)."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            row = ref_logits[prompt_len - 1 + i]
            margin = float(row[b] - row[a])
            ok = margin <= 2 * atol
            return CheckResult(name, ok, margin, f"diverge at step {i} ({a} vs {b}), reference margin {margin:.2e}")
    ok = len(ours) == len(ref)
    return CheckResult(name, ok, 0.0, f"{len(ours)} tokens equal" if ok else f"lengths {len(ours)} vs {len(ref)}")


def check_case(
    llm: Any,
    hf_model: torch.nn.Module,
    prompts: list[list[int]],
    max_tokens: int,
    atol: float = LOGITS_ATOL,
    rtol: float = LOGITS_RTOL,
) -> CaseReport:
    """Logits (prefill and decode, every position) and greedy tokens, one prompt at a time."""
    report = CaseReport()
    for i, prompt in enumerate(prompts):
        run = run_recorded(llm, prompt, max_tokens)
        seq = prompt + run.output_token_ids
        ref = hf_logits(hf_model, seq)[: len(seq) - 1]
        n = len(prompt)
        report.checks.append(compare_logits(f"prompt {i}: prefill logits", run.logits[:n], ref[:n], atol, rtol))
        report.checks.append(compare_logits(f"prompt {i}: decode logits", run.logits[n:], ref[n:], atol, rtol))
        hf_tokens = hf_greedy(hf_model, prompt, max_tokens)
        report.checks.append(compare_greedy(f"prompt {i}: greedy tokens", run.output_token_ids, hf_tokens, ref, n, atol))
    return report


# -- encoder-decoders -------------------------------------------------------------------------
# The decoder-only helpers above feed transformers `input_ids` alone; an encoder-decoder takes
# the encoder input (`input_ids` or `input_features`) plus `decoder_input_ids`.


def build_seq2seq_case(hf_config: Any, directory: str | Path, seed: int = 0) -> torch.nn.Module:
    """`build_case` for encoder-decoders (text or speech). Constant *buffers* that checkpoints
    store (BART's zero `final_logits_bias`) are perturbed too, so a model that drops them fails."""
    import transformers

    torch.manual_seed(seed)
    auto = transformers.AutoModelForSeq2SeqLM
    if type(hf_config) in transformers.AutoModelForSpeechSeq2Seq._model_mapping:
        auto = transformers.AutoModelForSpeechSeq2Seq
    model = auto.from_config(hf_config, dtype=torch.float32)
    perturb_constants(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    saved = set(model.state_dict())
    with torch.no_grad():
        for name, buf in model.named_buffers():
            flat = buf.detach().flatten()
            if buf.is_floating_point() and name in saved and flat.numel() and bool((flat == flat[0]).all()):
                buf.add_(0.5 * torch.randn(buf.shape, generator=gen).to(buf.dtype))
    model.eval()
    model.save_pretrained(str(directory))
    return model


def run_recorded_prompt(llm: Any, prompt: Any, max_tokens: int) -> RecordedRun:
    """`run_recorded` for any prompt form (e.g. {"encoder_prompt": ..., "decoder_prompt": ...}):
    greedy-generate it alone; `prompt_token_ids` of the result are the request's own (decoder)
    prompt tokens."""
    from slotrunner.sampling_params import SamplingParams

    recorder = LogitsRecorder(llm.engine.runner.model)
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)[0]
        logits = recorder.logits()
    finally:
        recorder.close()
    prompt_ids, tokens = list(out.prompt_token_ids), out.outputs[0].token_ids
    expected_rows = len(prompt_ids) + len(tokens) - 1
    assert logits.shape[0] == expected_rows, f"recorded {logits.shape[0]} positions, expected {expected_rows}"
    return RecordedRun(prompt_ids, tokens, logits)


def hf_seq2seq_logits(hf_model: torch.nn.Module, encoder_kwargs: dict[str, torch.Tensor], decoder_ids: list[int]) -> torch.Tensor:
    """transformers' logits over one decoder sequence given one encoder input: [len, vocab]."""
    with torch.no_grad():
        out = hf_model(**encoder_kwargs, decoder_input_ids=torch.tensor([decoder_ids]))
    return out.logits[0].float()


def hf_seq2seq_greedy(
    hf_model: torch.nn.Module, encoder_kwargs: dict[str, torch.Tensor], decoder_prompt: list[int], max_tokens: int
) -> list[int]:
    """Greedy continuation by transformers' forward, one full pass per token (generate() adds
    model-specific logits processors -- Whisper's especially -- that are not the model)."""
    seq = list(decoder_prompt)
    for _ in range(max_tokens):
        seq.append(int(hf_seq2seq_logits(hf_model, encoder_kwargs, seq)[-1].argmax()))
    return seq[len(decoder_prompt) :]


def check_seq2seq_case(
    llm: Any,
    hf_model: torch.nn.Module,
    cases: list[tuple[Any, dict[str, torch.Tensor]]],  # (slotrunner prompt, transformers encoder kwargs)
    max_tokens: int,
    atol: float = LOGITS_ATOL,
    rtol: float = LOGITS_RTOL,
) -> CaseReport:
    """`check_case` for encoder-decoders: decoder logits at every position and greedy tokens,
    one request at a time."""
    report = CaseReport()
    for i, (prompt, encoder_kwargs) in enumerate(cases):
        run = run_recorded_prompt(llm, prompt, max_tokens)
        seq = run.prompt_token_ids + run.output_token_ids
        ref = hf_seq2seq_logits(hf_model, encoder_kwargs, seq)[: len(seq) - 1]
        n = len(run.prompt_token_ids)
        report.checks.append(compare_logits(f"prompt {i}: prefill logits", run.logits[:n], ref[:n], atol, rtol))
        report.checks.append(compare_logits(f"prompt {i}: decode logits", run.logits[n:], ref[n:], atol, rtol))
        hf_tokens = hf_seq2seq_greedy(hf_model, encoder_kwargs, run.prompt_token_ids, max_tokens)
        report.checks.append(compare_greedy(f"prompt {i}: greedy tokens", run.output_token_ids, hf_tokens, ref, n, atol))
    return report
