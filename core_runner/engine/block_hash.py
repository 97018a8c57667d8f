"""Content hashes of full KV-cache blocks: the keys of the prefix cache.

A block's hash chains its parent's hash, its token ids and the extra keys of the request that
touch it (a media item's content hash over its placeholder span, the encoder input for a
decoder whose KV depends on it, later an adapter id): two blocks share a hash exactly when
every token before and in them, and everything else their KV depends on, is the same. BLAKE2b
with 128 bits: a collision would silently reuse wrong KV, so no cheap 64-bit hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from slotrunner.core_runner.engine.intake import KeySpan

_ROOT = b"slotrunner-prefix-cache-v1"


def hash_block(parent: bytes, token_bytes: bytes | memoryview, extra_keys: Sequence[str] = ()) -> bytes:
    """One block's hash: its parent's hash, its token ids as int64 bytes, the keys over it."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(token_bytes)
    for key in extra_keys:
        h.update(b"\x00" + key.encode())
    return h.digest()


def append_block_hash(hashes: list[bytes], token_ids: Sequence[int]) -> None:
    """Append the hash of the block after `hashes` -- `token_ids`, one full block, with no key
    over it -- to them: `hash_block`'s bytes, without its calls (a decode row filling a block)."""
    h = hashlib.blake2b(hashes[-1] if hashes else _ROOT, digest_size=16)
    h.update(array("q", token_ids))  # int64 in the machine's byte order, as numpy's int64
    hashes.append(h.digest())


def extend_block_hashes(
    hashes: list[bytes],  # the request's hashes so far (full blocks), extended in place
    token_ids: Sequence[int],  # the request's known tokens (prompt + output) from position `start` on
    num_tokens: int,  # hash the full blocks among the first num_tokens tokens
    block_size: int,
    key_spans: Sequence[KeySpan] = (),
    salt: str | None = None,  # a key over the whole request (adapter id, cache salt)
    start: int = 0,  # the position of token_ids[0]: at most the first block not hashed yet
) -> list[bytes]:
    """Append the hashes of every full block in the first `num_tokens` tokens not hashed yet. The
    new blocks' tokens are converted once, not a block at a time: a prefill step of 8,192 tokens
    hashes 512 blocks, and a conversion per block cost more than the hashing. A decode row that
    fills a block passes its output's tail (`start`), not a copy of its whole sequence."""
    first, last = len(hashes), min(num_tokens, start + len(token_ids)) // block_size
    if first >= last:
        return hashes
    assert start <= first * block_size, f"tokens from {start} on cannot hash block {first}"
    keyed = bool(key_spans) or salt is not None
    if last == first + 1 and not keyed:  # a decode row filling its block
        append_block_hash(hashes, token_ids[first * block_size - start : last * block_size - start])
        return hashes
    parent = hashes[-1] if hashes else _ROOT
    # int64 in the machine's byte order, as numpy's int64 (the hashes of earlier versions)
    tokens = array("q", token_ids[first * block_size - start : last * block_size - start])
    data, width = memoryview(tokens).cast("B"), block_size * 8  # the blocks' bytes, not copied
    for i in range(first, last):
        keys: list[str] = []
        if keyed:
            lo, hi = i * block_size, (i + 1) * block_size
            keys = [k for s, e, k in key_spans if s < hi and e > lo]
            if salt is not None:
                keys.insert(0, salt)
        parent = hash_block(parent, data[(i - first) * width : (i - first + 1) * width], keys)
        hashes.append(parent)
    return hashes
