"""Request intake: turn a user's prompt into validated token ids, or raise a clear ValueError.

Everything a user can get wrong about one request is caught here, before it reaches the
scheduler, so a bad prompt never disturbs the other requests of the same call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from slotrunner.sampling_params import SamplingParams

# A prompt: text, or {"prompt": text} / {"prompt_token_ids": [...]}.
PromptType = Union[str, Mapping[str, Any]]


@dataclass(frozen=True)
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


def process_prompt(
    prompt: PromptType,
    params: SamplingParams,
    tokenizer: Any | None,
    vocab_size: int,
    max_model_len: int,
) -> ProcessedPrompt:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    text: str | None
    if isinstance(prompt, str):
        text, token_ids = prompt, None
    elif isinstance(prompt, Mapping):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown:
            raise ValueError(
                f"prompt has unsupported field(s) {sorted(unknown)}; this model takes 'prompt' or 'prompt_token_ids'"
            )
        text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if text is None and token_ids is None:
            raise ValueError("prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    else:
        raise ValueError(f"a prompt is a string or a dict, got {type(prompt).__name__}")

    if token_ids is None:
        if not isinstance(text, str):
            raise ValueError(f"'prompt' must be a string, got {type(text).__name__}")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: give prompts as {'prompt_token_ids': [...]}")
        if not text:
            raise ValueError("prompt is empty")
        token_ids = tokenizer(text)["input_ids"]
    else:
        token_ids = list(token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            raise ValueError("prompt_token_ids must be a list of ints")
    if not token_ids:
        raise ValueError("prompt is empty (no tokens)")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(token_ids)} tokens; max_model_len={max_model_len} leaves no room for output "
            f"(a prompt may have at most {max_model_len - 1} tokens)"
        )
    if params.stop_strings and tokenizer is None:
        raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
    return ProcessedPrompt(prompt=text, prompt_token_ids=token_ids)
