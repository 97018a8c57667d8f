"""Prompt forms by vLLM's names (`vllm.inputs`): typed dicts that `LLM.generate` and
`LLMEngine.add_request` take as they are, and the encoder-decoder pairing helper."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypedDict, Union

try:
    from typing import NotRequired
except ImportError:  # Python 3.10
    from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[Mapping[str, Any]]  # {"image": item or [items]} / {"audio": ...}


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text the ids encode, reported back in RequestOutput.prompt
    multi_modal_data: NotRequired[Mapping[str, Any]]


SingletonPrompt = Union[str, TextPrompt, TokensPrompt]


class ExplicitEncoderDecoderPrompt(TypedDict):
    """An encoder-decoder model's prompt: the encoder's input and the decoder's start (None:
    the decoder start token alone)."""

    encoder_prompt: SingletonPrompt
    decoder_prompt: SingletonPrompt | None


PromptType = Union[SingletonPrompt, ExplicitEncoderDecoderPrompt]


def zip_enc_dec_prompts(
    encoder_prompts: Iterable[SingletonPrompt],
    decoder_prompts: Iterable[SingletonPrompt | None],
    mm_processor_kwargs: Any = None,
) -> list[ExplicitEncoderDecoderPrompt]:
    """Pair encoder and decoder prompts, one ExplicitEncoderDecoderPrompt per pair (as zip():
    the shorter list decides how many)."""
    if mm_processor_kwargs:
        raise ValueError("mm_processor_kwargs are not supported: the processor's options come with the checkpoint")
    return [
        ExplicitEncoderDecoderPrompt(encoder_prompt=enc, decoder_prompt=dec)
        for enc, dec in zip(encoder_prompts, decoder_prompts)
    ]
