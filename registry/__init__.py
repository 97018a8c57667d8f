"""The model registry: which model class and which ModelState serve an HF architecture.

Resolution order for the ModelState (ARCHITECTURE.md): an explicit registry entry, then the
model's own declaration (a `model_state_cls` class attribute), then what the config says the
model is (cross-attention -> encoder-decoder, recurrent layers -> Mamba hybrid, a vision or
audio tower -> multimodal), else the default decoder.

Out-of-tree code calls `register_model(...)`, usually from a function exposed in the
`slotrunner.plugins` entry-point group; plugins are discovered on the first lookup.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from slotrunner.registry.table import FAMILY_STATES, IN_TREE, ArchEntry

logger = logging.getLogger(__name__)

PLUGIN_GROUP = "slotrunner.plugins"

_registry: dict[str, ArchEntry | tuple[Any, Any, Any]] = dict(IN_TREE)
_plugins_loaded = False


class UnknownArchitectureError(ValueError):
    pass


@dataclass(frozen=True)
class ResolvedArch:
    architecture: str
    model_cls: type
    model_state_cls: type


def _import(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def register_model(
    architecture: str,
    model_cls: type | str,
    model_state_cls: type | str | None = None,
    tiny_config: Any = None,
    *,
    overwrite: bool = False,
) -> None:
    """Register (or, with overwrite=True, replace) an architecture.

    `model_cls` / `model_state_cls` may be classes or lazy "module:Class" strings;
    `tiny_config` is a zero-argument callable (or "module:function") returning a small HF config
    for the conformance suite.
    """
    if not isinstance(architecture, str) or not architecture:
        raise ValueError(f"architecture must be a non-empty string, got {architecture!r}")
    if architecture in _registry and not overwrite:
        raise ValueError(
            f"architecture {architecture!r} is already registered (by {_describe(_registry[architecture])}); "
            "pass overwrite=True to replace it"
        )
    if model_state_cls is not None and not isinstance(model_state_cls, str):
        from slotrunner.model_states.interface import ModelState

        if not (isinstance(model_state_cls, type) and issubclass(model_state_cls, ModelState)):
            raise TypeError(f"model_state_cls for {architecture!r} must subclass ModelState, got {model_state_cls!r}")
    _registry[architecture] = (model_cls, model_state_cls, tiny_config)


def _describe(entry: ArchEntry | tuple[Any, Any, Any]) -> str:
    model = entry.model if isinstance(entry, ArchEntry) else entry[0]
    return model if isinstance(model, str) else f"{model.__module__}:{model.__qualname__}"


def load_plugins() -> None:
    """Call every function in the `slotrunner.plugins` entry-point group once."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            ep.load()()
        except Exception as e:  # a broken plugin must not take the in-tree models down with it
            logger.warning("slotrunner plugin %r failed to load: %s", ep.name, e)


def supported_architectures() -> list[str]:
    load_plugins()
    return sorted(_registry)


def _entry(architecture: str) -> tuple[Any, Any, Any]:
    load_plugins()
    entry = _registry.get(architecture)
    if entry is None:
        raise UnknownArchitectureError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(_registry))}. "
            "Out-of-tree models register through slotrunner.registry.register_model or a "
            f"{PLUGIN_GROUP!r} entry point."
        )
    if isinstance(entry, ArchEntry):
        return entry.model, entry.model_state, entry.tiny_config
    return entry


def tiny_config(architecture: str, **overrides: Any) -> Any:
    """A small HF config for `architecture` (fields in `overrides` replaced), or raise if it
    registered none."""
    builder = _entry(architecture)[2]
    if builder is None:
        raise ValueError(f"architecture {architecture!r} registered no tiny config")
    return (_import(builder) if isinstance(builder, str) else builder)(**overrides)


def _family_from_config(hf_config: Any) -> str:
    if getattr(hf_config, "is_encoder_decoder", False):
        return "encoder_decoder"
    layer_kinds = set(getattr(hf_config, "layer_types", None) or ()) | set(getattr(hf_config, "layers_block_type", None) or ())
    if layer_kinds & {"mamba", "mamba2", "linear_attention", "hybrid", "M"} or getattr(hf_config, "model_type", "").startswith("mamba"):
        return "mamba_hybrid"
    if any(getattr(hf_config, k, None) is not None for k in ("vision_config", "audio_config")):
        return "multimodal"
    return "default"


def resolve(hf_config: Any, architecture: str | None = None) -> ResolvedArch:
    """Pick the model class and ModelState class for an HF config (its first architecture,
    unless `architecture` names one)."""
    if architecture is None:
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise UnknownArchitectureError(
                f"config has no 'architectures' field; supported: {', '.join(supported_architectures())}"
            )
        architecture = archs[0]
    model_ref, state_ref, _ = _entry(architecture)
    model_cls = _import(model_ref) if isinstance(model_ref, str) else model_ref
    if state_ref is not None:
        state_cls = _import(state_ref) if isinstance(state_ref, str) else state_ref
    elif getattr(model_cls, "model_state_cls", None) is not None:
        state_cls = model_cls.model_state_cls
    else:
        family = _family_from_config(hf_config)
        try:
            state_cls = _import(FAMILY_STATES[family])
        except ModuleNotFoundError:
            raise UnknownArchitectureError(
                f"architecture {architecture!r} belongs to the {family} family, which this version does not implement"
            ) from None
    return ResolvedArch(architecture, model_cls, state_cls)


def describe_architectures() -> list[tuple[str, str, str]]:
    """(architecture, model class, ModelState class) for every registered architecture; the
    ModelState column is resolved from the tiny config when the entry leaves it open."""
    rows = []
    for arch in supported_architectures():
        model_ref, state_ref, builder = _entry(arch)
        model_name = model_ref if isinstance(model_ref, str) else f"{model_ref.__module__}:{model_ref.__qualname__}"
        if state_ref is None and builder is not None:
            try:
                state_ref = resolve(tiny_config(arch), arch).model_state_cls
            except (ImportError, ValueError) as e:  # keep listing the others
                state_ref = f"unresolved ({e})"
        if state_ref is None:
            state = "resolved from the checkpoint's config"
        elif isinstance(state_ref, str):
            state = state_ref.rpartition(":")[2] if ":" in state_ref and " " not in state_ref else state_ref
        else:
            state = state_ref.__name__
        rows.append((arch, model_name.replace("slotrunner.models.", ""), state))
    return rows
