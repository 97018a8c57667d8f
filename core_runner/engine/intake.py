"""Request intake: turn a user's prompt into validated token ids, or raise a clear ValueError.

Everything a user can get wrong about one request is caught here, before it reaches the
scheduler, so a bad prompt never disturbs other requests. The family's ModelState decides how
a prompt is read (`ModelState.process_prompt`); the helpers here are the shared pieces, and
`process_text_prompt` is what a plain decoder accepts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from slotrunner.sampling_params import SamplingParams

# A prompt: text, or {"prompt": text} / {"prompt_token_ids": [...]}, plus family fields
# (e.g. "multi_modal_data", "encoder_prompt") where the family accepts them.
PromptType = Union[str, Mapping[str, Any]]

TEXT_FIELDS = frozenset({"prompt", "prompt_token_ids"})


# Something a request's KV depends on besides its tokens, over the token span it touches:
# (first token, end token, key). A prefix-cache block's hash includes the keys of the spans
# that overlap it (core_runner/engine/block_hash.py).
KeySpan = tuple[int, int, str]


@dataclass(frozen=True)
class FamilyInputs:
    """Base for what a family's requests carry beyond the prompt tokens (encoder input
    features, media items, ...). Travels with the request to `ModelState.add_request`."""

    def cache_key_spans(self) -> tuple[KeySpan, ...]:
        """What the KV of each token span depends on beyond the tokens, for the prefix cache:
        a media item's content hash over its placeholder span, the encoder input's hash over
        every token. A family whose KV depends on its inputs must say so here, or requests
        with equal tokens but other inputs would share wrong KV."""
        return ()

    def encoder_prompt(self) -> tuple[str | None, list[int] | None]:
        """The encoder's prompt (its text when given as text, its token ids) for
        RequestOutput.encoder_prompt / encoder_prompt_token_ids; (None, None) without one."""
        return None, None


@dataclass(frozen=True)
class IntakeContext:
    """What intake may consult: never runner state (a request has no slot yet)."""

    tokenizer: Any | None
    processor: Any | None  # the HF processor / feature extractor saved with the model, if any
    hf_config: Any
    vocab_size: int
    max_model_len: int
    # The model class resolved for hf_config, once per engine: a family's intake reads its class
    # attributes (the multimodal family: `media_handler_cls`) instead of resolving per request.
    model_cls: type | None = None
    # The real path of the one directory media given as a local path may be read from (the
    # engine argument, checked by the builder); None: no local file is read.
    allowed_local_media_path: str | None = None


@dataclass(frozen=True)
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    family_inputs: FamilyInputs | None = None


def check_fields(prompt: PromptType, accepted: frozenset[str]) -> Mapping[str, Any]:
    """The prompt as a mapping; unknown fields are an error naming what the model accepts."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if not isinstance(prompt, Mapping):
        raise ValueError(f"a prompt is a string or a dict, got {type(prompt).__name__}")
    unknown = set(prompt) - accepted
    if unknown:
        # Media sent to a text-only model is the likely mistake: say so plainly.
        hint = " (it takes no media: this is not a multimodal model)" if "multi_modal_data" in unknown else ""
        raise ValueError(f"prompt has unsupported field(s) {sorted(unknown)}; this model takes {sorted(accepted)}{hint}")
    return prompt


def text_to_token_ids(text: Any, ctx: IntakeContext, add_special_tokens: bool = True) -> list[int]:
    if not isinstance(text, str):
        raise ValueError(f"'prompt' must be a string, got {type(text).__name__}")
    if ctx.tokenizer is None:
        raise ValueError("this model has no tokenizer: give prompts as {'prompt_token_ids': [...]}")
    if not text:
        raise ValueError("prompt is empty")
    return tokenize(ctx.tokenizer, text, add_special_tokens, "prompt")


def tokenize(tokenizer: Any, text: str, add_special_tokens: bool, what: str) -> list[int]:
    """Token ids of `text`; whatever the tokenizer raises becomes a ValueError naming `what`, so
    a caller rejecting bad input needs to catch one type only."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: no tokenizer can encode it
        raise ValueError(f"{what} is not valid Unicode: {text[e.start:e.end]!r} at position {e.start} ({e.reason})") from None
    try:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    except Exception as e:  # third-party code: any type
        raise ValueError(f"the tokenizer could not encode the {what}: {type(e).__name__}: {e}") from e


def validate_token_ids(token_ids: Any, ctx: IntakeContext, what: str = "prompt") -> list[int]:
    """Non-empty ints inside the vocabulary, leaving room for at least one output token."""
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
        raise ValueError(f"{what}_token_ids must be a list of ints")
    token_ids = list(token_ids)
    # Every token of every prompt passes here: the checks run in C (type set, min, max), the
    # per-token Python loops only for an odd prompt (int subclasses) or a bad one (0.2 us a token).
    if set(map(type, token_ids)) - {int} and not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise ValueError(f"{what}_token_ids must be a list of ints")
    if not token_ids:
        raise ValueError(f"{what} is empty (no tokens)")
    if min(token_ids) < 0 or max(token_ids) >= ctx.vocab_size:
        bad = [t for t in token_ids if not 0 <= t < ctx.vocab_size]
        raise ValueError(f"{what} token id(s) {bad[:5]} outside the vocabulary [0, {ctx.vocab_size})")
    if len(token_ids) >= ctx.max_model_len:
        raise ValueError(
            f"{what} has {len(token_ids)} tokens; max_model_len={ctx.max_model_len} leaves no room for output "
            f"(at most {ctx.max_model_len - 1} tokens)"
        )
    return token_ids


def process_text_prompt(prompt: PromptType, ctx: IntakeContext, accepted: frozenset[str] = TEXT_FIELDS) -> ProcessedPrompt:
    """A decoder prompt: text (tokenized with the model's tokenizer) or token ids."""
    fields = check_fields(prompt, accepted)
    text, token_ids = fields.get("prompt"), fields.get("prompt_token_ids")
    if text is None and token_ids is None:
        raise ValueError("prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    if token_ids is None:
        token_ids = text_to_token_ids(text, ctx)
    token_ids = validate_token_ids(token_ids, ctx)
    if text is not None:
        check_text_matches_ids(text, token_ids, ctx)
    return ProcessedPrompt(prompt=text, prompt_token_ids=token_ids)


def check_text_matches_ids(text: Any, token_ids: list[int], ctx: IntakeContext) -> None:
    """A prompt that gives both text and ids runs the ids and reports the text: they must say
    the same thing (with or without the tokenizer's special tokens: a chat template writes its
    own). Without a tokenizer the text cannot be checked and is only carried along."""
    if not isinstance(text, str):
        raise ValueError(f"'prompt' must be a string, got {type(text).__name__}")
    if ctx.tokenizer is None:
        return
    for add_special_tokens in (False, True):
        if tokenize(ctx.tokenizer, text, add_special_tokens, "prompt") == token_ids:
            return
    raise ValueError(
        "the prompt's 'prompt' text and 'prompt_token_ids' disagree (tokenizing the text gives other ids): "
        "give one of them, or ids that encode the text"
    )


def check_sampling_params(params: Any, ctx: IntakeContext) -> SamplingParams:
    """The engine's own copy of `params`, validated again (the object may have been changed
    since it was built) and with its token ids checked against the model's vocabulary."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    params.validate()
    params = params.clone()  # a later change to the user's object must not reach the request
    for name, ids in (
        ("logit_bias", params.logit_bias),
        ("allowed_token_ids", params.allowed_token_ids),
        ("stop_token_ids", params.stop_token_ids),
    ):
        outside = sorted({t for t in ids or () if t >= ctx.vocab_size})
        if outside:
            raise ValueError(f"{name} has token id(s) {outside[:5]} outside the vocabulary [0, {ctx.vocab_size})")
    if params.stop_strings and ctx.tokenizer is None:
        raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
    if params.bad_words and ctx.tokenizer is None:
        raise ValueError("bad_words need a tokenizer; this model has none")
    return params
