"""The model registry: which model class and which ModelState serve an HF architecture.

Resolution order for the ModelState: the registry entry (every in-tree entry names one), then
the model's own declaration (a `model_state_cls` class attribute), else the default decoder.
The config is never sniffed for a family. The model class is then checked against what the
ModelState requires of its model (`ModelState.model_protocol`).

Out-of-tree code calls `register_model(...)`, usually from a function exposed in the
`slotrunner.plugins` entry-point group; plugins are discovered on the first lookup. A plugin
that fails to load is logged and skipped: it cannot take the other architectures down. Its
classes are imported only when its architecture is resolved, and checked then (a model class
that lacks `compute_logits` / `load_weights` or a member its family's protocol requires, a
ModelState that is not one), so a mistake
surfaces as a message naming the registered class, not as an error inside a step.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import torch

from slotrunner.registry.table import DEFAULT, GGUF_READERS, IN_TREE, TRANSFORMERS_GGUF_NAMES, ArchEntry

logger = logging.getLogger(__name__)

PLUGIN_GROUP = "slotrunner.plugins"

_registry: dict[str, ArchEntry | tuple[Any, Any, Any]] = dict(IN_TREE)
_sources: dict[str, str] = {}  # architecture -> who registered it, when not in-tree
_plugins_loaded = False
_loading_plugin: str | None = None  # the entry point being loaded, for messages

# What the runner calls on every model (besides forward(input_ids, positions, **inputs)).
MODEL_METHODS = ("compute_logits", "load_weights")


class UnknownArchitectureError(ValueError):
    pass


@dataclass(frozen=True)
class ResolvedArch:
    architecture: str
    model_cls: type
    model_state_cls: type


def _import(path: str, architecture: str | None = None, what: str = "class") -> Any:
    """Import "package.module:attr", saying which architecture registered it when that fails."""
    module, _, attr = path.partition(":")
    owner = f"the {what} registered for {architecture!r} as {path!r}" if architecture else repr(path)
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"cannot import {owner}: {type(e).__name__}: {e}") from e
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise ImportError(f"cannot import {owner}: module {module!r} has no attribute {attr!r}") from None


def _check_ref(architecture: str, what: str, ref: Any) -> None:
    if isinstance(ref, str) and (ref.count(":") != 1 or not all(ref.partition(":")[::2])):
        raise ValueError(f"{what} for {architecture!r} must be a class or a 'package.module:Name' string, got {ref!r}")


def check_model_class(architecture: str, model_cls: Any) -> None:
    """The runner builds `model_cls(hf_config)`, loads it with `load_weights(weights)` and turns
    hidden states into logits with `compute_logits(hidden)`: say so here rather than fail later."""
    from torch import nn

    if not (isinstance(model_cls, type) and issubclass(model_cls, nn.Module)):
        raise TypeError(f"model class for {architecture!r} must be a torch.nn.Module subclass, got {model_cls!r}")
    missing = [m for m in MODEL_METHODS if not callable(getattr(model_cls, m, None))]
    if missing:
        raise TypeError(
            f"{model_cls.__qualname__} (model class of {architecture!r}) does not define {', '.join(missing)}: the "
            "runner calls compute_logits(hidden) -> logits and load_weights(weights) (see docs/adding_a_model.md)"
        )


def check_model_state_class(architecture: str, state_cls: Any) -> None:
    from slotrunner.core_runner.runner.model_state import ModelState

    if not (isinstance(state_cls, type) and issubclass(state_cls, ModelState)):
        raise TypeError(f"model_state_cls for {architecture!r} must subclass ModelState, got {state_cls!r}")


def check_model_protocol(architecture: str, model_cls: type, state_cls: type) -> None:
    """The family's ModelState calls its model through `state_cls.model_protocol`: a member the
    model class lacks is named here, not discovered inside a step."""
    from slotrunner.core_runner.runner.model_state import missing_members

    protocol = state_cls.model_protocol
    missing = missing_members(protocol, model_cls) if protocol is not None else []
    if missing:
        raise TypeError(
            f"{model_cls.__qualname__} (model class of {architecture!r}) lacks {', '.join(missing)}, which "
            f"{state_cls.__name__} requires of its model ({protocol.__qualname__}; see docs/adding_a_model.md)"
        )


def register_model(
    architecture: str,
    model_cls: type | str,
    model_state_cls: type | str | None = None,
    tiny_config: Any = None,
    *,
    overwrite: bool = False,
) -> None:
    """Register (or, with overwrite=True, replace) an architecture.

    `architecture` is the name transformers writes into config.json's `architectures` (that
    is how a checkpoint finds its model). `model_cls` / `model_state_cls` may be classes or lazy
    "package.module:Class" strings (imported and checked when the architecture is resolved);
    `tiny_config` is a callable taking keyword overrides (or "package.module:function")
    returning a small HF config for the conformance harness.
    """
    if not isinstance(architecture, str) or not architecture:
        raise ValueError(f"architecture must be a non-empty string, got {architecture!r}")
    if architecture in _registry and not overwrite:
        raise ValueError(
            f"architecture {architecture!r} is already registered ({describe_registration(architecture)}); "
            "register yours under another name, or pass overwrite=True to replace it"
        )
    _check_ref(architecture, "model_cls", model_cls)
    _check_ref(architecture, "model_state_cls", model_state_cls)
    _check_ref(architecture, "tiny_config", tiny_config)
    if not isinstance(model_cls, str):
        check_model_class(architecture, model_cls)
    if model_state_cls is not None and not isinstance(model_state_cls, str):
        check_model_state_class(architecture, model_state_cls)
    if tiny_config is not None and not isinstance(tiny_config, str) and not callable(tiny_config):
        raise TypeError(f"tiny_config for {architecture!r} must be callable or a 'package.module:function' string")
    _registry[architecture] = (model_cls, model_state_cls, tiny_config)
    _sources[architecture] = f"plugin {_loading_plugin}" if _loading_plugin else "registered by a register_model call"


def describe_registration(architecture: str) -> str:
    """Which model class serves `architecture`, and who registered it."""
    entry = _registry[architecture]
    model = entry.model if isinstance(entry, ArchEntry) else entry[0]
    name = model if isinstance(model, str) else f"{model.__module__}:{model.__qualname__}"
    return f"model {name}, " + _sources.get(architecture, "in-tree")


def load_plugins() -> None:
    """Call every function in the `slotrunner.plugins` entry-point group once."""
    global _plugins_loaded, _loading_plugin
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group=PLUGIN_GROUP):
        _loading_plugin = f"{ep.name!r} ({ep.value})"
        try:
            ep.load()()
        except Exception as e:  # a broken plugin must not take the in-tree models down with it
            logger.warning(
                "slotrunner plugin %s failed to load and is skipped (architectures it registered before "
                "failing stay): %s: %s", _loading_plugin, type(e).__name__, e,
            )
        finally:
            _loading_plugin = None


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
        raise ValueError(
            f"architecture {architecture!r} registered no tiny config: pass tiny_config= to register_model, "
            "or give the conformance command a config (--config tiny.json)"
        )
    return (_import(builder, architecture, "tiny config") if isinstance(builder, str) else builder)(**overrides)


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
    model_cls = _import(model_ref, architecture, "model class") if isinstance(model_ref, str) else model_ref
    check_model_class(architecture, model_cls)
    if state_ref is not None:
        state_cls = _import(state_ref, architecture, "ModelState") if isinstance(state_ref, str) else state_ref
        check_model_state_class(architecture, state_cls)
    elif getattr(model_cls, "model_state_cls", None) is not None:
        state_cls = model_cls.model_state_cls
        check_model_state_class(architecture, state_cls)
    else:
        state_cls = _import(DEFAULT)
    check_model_protocol(architecture, model_cls, state_cls)
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
            except Exception as e:  # noqa: BLE001 - a broken plugin entry must not hide the others
                state_ref = f"unresolved ({type(e).__name__}: {e})"
        if state_ref is None:
            state = "resolved from the checkpoint's config"
        elif isinstance(state_ref, str):
            state = state_ref.rpartition(":")[2] if ":" in state_ref and " " not in state_ref else state_ref
        else:
            state = state_ref.__name__
        rows.append((arch, model_name.replace("slotrunner.models.", ""), state))
    return rows


def in_tree_architectures() -> list[str]:
    """The architectures slotrunner itself registers (no plugins), sorted."""
    return sorted(IN_TREE)


def model_state_classes(in_tree_only: bool = False) -> list[type]:
    """The ModelState classes that serve the registered architectures (each once, in
    architecture order): the rows of the capability table. `in_tree_only` leaves plugins out."""
    archs = sorted(IN_TREE) if in_tree_only else supported_architectures()
    classes: dict[type, None] = {}
    for arch in archs:
        state_ref = _entry(arch)[1]
        if state_ref is None:
            try:
                state_ref = resolve(tiny_config(arch), arch).model_state_cls
            except Exception as e:  # noqa: BLE001 - a broken plugin entry must not hide the others
                logger.warning("capability table: %s skipped (%s: %s)", arch, type(e).__name__, e)
                continue
        cls = _import(state_ref, arch, "ModelState") if isinstance(state_ref, str) else state_ref
        classes[cls] = None
    # The default decoder first, then the other families by name.
    return sorted(classes, key=lambda c: (c.__name__ != "DefaultModelState", c.__name__))


def gguf_architectures() -> list[str]:
    """GGUF `general.architecture` values a reader is registered for."""
    return sorted(GGUF_READERS)


def gguf_reader(gguf_architecture: str | None) -> Any | None:
    """The reader of GGUF files of `gguf_architecture`, or None when none is registered."""
    ref = GGUF_READERS.get(gguf_architecture) if gguf_architecture is not None else None
    return _import(ref, gguf_architecture, "GGUF reader") if ref is not None else None


def read_gguf(path: str | os.PathLike[str], dtype: torch.dtype, pack: bool = False) -> Any:
    """Read a GGUF file's config, tokenizer and tensor table (not the data) through the reader
    registered for its `general.architecture`; the result has `.config`, `.tokenizer` and
    `.weights()`. With `pack`, `.weights()` yields the quantized matrices it can as
    `PackedWeight` (blocks for the native CPU kernel, `core_runner/cpu/packed.py`).

        checkpoint = read_gguf(default_model_path(), torch.bfloat16)  # config + tokenizer, ~0.5 s
        for hf_name, tensor in checkpoint.weights():  # dequantized one at a time
            ...

    Raises FileNotFoundError for a missing file and ValueError naming the file for one that is
    not GGUF, is truncated or corrupt, has an architecture no reader handles, or stores an
    unsupported tensor type.
    """
    from slotrunner.core_runner.loader.gguf_file import open_gguf

    path = os.fspath(path)
    gguf = open_gguf(path)
    arch = gguf.metadata.get("general.architecture")
    reader = gguf_reader(arch)
    if reader is None:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(gguf_architectures())}."
            + _oracle_note(arch)
        )
    return reader(gguf, path, dtype, pack=pack)


def _oracle_note(gguf_architecture: str | None) -> str:
    """Why a GGUF architecture with no reader here stays unread: when transformers' GGUF loader
    does not read it either, no oracle exists to check a reader against (the Hugging Face
    checkpoint is the way in); otherwise it is simply not done yet."""
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:
        return ""
    name = TRANSFORMERS_GGUF_NAMES.get(gguf_architecture or "", gguf_architecture)
    if name in GGUF_SUPPORTED_ARCHITECTURES:
        return " transformers reads it, so a reader can be added and checked against it; until then use the Hugging Face checkpoint."
    return (
        " transformers' GGUF loader does not read it either, so no reader could be checked against an oracle:"
        " use the Hugging Face checkpoint."
    )
