"""Tiny random-weight configs of the plugin's architectures: what the conformance harness builds.

Untied heads by default (a tied random model repeats one token, which makes token checks
vacuous); token ids 0..2 are the special ones, as in slotrunner's own tiny configs.
"""

from __future__ import annotations

from typing import Any


def gpt2(**overrides: Any) -> Any:
    import transformers

    fields = dict(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    return transformers.GPT2Config(**{**fields, **overrides})


def rwkv(**overrides: Any) -> Any:
    import transformers

    fields = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, context_length=256, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    return transformers.RwkvConfig(**{**fields, **overrides})
