"""Conformance against Hugging Face `transformers`: the one harness behind
`python -m slotrunner conformance`, the suites in tests/conformance/ and plugin authors' tests.

A case is a model directory that both slotrunner and transformers (the oracle) read: a tiny
random-weight model saved by transformers, or a real checkpoint. The checks:

- logits at every prefill and decode position of each request run alone, within a tolerance
  of transformers' forward over the same tokens;
- greedy tokens, margin-aware: where the argmaxes differ, transformers' token must be within
  tolerance of slotrunner's best (random tiny models have near-ties);
- chunked prefill: a prompt prefilled a few tokens per step gives the same logits;
- batch invariance: each request of a mixed batch (greedy and seeded sampling, chunked prefill,
  requests joining and leaving, preemption) yields the tokens and logits it yields alone.

Each check returns a CheckResult with the worst deviation seen; a CaseReport prints them as a
table (both, the tolerances and the comparisons: `conformance_checks.py`). A tiny case runs single-threaded on CPU in float32 in a few seconds.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slotrunner.conformance_oracle import (  # noqa: F401  re-exported: the harness's public names
    ConformanceError,
    perturb_constants,
    transformers_class,
    build_case,
    build_seq2seq_case,
    ConformanceRequest,
    hf_logits,
    hf_greedy,
    hf_seq2seq_logits,
    hf_seq2seq_greedy,
    CausalLMOracle,
    Seq2SeqOracle,
    PerturbedOracle,
    floor_oracle,
    floor_method,
)
from slotrunner.conformance_checks import (  # noqa: F401  re-exported
    LOGITS_ATOL,
    LOGITS_RTOL,
    NOISE_FACTOR,
    CheckResult,
    CaseReport,
    compare_logits,
    first_divergence,
    compare_greedy,
    merge,
)
from slotrunner.conformance_recorder import (  # noqa: F401
    RecordedRun,
    LogitsRecorder,
    run_batch,
    greedy_params,
    run_recorded_prompt,
    run_recorded,
)

PROMPT_LENS = (1, 5, 13, 37)  # alone runs: one token, within a block, several blocks, many
MAX_TOKENS = 12
CHUNK_BUDGETS = (1, 2, 3, 5)  # tokens per step: chunk boundaries at every offset of a 4-token block
MAX_MODEL_LEN = 64
BLOCK_SIZE = 4  # small, so that every prompt spans several KV blocks
TINY_PARAMS = 10_000_000  # below this, one intra-op thread is faster than several


def noise_floor(floor_oracle: Any | None, request: ConformanceRequest, token_ids: list[int], ref: torch.Tensor) -> float | None:
    """The oracle's own float32 noise on this sequence: max |ref - floor_oracle's logits| (`ref`:
    the oracle's logits), where
    `floor_oracle` is the oracle in float64 or perturbed by one ulp (`conformance_oracle.floor_oracle`);
    None when none is given (tiny cases)."""
    if floor_oracle is None:
        return None
    return float((ref - floor_oracle.logits(request, token_ids)[: ref.shape[0]]).abs().max())


# -- the checks -------------------------------------------------------------------------------


def check_requests(
    llm: Any, oracle: Any, requests: Sequence[ConformanceRequest], max_tokens: int = MAX_TOKENS,
    atol: float = LOGITS_ATOL, rtol: float = LOGITS_RTOL, floor_oracle: Any | None = None,
) -> list[CheckResult]:
    """Each request alone: prefill logits, decode logits and greedy tokens against the oracle,
    one result per request and kind ("request 2: decode logits"). With `floor_oracle` each is
    judged against the oracle's measured float32 noise (`noise_floor`)."""
    results = []
    for i, req in enumerate(requests):
        run = run_recorded_prompt(llm, req.prompt, max_tokens)
        seq = run.prompt_token_ids + run.output_token_ids
        ref = oracle.logits(req, seq)[: len(seq) - 1]
        n = len(run.prompt_token_ids)
        floor = noise_floor(floor_oracle, req, seq, ref)
        hf_tokens = oracle.greedy(req, run.prompt_token_ids, max_tokens)
        results.append(compare_logits(f"request {i}: prefill logits", run.logits[:n], ref[:n], atol, rtol, floor))
        results.append(compare_logits(f"request {i}: decode logits", run.logits[n:], ref[n:], atol, rtol, floor))
        results.append(compare_greedy(f"request {i}: greedy tokens", run.output_token_ids, hf_tokens, ref, n, atol, floor))
    return results


def check_case(
    llm: Any, hf_model: torch.nn.Module, prompts: list[list[int]], max_tokens: int,
    atol: float = LOGITS_ATOL, rtol: float = LOGITS_RTOL,
) -> CaseReport:
    """`check_requests` for token-id prompts to a decoder-only model."""
    requests = [ConformanceRequest({"prompt_token_ids": p}) for p in prompts]
    return CaseReport(check_requests(llm, CausalLMOracle(hf_model), requests, max_tokens, atol, rtol))


def check_chunked_prefill(
    make_llm: Callable[..., Any], oracle: Any, request: ConformanceRequest, budgets: Sequence[int] = CHUNK_BUDGETS,
    max_tokens: int = 3, atol: float = LOGITS_ATOL, rtol: float = LOGITS_RTOL, floor_oracle: Any | None = None,
) -> list[CheckResult]:
    """One request prefilled `budget` tokens per step: every chunk must continue from what the
    previous one left (KV cache, recurrent state), so its logits equal the oracle's."""
    results = []
    floors: dict[tuple[int, ...], float | None] = {}
    for budget in budgets:
        llm = make_llm(max_num_seqs=1, max_num_batched_tokens=budget)
        run = run_recorded_prompt(llm, request.prompt, max_tokens)
        seq = run.prompt_token_ids + run.output_token_ids
        ref = oracle.logits(request, seq)[: len(seq) - 1]
        if tuple(seq) not in floors:
            floors[tuple(seq)] = noise_floor(floor_oracle, request, seq, ref)
        results.append(compare_logits(f"budget {budget}", run.logits, ref, atol, rtol, floors[tuple(seq)]))
    return results


@dataclass(frozen=True)
class BatchVariant:
    """One way of running the mixed batch: engine arguments, and whether it must preempt."""

    name: str
    engine_args: Mapping[str, Any]
    must_preempt: bool = False
    twice: bool = False  # run the batch twice on one engine and check the second run (prefix-cache hits)


def batch_variants(
    max_model_len: int = MAX_MODEL_LEN, kv_cache_windows: tuple[int | None, ...] = (None,)
) -> tuple[BatchVariant, ...]:
    """All at once; a 5-token budget with 3 slots (chunked prefill, requests finishing and
    joining, slots reused); a KV cache of exactly one max_model_len request in 2-token blocks
    (in the model's KV-cache groups, `EngineConfig.kv_cache_windows`: a sliding-window group
    needs only its window's blocks), so that concurrent requests run out of blocks and are
    preempted; and that again with async scheduling (each step scheduled before the previous
    step's tokens are known), which the GPU runs by default."""
    from slotrunner.core_runner.config import blocks_to_hold

    one_request = blocks_to_hold(kv_cache_windows, 2, max_model_len, 16)
    scarce = {"max_num_seqs": 6, "max_num_batched_tokens": 16, "block_size": 2, "num_kv_blocks": one_request}
    # Prefix caching on where the family supports it (None: the engine's default), so a
    # re-admitted request takes its own cached blocks; the alone runs compute every position.
    cached = {"enable_prefix_caching": None}
    return (
        BatchVariant("all at once", {"max_num_seqs": 16, **cached}),
        BatchVariant("chunked, joining", {"max_num_seqs": 3, "max_num_batched_tokens": 5, **cached}),
        BatchVariant("preempting", {**scarce, **cached}, must_preempt=True),
        BatchVariant("async, preempting", {**scarce, "async_scheduling": True, **cached}, must_preempt=True),
        # A cache for 16 requests of max_model_len: every block of the first run stays cached for
        # the second (the default size, max_num_seqs requests' worth, would evict long prompts').
        # Recurrent hybrids likewise keep 16 state checkpoints (one per prompt here) instead of
        # max_num_seqs, which a second run in the same order would overwrite one by one.
        BatchVariant(
            "prefix-cached, twice",
            {"max_num_seqs": 3, "max_num_batched_tokens": 5, "num_kv_blocks": 16 * -(-max_model_len // BLOCK_SIZE),
             "num_state_checkpoints": 16, **cached},  # fmt: skip
            twice=True,
        ),
    )


def _compare_runs(
    name: str, got: RecordedRun, alone: RecordedRun, greedy: bool, atol: float, rtol: float, floor: float | None = None
) -> CheckResult:
    """A batched run against the same request alone: equal tokens (a greedy row may diverge at
    a near-tie of the alone logits) and logits within tolerance up to any divergence."""
    ours, theirs = got.output_token_ids, alone.output_token_ids
    i = first_divergence(ours, theirs)
    if i is None and len(ours) != len(theirs):
        return CheckResult(name, False, float("inf"), f"{len(ours)} tokens, alone {len(theirs)}")
    n = len(alone.prompt_token_ids)
    first = got.first_position  # positions before it came from the prefix cache: not recomputed
    rows = got.logits.shape[0] if i is None else n + i - first
    result = compare_logits(name, got.logits[:rows], alone.logits[first : first + rows], atol, rtol, floor)
    if i is None or not result.passed:
        return result
    margin = float(alone.logits[n - 1 + i, theirs[i]] - alone.logits[n - 1 + i, ours[i]])
    detail = f"token {i} is {ours[i]}, alone {theirs[i]} (alone margin {margin:.2e})"
    tol = max(atol, NOISE_FACTOR * (floor or 0.0))
    return CheckResult(name, greedy and margin <= 2 * tol, max(result.worst, margin), detail, floor)


def check_batch_invariance(
    make_llm: Callable[..., Any], prompts: Sequence[Any], params: Sequence[Any],
    variants: Sequence[BatchVariant] | None = None, atol: float = LOGITS_ATOL, rtol: float = LOGITS_RTOL,
    on_engine: Callable[[Any], None] | None = None, max_model_len: int = MAX_MODEL_LEN, floor: float | None = None,
) -> list[CheckResult]:
    """Each variant runs every request together, in a shuffled order; each request must equal
    its run alone. One result per variant. `on_engine(llm)` sees each batched engine before it
    runs (a test may instrument it), and the alone runs use one engine with one slot.

    A variant that must preempt but did not (short requests fit the scarce cache side by side)
    runs again with every request generating up to `max_model_len`: then any two running
    requests together need more than the cache, so one is preempted; only if even that does not
    preempt does the variant fail. `floor` (a real checkpoint's measured float32 noise) widens
    the logits tolerance to NOISE_FACTOR x floor, as for the oracle checks."""
    solo = make_llm(max_num_seqs=1)
    variants = batch_variants(max_model_len, solo.config.kv_cache_windows) if variants is None else variants
    alone = [run_batch(solo, [p], [sp])[0] for p, sp in zip(prompts, params)]
    order = list(range(len(prompts)))
    random.Random(0).shuffle(order)
    long: tuple[list[Any], list[RecordedRun]] | None = None  # lengthened params and their alone runs

    def run_variant(variant: BatchVariant, params: Sequence[Any], alone: Sequence[RecordedRun]) -> tuple[CheckResult, Any, list[RecordedRun]]:
        llm = make_llm(**variant.engine_args)
        if on_engine is not None:
            on_engine(llm)
        runs = run_batch(llm, [prompts[i] for i in order], [params[i] for i in order])
        if variant.twice:
            runs = run_batch(llm, [prompts[i] for i in order], [params[i] for i in order])
        per_request = [
            _compare_runs(f"request {i}", run, alone[i], params[i].temperature == 0, atol, rtol, floor)
            for i, run in zip(order, runs)
        ]
        return merge(f"batch: {variant.name}", per_request), llm, runs

    results = []
    for variant in variants:
        result, llm, runs = run_variant(variant, params, alone)
        preemptions = llm.engine.scheduler.num_preemptions
        lengthened = False
        if variant.must_preempt and preemptions == 0:
            if long is None:
                long_params = [
                    dataclasses.replace(sp, max_tokens=max(sp.max_tokens, max_model_len - len(run.prompt_token_ids)))
                    for sp, run in zip(params, alone)
                ]
                long = long_params, [run_batch(solo, [p], [sp])[0] for p, sp in zip(prompts, long_params)]
            result, llm, runs = run_variant(variant, *long)
            preemptions, lengthened = llm.engine.scheduler.num_preemptions, True
        hits = sum(run.num_cached_tokens for run in runs)
        if variant.must_preempt and preemptions == 0:
            detail = f"no request was preempted, even with every request generating up to max_model_len={max_model_len}"
            result = CheckResult(result.name, False, result.worst, detail, floor)
        elif variant.twice and llm.config.enable_prefix_caching and hits == 0:
            result = CheckResult(result.name, False, result.worst, "the second run took nothing from the prefix cache", floor)
        elif variant.twice and not llm.config.enable_prefix_caching and result.passed:
            result.detail = "prefix caching is off for this family: recomputed"
        elif result.passed:
            result.detail = f"{len(prompts)} requests" + (f", {preemptions} preemptions" if preemptions else "")
            result.detail += " (run to max_model_len to force them)" if lengthened else ""
            result.detail += f", {hits} cached tokens" if hits else ""
        results.append(result)
    return results


# -- the whole run: what `python -m slotrunner conformance` does ------------------------------


@dataclass
class Case:
    """A model directory with its oracle and the requests both are given."""

    architecture: str
    directory: Path
    oracle: Any  # CausalLMOracle | Seq2SeqOracle
    requests: list[ConformanceRequest]  # run alone, against the oracle; the last (longest) also in chunks
    batch_prompts: list[Any]  # the mixed batch
    batch_params: list[Any]
    max_model_len: int = MAX_MODEL_LEN
    # For a real checkpoint, the oracle in float64 (or perturbed by one ulp): its distance from
    # the oracle is the noise floor each check is judged against. None (tiny cases): the fixed
    # LOGITS_ATOL / LOGITS_RTOL.
    floor_oracle: Any | None = None
    engine_args: Mapping[str, Any] = field(default_factory=dict)  # for every engine (a GGUF file: dequantized)

    def make_llm(self, **engine_args: Any) -> Any:
        from slotrunner.llm import LLM

        # Caching off unless a variant asks: checks against the oracle need every position computed.
        args = dict(device="cpu", dtype="float32", block_size=BLOCK_SIZE, max_model_len=self.max_model_len, max_num_seqs=4,
                    enable_prefix_caching=False)
        return LLM(str(self.directory), **(args | dict(self.engine_args) | engine_args))


def check_token_inputs(hf_config: Any, architecture: str) -> None:
    """A tiny case gets token-id requests: refuse, before building anything, a model whose
    requests need images or audio (a checkpoint's processor builds those: `checkpoint_case`)."""
    from slotrunner.conformance_media import takes_media

    if takes_media(hf_config, architecture):
        raise ConformanceError(
            f"{architecture} takes images or audio, and a tiny case has no processor to build them: save the model "
            "with its processor and give it with --model, or build the requests in your own test (see tests/conformance/)"
        )


def _requests_for(hf_config: Any, max_model_len: int) -> tuple[list[ConformanceRequest], list[Any], list[Any]]:
    """Token-id requests: the alone ones (PROMPT_LENS long) and a mixed batch of 8 (greedy and
    seeded sampling, prompts of 1..30 tokens, 4..12 output tokens). Encoder-decoders get an
    encoder prompt of 1..63 tokens and a decoder prefix of 0..20."""
    from slotrunner.sampling_params import SamplingParams

    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    rng = random.Random(0)
    token = lambda: rng.randrange(3, text_config.vocab_size)  # noqa: E731 - ids 0..2 are often special
    seq2seq = bool(getattr(hf_config, "is_encoder_decoder", False))

    def prompt(length: int, encoder_len: int) -> tuple[Any, dict[str, torch.Tensor]]:
        ids = [token() for _ in range(length)]
        if not seq2seq:
            return {"prompt_token_ids": ids}, {}
        encoder = [token() for _ in range(encoder_len)]
        p: dict[str, Any] = {"encoder_prompt": {"prompt_token_ids": encoder}}
        if ids:
            p["decoder_prompt"] = {"prompt_token_ids": ids}
        return p, {"input_ids": torch.tensor([encoder])}

    # Decoder prompts of an encoder-decoder are short (a prefix); their encoders are long.
    lens = [(0, 1), (2, 5), (0, 23), (6, 60)] if seq2seq else [(n, 0) for n in PROMPT_LENS]
    requests = [ConformanceRequest(*prompt(n, e)) for n, e in lens if n + MAX_TOKENS <= max_model_len and e <= max_model_len]
    batch_prompts, batch_params = [], []
    for i in range(8):
        length = rng.choice([0, 3, 12, 20] if seq2seq else [1, 2, 5, 9, 17, 23, 30])
        batch_prompts.append(prompt(length, rng.choice([1, 3, 17, 40, 63]))[0])
        temperature = 0.0 if i % 2 == 0 else 0.9
        batch_params.append(SamplingParams(temperature=temperature, seed=1000 + i, max_tokens=rng.randrange(4, 13), ignore_eos=True))
    return requests, batch_prompts, batch_params


def _make_case(architecture: str, directory: Path, hf_model: torch.nn.Module, max_model_len: int) -> Case:
    config = hf_model.config
    requests, batch_prompts, batch_params = _requests_for(config, max_model_len)
    oracle = Seq2SeqOracle(hf_model) if getattr(config, "is_encoder_decoder", False) else CausalLMOracle(hf_model)
    return Case(architecture, directory, oracle, requests, batch_prompts, batch_params, max_model_len)


def tiny_case(architecture: str, directory: str | Path, hf_config: Any = None, seed: int = 0) -> Case:
    """Save a tiny random-weight `architecture` to `directory`: from `hf_config`, else from the
    tiny config the architecture registered."""
    import copy

    from slotrunner import registry

    if hf_config is None:
        hf_config = registry.tiny_config(architecture)  # for an unknown name, lists the registered ones
    elif architecture not in registry.supported_architectures():
        raise ConformanceError(
            f"architecture {architecture!r} is not registered; register it (register_model or a "
            f"{registry.PLUGIN_GROUP!r} entry point) before checking it"
        )
    check_token_inputs(hf_config, architecture)  # a clear error before anything is built
    hf_config = copy.deepcopy(hf_config)
    hf_config.architectures = [architecture]  # what slotrunner resolves from the saved config.json
    hf_model = build_case(hf_config, directory, seed)
    return _make_case(architecture, Path(directory), hf_model, MAX_MODEL_LEN)


def checkpoint_case(directory: str | Path, architecture: str | None = None, floor: str | None = "auto") -> Case:
    """A real checkpoint -- a model directory (config.json + safetensors) or a GGUF file (or a
    directory holding one) -- that transformers loads as the oracle from the same files. A model
    that takes images or audio gets them in its requests, built with the processor saved
    beside it (`conformance_media`).
    `floor`: how the noise floor each check is judged against is measured -- "float64" (the
    oracle in float64: transformers' own float32 error), "ulp" (the oracle with its weights
    moved by one ulp: no copy of the model), None (no floor: the fixed tolerances), or "auto":
    None for a tiny model (TINY_PARAMS), else float64 where a float64 copy fits in half the
    available memory, else ulp.
    A GGUF file runs dequantized in slotrunner, as transformers runs it."""
    from slotrunner.conformance_gguf import gguf_checkpoint_config, gguf_file_of, load_gguf_oracle
    from slotrunner.conformance_media import media_requests, takes_media
    from slotrunner.core_runner.loader.checkpoint import load_hf_config

    gguf = gguf_file_of(directory)
    hf_config = gguf_checkpoint_config(gguf) if gguf is not None else load_hf_config(directory)
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ConformanceError(f"{directory}/config.json names no 'architectures'")
    if architecture is not None and archs[0] != architecture:
        raise ConformanceError(f"{directory} holds a {archs[0]}, not a {architecture}")
    media = gguf is None and takes_media(hf_config, archs[0])
    if gguf is not None:
        hf_model = load_gguf_oracle(gguf, archs[0])
    else:
        hf_model = transformers_class(archs[0]).from_pretrained(str(directory), dtype=torch.float32).eval()
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    limit = int(
        getattr(text_config, "max_position_embeddings", None) or getattr(text_config, "max_target_positions", None)
        or MAX_MODEL_LEN
    )  # fmt: skip
    if media:  # requests from the checkpoint's own processor; a real image is hundreds of tokens
        oracle, requests, batch_prompts, batch_params, longest = media_requests(
            directory, hf_config, hf_model, min(MAX_MODEL_LEN, limit), MAX_TOKENS
        )
        max_model_len = min(limit, max(MAX_MODEL_LEN, longest + MAX_TOKENS))
        case = Case(archs[0], Path(directory), oracle, requests, batch_prompts, batch_params, max_model_len)
    else:
        case = _make_case(archs[0], gguf or Path(directory), hf_model, min(MAX_MODEL_LEN, limit))
    if gguf is not None:
        case.engine_args = {"quantized_weights": "dequantized"}
    if floor == "auto":
        floor = floor_method(hf_model) if sum(p.numel() for p in hf_model.parameters()) >= TINY_PARAMS else None
    if floor is not None:
        case.floor_oracle = floor_oracle(case.oracle, floor)
    return case


@contextmanager
def single_thread() -> Iterator[None]:
    """Tiny shapes: a second intra-op thread only adds synchronisation, which on a busy small
    machine makes each op many times slower. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_case(
    case: Case, max_tokens: int = MAX_TOKENS, atol: float = LOGITS_ATOL, rtol: float = LOGITS_RTOL,
    on_engine: Callable[[Any], None] | None = None,
) -> CaseReport:
    """Every check, one table row per kind: logits and greedy tokens alone, chunked prefill,
    and the mixed batch run three ways (`on_engine` as in check_batch_invariance)."""
    alone = check_requests(case.make_llm(), case.oracle, case.requests, max_tokens, atol, rtol, case.floor_oracle)
    report = CaseReport()
    for kind in ("prefill logits", "decode logits", "greedy tokens"):
        report.checks.append(merge(kind, [r for r in alone if r.name.endswith(kind)]))
    chunked = check_chunked_prefill(case.make_llm, case.oracle, case.requests[-1], atol=atol, rtol=rtol, floor_oracle=case.floor_oracle)
    report.checks.append(merge("chunked prefill logits", chunked))
    # Batched against alone, both slotrunner: a real checkpoint's batches reorder float32 sums
    # as much as the oracle's float32 does, so the largest floor measured above applies.
    floor = max((r.floor for r in alone if r.floor is not None), default=None)
    report.checks += check_batch_invariance(
        case.make_llm, case.batch_prompts, case.batch_params, None, atol, rtol, on_engine,
        case.max_model_len, floor,
    )
    return report


def run_conformance(
    architecture: str, *, config: Any = None, model: str | Path | None = None, workdir: str | Path | None = None,
    max_tokens: int = MAX_TOKENS, atol: float = LOGITS_ATOL, rtol: float = LOGITS_RTOL, floor: str | None = "auto",
) -> CaseReport:
    """Check `architecture` against transformers: on a tiny random-weight case built from
    `config` (an HF config object, or a path to a config.json) or from its registered tiny
    config, saved in `workdir` (default: a temporary directory); or on the checkpoint in
    `model`. `floor` measures the noise floor as `checkpoint_case` does ("auto": only for a
    model that is not tiny). Returns the report; `report.passed` says whether every check passed."""
    import tempfile
    from contextlib import ExitStack

    if model is not None:
        if config is not None:
            raise ConformanceError("give a config for a tiny case or a model directory, not both")
        case = checkpoint_case(model, architecture, floor)
        tiny = sum(p.numel() for p in case.oracle.hf_model.parameters()) < TINY_PARAMS
        with single_thread() if tiny else nullcontext():
            return run_case(case, max_tokens, atol, rtol)
    if isinstance(config, (str, Path)):
        config = config_from_json(architecture, config)
    with ExitStack() as stack:
        stack.enter_context(single_thread())
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="slotrunner-conformance-"))
        Path(workdir).mkdir(parents=True, exist_ok=True)
        case = tiny_case(architecture, workdir, config)
        if floor not in ("auto", None):
            case.floor_oracle = floor_oracle(case.oracle, floor)
        return run_case(case, max_tokens, atol, rtol)


def config_from_json(architecture: str, path: str | Path) -> Any:
    """An HF config from a config.json-style file, read by `architecture`'s config class."""
    import json

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConformanceError(f"cannot read the config {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ConformanceError(f"{str(path)!r} must hold a JSON object of config fields")
    return transformers_class(architecture).config_class.from_dict(data)
