"""Checkpoint names that may stand in for one another: shared and tied embeddings.

Encoder-decoder checkpoints store one embedding under several names, or only under some of
them: tied ones keep just `shared.weight` (no `lm_head.weight`, no per-stack `embed_tokens`);
untied ones store each separately, with different values. transformers decides by what the
file holds, not by `tie_word_embeddings` (which T5's config forces to True on load), and so do
we: each model parameter takes the first name of its alias list that the file has.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn


def resolve_aliases(
    weights: Iterable[tuple[str, torch.Tensor]],
    aliases: dict[str, tuple[str, ...]],  # model parameter -> checkpoint names, preferred first
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass other tensors through; hold aliased ones (a few embeddings) to the end, then yield
    each parameter from its preferred name present. Names of a group that lose are dropped."""
    aliased = {name for names in aliases.values() for name in names}
    held: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name in aliased:
            held[name] = tensor
        else:
            yield name, tensor
    for param, names in aliases.items():
        present = next((n for n in names if n in held), None)
        if present is not None:
            yield param, held[present]
        # else: the parameter stays unwritten and the loader names it as missing


def share_equal_parameters(model: nn.Module, groups: Iterable[tuple[str, ...]]) -> None:
    """After loading: within each group of same-shaped parameters, ones equal to the first are
    replaced by it, so a tied checkpoint costs one embedding in memory, not three."""
    modules = dict(model.named_modules())
    for names in groups:
        first_module, _, first_attr = names[0].rpartition(".")
        keep = getattr(modules[first_module], first_attr)
        for name in names[1:]:
            module_name, _, attr = name.rpartition(".")
            module = modules[module_name]
            param = getattr(module, attr)
            if param is not keep and param.shape == keep.shape and torch.equal(param, keep):
                setattr(module, attr, keep)
