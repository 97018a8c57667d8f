"""Media given as a string: where its bytes may come from (vLLM's rule).

A string (or `os.PathLike`) item of `multi_modal_data` is one of:

- a `data:` URL (`data:image/png;base64,...`): decoded here;
- a local path, or a `file://` URL: read only when the engine was built with
  `allowed_local_media_path=DIR` and the file's real path (symlinks resolved) lies inside DIR;
  only a regular file of at most `MAX_MEDIA_FILE_BYTES` is read, and it is opened without
  blocking, so a FIFO or a device can never stall intake;
- anything else (`http(s)://`, other schemes) is refused: the engine does not use the network.

Every refusal is a ValueError that says what to give instead; the caller prefixes the item's name.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from typing import Any
from urllib.parse import unquote, urlparse

MAX_MEDIA_FILE_BYTES = 256 << 20  # a local file or a data URL's payload; larger is refused unread

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_INSTEAD = "give the item itself (a PIL image, encoded bytes, an array) or a data: URL"


def media_root(path: Any) -> str | None:
    """The engine argument `allowed_local_media_path` as the real path of an existing directory
    (None: no local file is ever read). Raises ValueError naming the argument."""
    if path is None:
        return None
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"allowed_local_media_path must be a directory path (a non-empty str), got {path!r}")
    real = os.path.realpath(os.fspath(path))
    if not os.path.isdir(real):
        raise ValueError(f"allowed_local_media_path={os.fspath(path)!r} is not an existing directory")
    return real


def read_media_source(source: str | os.PathLike, root: str | None) -> bytes:
    """The bytes a string item names: a data URL's payload, or a regular file under `root`."""
    text = os.fspath(source)
    if isinstance(text, bytes) or not text:
        raise ValueError(f"expected a data: URL or a file path, got {source!r}")
    if isinstance(source, str):
        if text[:5].lower() == "data:":
            return _data_url(text)
        url = _URL.match(text)
        if url:
            scheme = url.group(1).lower()
            if scheme in ("http", "https"):
                raise ValueError(f"{scheme} URLs are not fetched (this engine does not use the network): {_INSTEAD}")
            if scheme != "file":
                raise ValueError(f"unsupported URL scheme {scheme!r}: {_INSTEAD}, or a path under allowed_local_media_path")
            parsed = urlparse(text)
            if parsed.netloc not in ("", "localhost"):
                raise ValueError(f"file URL {text!r} names host {parsed.netloc!r}; only local files are read")
            text = unquote(parsed.path)
    return _read_local_file(text, root)


def _data_url(url: str) -> bytes:
    """`data:[<media type>];base64,<payload>` -> the payload's bytes."""
    head, comma, payload = url[5:].partition(",")
    if not comma or not head.lower().endswith(";base64"):
        raise ValueError("a data URL must be base64-encoded: data:<media type>;base64,<data>")
    payload = "".join(payload.split())  # line breaks are common in long base64 text
    if len(payload) // 4 * 3 > MAX_MEDIA_FILE_BYTES:
        raise ValueError(f"the data URL holds more than {MAX_MEDIA_FILE_BYTES} bytes (the limit)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"the data URL's base64 payload is invalid: {e}") from None


def _read_local_file(path: str, root: str | None) -> bytes:
    if root is None:
        raise ValueError(
            f"{path!r} is a local path, and local files are read only under the engine's allowed_local_media_path "
            f"(LLM(..., allowed_local_media_path=DIR)), which is not set: set it, or {_INSTEAD}"
        )
    real = os.path.realpath(path)
    if os.path.commonpath([real, root]) != root:
        raise ValueError(f"{path!r} is outside allowed_local_media_path {root!r} (symlinks resolved: {real!r})")
    # stat before opening (a device is never opened), then check the opened file again: a file
    # swapped in between for a FIFO or a link is refused, and O_NONBLOCK keeps a FIFO from blocking.
    try:
        if not stat.S_ISREG(os.stat(real).st_mode):
            raise ValueError(f"{path!r} is not a regular file")
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ValueError(f"{path!r} cannot be opened: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path!r} is not a regular file")
        if info.st_size > MAX_MEDIA_FILE_BYTES:
            raise ValueError(f"{path!r} has {info.st_size} bytes, over the limit of {MAX_MEDIA_FILE_BYTES}")
        data = f.read(MAX_MEDIA_FILE_BYTES + 1)
    if len(data) > MAX_MEDIA_FILE_BYTES:
        raise ValueError(f"{path!r} has more than {MAX_MEDIA_FILE_BYTES} bytes (the limit)")
    return data
