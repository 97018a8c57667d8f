"""Tiny random-weight configs per architecture: the conformance suite's test cases, as data.

Each builder returns a `transformers` config small enough to build, save and run on a CPU in
well under a second. `tie_word_embeddings=False` by default: tied random models repeat one
token forever and would make token comparisons vacuous.
"""

from __future__ import annotations

from typing import Any

_TEXT = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def _build(class_name: str, **fields: Any) -> Any:
    import transformers

    return getattr(transformers, class_name)(**{**_TEXT, **fields})


def llama(**overrides: Any) -> Any:
    return _build("LlamaConfig", num_hidden_layers=2, **overrides)


def mistral(**overrides: Any) -> Any:
    return _build("MistralConfig", num_hidden_layers=2, head_dim=16, sliding_window=6, **overrides)


def qwen2(**overrides: Any) -> Any:
    return _build("Qwen2Config", num_hidden_layers=2, **overrides)


def qwen3(**overrides: Any) -> Any:
    return _build("Qwen3Config", num_hidden_layers=2, head_dim=16, **overrides)
