"""Content hashes of full KV-cache blocks: the keys of the prefix cache, and a request's blocks
hashed and registered in it as the steps that write them are scheduled.

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
from typing import TYPE_CHECKING

from slotrunner.core_runner.engine.intake import KeySpan

if TYPE_CHECKING:
    from slotrunner.core_runner.engine.block_manager import BlockManager
    from slotrunner.core_runner.engine.request import Request

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


def hash_request_blocks(request: Request, num_tokens: int, block_size: int) -> None:
    """Extend `request.block_hashes` over its full blocks among its first `num_tokens` tokens
    (the blocks hashed before are not read again), with its family's key spans."""
    start = len(request.block_hashes) * block_size  # the first block to hash: tokens before it are not copied
    spans = () if request.family_inputs is None else request.family_inputs.cache_key_spans()
    extend_block_hashes(request.block_hashes, request.token_ids_from(start), num_tokens, block_size, spans, start=start)


def register_full_blocks(block_manager: BlockManager, request: Request, num_tokens: int, block_size: int) -> None:
    """Register in the prefix cache the request's full blocks among its first `num_tokens`
    tokens -- those a step writes or wrote before -- whose tokens are all known: not drafts, not
    pending (async scheduling). The watermark stops at the last such block, so a block that holds
    drafts or pending tokens now is registered by a later step, once its tokens are known."""
    num_full = min(num_tokens, request.num_tokens) // block_size
    registered = request.num_registered_blocks
    if num_full <= registered:
        return  # most decode steps: no block filled since the last call
    hashes = request.block_hashes
    # A decode row filled one block with no key over it (no family inputs: no key spans): its
    # hash and registration alone, without the general paths' calls (~1.5 us a row each step
    # that fills a block; -8 to -10% of schedule() at 256 rows).
    if num_full == registered + 1 and request.family_inputs is None:
        if len(hashes) == registered:
            append_block_hash(hashes, request.token_ids_from(registered * block_size)[:block_size])
        block_manager.cache_block(request.req_id, registered, hashes[registered])
    else:
        hash_request_blocks(request, num_tokens, block_size)
        block_manager.cache(request.req_id, hashes, registered, num_full)
    request.num_registered_blocks = num_full
