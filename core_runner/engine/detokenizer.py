"""IncrementalDetokenizer: turns one request's sampled token ids into text, step by step."""

from __future__ import annotations

from typing import Any

# Tokens of prompt context decoded in front of the first output token. Some tokenizers
# (SentencePiece) drop or add a leading space at the start of a decode; decoding the new token
# together with a few earlier ones, and subtracting their text, keeps the spacing right.
_INITIAL_PREFIX_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"  # what an incomplete multi-byte UTF-8 sequence decodes to
_LIST_ABOVE = 4  # a step of more tokens than this goes to the stream in one call (`_stream_list`, `_list_end`)
_LIST_SEARCH = 8  # points `_list_end` tries, from the end back, before stepping every token
_MAX_CHAR_BYTES = 4  # a UTF-8 character's bytes at most; a token carries at least one


class IncrementalDetokenizer:
    """Per-request text state, fed by the engine after every `Scheduler.update`.

    Decoding the whole sequence every step is quadratic; decoding each token alone breaks
    multi-byte characters and spacing. Instead keep two offsets into the token ids:
    `prefix_offset` (start of a short context window) and `read_offset` (end of the text already
    emitted). Each step decodes `ids[prefix_offset:]` and `ids[prefix_offset:read_offset]`; the
    difference is the new text. Text that ends in U+FFFD is held back until the next token
    completes the character.

    With `tokenizer=None` (token-id-only models) the text stays "" and stop strings are ignored.
    """

    def __init__(
        self,
        tokenizer: Any | None,  # a transformers tokenizer: needs .decode(ids, skip_special_tokens=...)
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop: list[str],
        include_stop_str_in_output: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop) if tokenizer is not None else []
        self.include_stop_str_in_output = include_stop_str_in_output
        # A new match can start at most this many characters before the new text.
        self._stop_lookback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output
        self.prefix_offset = max(len(prompt_token_ids) - _INITIAL_PREFIX_TOKENS, 0)
        self.read_offset = len(prompt_token_ids)
        self.output_text = ""  # all output text so far (cut at a stop string once one matched)
        self.stopped_by: str | None = None
        # A fast (Rust) tokenizer decodes the stream itself, by the same two-offset method, in
        # one call per token instead of two Python decodes of the window.
        self._stream = None if tokenizer is None else _decode_stream(tokenizer, skip_special_tokens)
        if self._stream is not None:
            self._list_steps = True
            self._vocab_size = self._stream[0].get_vocab_size(with_added_tokens=True)
            for token_id in prompt_token_ids[self.prefix_offset :]:  # the prompt's last tokens as context
                self._stream_step(token_id)

    def step(self, new_token_ids: list[int]) -> str | None:
        """Append this step's sampled tokens; return the stop string they completed, if any.

        Once a stop string matched, the request is over: calling again is a bug.
        """
        assert self.stopped_by is None, f"step() after the request stopped on {self.stopped_by!r}"
        if self.tokenizer is None:
            self.token_ids.extend(new_token_ids)
            return None
        num_chars_before = len(self.output_text)
        if self._stream is not None and len(new_token_ids) > _LIST_ABOVE:
            # Many tokens at once (offline generation decodes a request's output when it ends;
            # accepted drafts): one call up to the last point where stepping each would have
            # shown all the text so far (`_list_end`), the rest one by one, so that the text
            # ends where stepping each would have ended it.
            self.token_ids.extend(new_token_ids)
            known = new_token_ids
            if not (0 <= min(known) and max(known) < self._vocab_size):
                # Ids past the tokenizer's vocabulary (a model's padded rows) have no text and
                # leave the stream as it was when stepped alone: the stream goes without them.
                known = [t for t in known if 0 <= t < self._vocab_size]
            end = self._list_end(known)
            text = self._stream_list(known[:end]) if end else ""
            self.output_text += text + "".join(self._stream_step(t) for t in known[end:])
        else:
            for token_id in new_token_ids:
                self.token_ids.append(token_id)
                self.output_text += self._decode_next() if self._stream is None else self._stream_step(token_id)
        if len(self.output_text) > num_chars_before:
            self.stopped_by = self._check_stop(num_chars_before)
        return self.stopped_by

    def _decode_next(self) -> str:
        """Text the newest token completes; advances the offsets only when text is emitted."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            # Nothing visible yet (a skipped special token, or half of a UTF-8 character): widen the
            # window and wait for the next token.
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full_text[len(prefix_text) :]

    def _stream_step(self, token_id: int) -> str:
        backend, stream = self._stream
        try:
            return stream.step(backend, token_id) or ""
        except Exception:  # an id the tokenizer does not know (a padded vocabulary row): no text, as decode gives
            return ""

    def _list_end(self, token_ids: list[int]) -> int:
        """How many of `token_ids` (ids of the vocabulary) go to the stream in one call: all of
        them up to a point where stepping them one by one would have shown all their text -- the
        text of the last ids there (at least `_MAX_CHAR_BYTES` bytes) ends in a whole character,
        not in U+FFFD -- found from the end back. The stream holds back a list's whole text while
        it ends in U+FFFD, which an output that ends inside a character, or holds bytes that are
        no character (EOS between two of a character's bytes), would never release."""
        backend = self._stream[0]
        for end in range(len(token_ids), max(len(token_ids) - _LIST_SEARCH, 0), -1):
            text = backend.decode(token_ids[max(end - _MAX_CHAR_BYTES, 0) : end], skip_special_tokens=self.skip_special_tokens)
            if text and not text.endswith(_REPLACEMENT_CHAR):
                return end
        return 0

    def _stream_list(self, token_ids: list[int]) -> str:
        """The text of `token_ids` stepped into the stream in one call (tokenizers >= 0.22 take a
        list): ~1 us a token against ~3 stepped one by one. It holds back the whole list's text
        while the list ends inside a character: `_list_end` cuts lists where none does."""
        backend, stream = self._stream
        if self._list_steps:
            try:
                return stream.step(backend, token_ids) or ""
            except TypeError:  # an older tokenizers: ids one at a time
                self._list_steps = False
        return "".join(self._stream_step(t) for t in token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        # No clean-up of tokenization spaces: it rewrites " ." to "." depending on the window,
        # so the deltas would no longer add up to the full decode.
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _check_stop(self, num_chars_before: int) -> str | None:
        """Find the earliest stop string that ends in the new text; cut `output_text` at it."""
        if not self.stop:
            return None
        start = max(num_chars_before - self._stop_lookback, 0)
        best: tuple[int, str] | None = None
        for stop_str in self.stop:
            index = self.output_text.find(stop_str, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop_str)
        if best is None:
            return None
        index, stop_str = best
        self.output_text = self.output_text[: index + len(stop_str) if self.include_stop_str_in_output else index]
        return stop_str


def _decode_stream(tokenizer: Any, skip_special_tokens: bool) -> tuple[Any, Any] | None:
    """(backend, tokenizers.decoders.DecodeStream) for a transformers fast tokenizer, else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
    except ImportError:  # tokenizers older than 0.21
        return None
    if not isinstance(backend, Tokenizer):
        return None
    return backend, DecodeStream(skip_special_tokens=skip_special_tokens)
