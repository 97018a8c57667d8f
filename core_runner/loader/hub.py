"""Model names that are Hugging Face Hub repos, resolved to local files the way transformers does.

A name that is not an existing local path and reads as a repo id is looked up with
`huggingface_hub`: first in the local cache (`HF_HUB_CACHE`, or `download_dir`) at `revision`,
then, when the cache lacks it and the hub may be used (`HF_HUB_OFFLINE` unset), downloaded into
the cache. Forms:

    org/name                a checkpoint repo (config.json + safetensors), or a repo of GGUF files
                            holding exactly one
    org/name:Q4_K_M         the GGUF file of a repo whose name holds that quantization tag (vLLM's form)
    org/name/file.gguf      that GGUF file of the repo

Anything else that does not exist is a missing local path (FileNotFoundError, as before).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

# What a checkpoint repo needs downloaded: config, weights, tokenizer, processor, chat template.
_CHECKPOINT_FILES = ("*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja")
_TOKENIZER_FILES = ("tokenizer*", "vocab*", "merges.txt", "special_tokens_map.json", "added_tokens.json", "*.jinja",
                    "chat_template.json", "config.json")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


@dataclass(frozen=True)
class HubOptions:
    revision: str | None = None  # branch, tag or commit; None: "main"
    cache_dir: str | None = None  # None: huggingface_hub's cache (HF_HUB_CACHE)
    token: str | bool | None = None


def resolve_model_path(name: str | Path, hub: HubOptions = HubOptions(), what: str = "model") -> Path:
    """A local path for `name`: the path itself when it exists, else the Hub repo it names,
    from the cache or downloaded. `what` is "model" or "tokenizer" (only its files are fetched)."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    text = str(name)
    repo_id, gguf = _parse(text)
    if repo_id is None:
        raise FileNotFoundError(f"{what} path {text!r} does not exist")
    where = f"{what} {text!r} is not a local path, so it was looked up as a Hugging Face Hub repo"
    found = _from_cache(repo_id, gguf, hub, what)
    if found is not None:
        return found
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(
            f"{where}: the Hugging Face cache ({hub.cache_dir or constants.HF_HUB_CACHE}) holds no complete snapshot of it "
            f"at revision {hub.revision or 'main'!r}, and HF_HUB_OFFLINE is set, so nothing was downloaded. Download "
            f"it first (`hf download {repo_id}`), unset HF_HUB_OFFLINE, or give a local directory"
        )
    try:
        return _download(repo_id, gguf, hub, what)
    except Exception as e:  # huggingface_hub and its HTTP client (not found, gated, no network): any type
        raise FileNotFoundError(f"{where}, and downloading it failed: {type(e).__name__}: {e}") from e


def _parse(text: str) -> tuple[str | None, str | None]:
    """(repo id, GGUF selector: a file path in the repo, ":TAG", or None) of a name; (None, None)
    when it cannot be a repo id (an absolute or relative path, a Windows path, ...)."""
    if text.startswith((".", "/", "~")) or "\\" in text:
        return None, None
    tag = None
    if ":" in text:
        text, tag = text.rsplit(":", 1)
        if not tag or "/" in tag:
            return None, None
        tag = ":" + tag
    parts = text.split("/")
    if len(parts) > 2 and parts[-1].endswith(".gguf") and tag is None:
        repo_id, tag = "/".join(parts[:2]), "/".join(parts[2:])
    else:
        repo_id = text
    if not _REPO_ID.match(repo_id) or ".." in repo_id:
        return None, None
    return repo_id, tag


def _from_cache(repo_id: str, gguf: str | None, hub: HubOptions, what: str) -> Path | None:
    """The cached snapshot's file or folder, when it has what `what` needs; else None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, revision=hub.revision, cache_dir=hub.cache_dir, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    try:
        chosen = _choose(repo_id, files, gguf, what)
    except FileNotFoundError:
        return None  # e.g. the file is not in the cache yet: the repo may still have it
    if chosen is None:
        return None
    return folder / chosen if chosen else folder


def _download(repo_id: str, gguf: str | None, hub: HubOptions, what: str) -> Path:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    files = HfApi().list_repo_files(repo_id, revision=hub.revision, token=hub.token)
    chosen = _choose(repo_id, files, gguf, what)
    if chosen is None:
        raise FileNotFoundError(f"the repo {repo_id!r} holds no {'tokenizer' if what == 'tokenizer' else 'config.json'}")
    common = dict(revision=hub.revision, cache_dir=hub.cache_dir, token=hub.token)
    if chosen:  # one GGUF file
        return Path(hf_hub_download(repo_id, chosen, **common))
    patterns = list(_TOKENIZER_FILES if what == "tokenizer" else _CHECKPOINT_FILES)
    return Path(snapshot_download(repo_id, allow_patterns=patterns, **common))


def _choose(repo_id: str, files: list[str], gguf: str | None, what: str) -> str | None:
    """What to use of a repo holding `files`: "" the whole folder, a GGUF file's path, or None
    when the files lack it (an incomplete cache). Raises when the name selects nothing usable."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if gguf is not None and not gguf.startswith(":"):  # org/name/file.gguf
        if gguf in files:
            return gguf
        raise FileNotFoundError(f"the repo {repo_id!r} has no file {gguf!r}" + _listing(ggufs))
    if gguf is not None:  # org/name:TAG
        tag = gguf[1:].lower()
        matches = [f for f in ggufs if tag in PurePosixPath(f).name.lower()]
        if len(matches) == 1:
            return matches[0]
        why = "no GGUF file" if not matches else "several GGUF files"
        raise FileNotFoundError(f"the repo {repo_id!r} has {why} whose name holds {gguf[1:]!r}" + _listing(ggufs))
    if what == "tokenizer":
        return "" if any(fnmatch.fnmatch(f, p) for f in files for p in ("tokenizer*", "vocab*")) else None
    if "config.json" in files:
        return "" if _has_weights(files) else None
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise FileNotFoundError(
            f"the repo {repo_id!r} holds several GGUF files; name one as {repo_id}/FILE.gguf or {repo_id}:QUANT"
            + _listing(ggufs)
        )
    return None


def _has_weights(files: list[str]) -> bool:
    return any(f.endswith(".safetensors") for f in files)


def _listing(ggufs: list[str]) -> str:
    return f" (its GGUF files: {', '.join(ggufs)})" if ggufs else ""

