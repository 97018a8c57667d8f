"""Loading the draft model of `speculative_config={"method": "draft_model", "model": ...}`.

The draft is opened, resolved and loaded the way the target is (any registered decoder, any
format), then checked against the target: a plain decoder family (its only per-request state is
the KV cache, which the runner indexes by the target's block ids), the same tokenizer (the
draft's token ids are the target's), and room for every position the target may reach. Each
failed check is a ValueError that says what to change; nothing of the engine exists yet.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slotrunner.core_runner.config import SpeculativeConfig
from slotrunner.core_runner.loader.hub import HubOptions, resolve_model_path
from slotrunner.core_runner.loader.model_loader import load_model
from slotrunner.core_runner.loader.source import open_model
from slotrunner.model_states.default import DefaultModelState
from slotrunner.registry import read_gguf, resolve


def load_draft_model(
    spec: SpeculativeConfig,
    target_tokenizer: Any | None,  # None: token-id prompts only (vocabulary sizes are compared)
    target_vocab_size: int,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str,
    pack: bool,
    seed: int,
    hub: HubOptions,
) -> nn.Module:
    path = resolve_model_path(spec.model, hub)
    source = open_model(path, dtype, load_format, pack=pack, read_gguf=read_gguf, skip_tokenizer=target_tokenizer is None)
    hf_config = source.hf_config
    arch = resolve(hf_config)
    where = f"speculative_config['model']={spec.model!r}"
    if not issubclass(arch.model_state_cls, DefaultModelState):
        raise ValueError(
            f"{where} is a {arch.model_state_cls.family} ({arch.architecture}); a draft model must be a plain decoder "
            "(its state only in the KV cache): pick a decoder-only text model"
        )
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    check_same_vocabulary(where, target_tokenizer, target_vocab_size, source.tokenizer, text_config.vocab_size)
    draft_max = getattr(text_config, "max_position_embeddings", None) or 2048
    if draft_max < max_model_len:
        raise ValueError(
            f"{where} handles {draft_max} positions (max_position_embeddings) but max_model_len is {max_model_len}: "
            f"lower max_model_len to {draft_max} or pick a draft model with a longer context"
        )
    return load_model(arch.model_cls, hf_config, source.weights, dtype, device, load_format, seed)


def check_same_vocabulary(
    where: str, target_tokenizer: Any | None, target_vocab_size: int, draft_tokenizer: Any | None, draft_vocab_size: int
) -> None:
    """ValueError unless the draft's token ids mean what the target's do: equal tokenizer
    vocabularies (token -> id) when both models have one, else equal vocabulary sizes. The
    draft's logits may be padded past the tokenizer (drafts are picked among the target's ids)."""
    if target_tokenizer is not None and draft_tokenizer is not None:
        target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if target_vocab != draft_vocab:
            differ = sorted(t for t in set(target_vocab) | set(draft_vocab) if target_vocab.get(t) != draft_vocab.get(t))
            raise ValueError(
                f"{where} does not share the target's tokenizer: {len(differ)} token(s) differ (e.g. {differ[:3]}); "
                "a draft model must use the target's vocabulary (same token -> id)"
            )
        if draft_vocab_size < len(draft_vocab):
            raise ValueError(f"{where} has {draft_vocab_size} logits for a tokenizer of {len(draft_vocab)} tokens")
        return
    if draft_vocab_size != target_vocab_size:
        raise ValueError(
            f"{where} has a vocabulary of {draft_vocab_size} tokens, the target {target_vocab_size}: a draft model must "
            "share the target's tokenizer"
        )
