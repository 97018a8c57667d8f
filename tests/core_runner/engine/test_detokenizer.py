"""IncrementalDetokenizer: streamed text equals the full decode; stop strings cut it right.

The tokenizer is a tiny byte-level BPE trained here (no network), wrapped like a Hugging Face
tokenizer. Multi-byte characters (accents, CJK, emoji) are split over several tokens by it,
which is exactly what incremental decoding must survive.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotrunner.core_runner.engine.detokenizer import IncrementalDetokenizer

EOS = "<|endoftext|>"
CORPUS = [
    "héllo wörld 日本語 🙂",
    "the quick brown fox jumps over the lazy dog.",
    "stop here ### and go on, said the fox",
    "naïve café résumé — “quotes” ünïcödé",
]
ALPHABET = "abcdefghij .,#éöü—日本語🙂🦊𝄞\n"


@pytest.fixture(scope="module", params=["windows", "decode-stream"])
def tokenizer(request):
    """The BPE as a wrapper object (the detokenizer decodes windows of ids in Python) or as a
    `tokenizers.Tokenizer` (it steps the library's DecodeStream: tokenizers loaded from files)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 10, vocab_size=300, min_frequency=1, special_tokens=[EOS], show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe if request.param == "windows" else bpe._tokenizer, eos_token=EOS)
    streams = IncrementalDetokenizer(tok, [], True, [], False)._stream is not None
    assert streams == (request.param == "decode-stream"), "the fixture does not reach the path it names"
    return tok


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, token_ids: list[int], chunk: int = 1) -> tuple[list[str], str | None]:
    """Feed `token_ids` `chunk` at a time; return the text each step added and the stop hit."""
    deltas, stop = [], None
    for i in range(0, len(token_ids), chunk):
        before = len(detok.output_text)
        stop = detok.step(token_ids[i : i + chunk])
        deltas.append(detok.output_text[before:])
        if stop is not None:
            break
    return deltas, stop


def make(
    tokenizer, prompt: str = "the fox said: ", stop: list[str] | None = None, include: bool = False, skip: bool = True
) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, encode(tokenizer, prompt), skip, stop or [], include)


@pytest.mark.parametrize("text", CORPUS + ["🙂🙂 日本語日本語 𝄞 unseen: 🦊ß"])
def test_deltas_add_up_to_full_decode(tokenizer, text: str) -> None:
    """Guards against broken multi-byte characters (U+FFFD leaking out) and lost or doubled
    spaces between deltas of a byte-level BPE."""
    output_ids = encode(tokenizer, text)
    assert len(output_ids) > len(text.split())  # multi-byte chars really span several tokens
    deltas, stop = stream(make(tokenizer), output_ids)
    assert stop is None
    assert "".join(deltas) == tokenizer.decode(output_ids) == text
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.text(ALPHABET, min_size=0, max_size=12),
    text=st.text(ALPHABET, min_size=1, max_size=30),
    chunk=st.integers(1, 4),
)
def test_deltas_property(tokenizer, prompt: str, text: str, chunk: int) -> None:
    """Guards against spacing or byte-boundary bugs for any text, prompt context and number of
    tokens per step (speculative decoding appends several)."""
    output_ids = encode(tokenizer, text)
    detok = make(tokenizer, prompt)
    deltas, _ = stream(detok, output_ids, chunk)
    assert "".join(deltas) == detok.output_text == text
    assert not any("\ufffd" in d for d in deltas)


def _boundary_stop(tokenizer, text: str) -> tuple[list[int], str]:
    """A stop string made of the end of one token and the start of the next one."""
    ids = encode(tokenizer, text)
    pieces = [tokenizer.decode([i]) for i in ids]
    k = next(
        k
        for k in range(2, len(pieces) - 1)
        if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 2 and "\ufffd" not in pieces[k] + pieces[k + 1]
    )
    return ids, pieces[k][-2:] + pieces[k + 1][:2]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_two_tokens(tokenizer, include: bool) -> None:
    """Guards against missing a stop string split over tokens, and against the stop string (or
    text after it) staying in the output when include_stop_str_in_output is False."""
    text = "the quick brown fox jumps over the lazy dog."
    ids, stop = _boundary_stop(tokenizer, text)
    assert text.count(stop) == 1
    detok = make(tokenizer, stop=["never", stop], include=include)
    deltas, hit = stream(detok, ids)
    assert hit == stop and detok.stopped_by == stop
    cut = text.index(stop) + (len(stop) if include else 0)
    assert detok.output_text == text[:cut]
    completing = next(k for k in range(len(ids)) if stop in tokenizer.decode(ids[: k + 1]))
    assert len(deltas) == completing + 1  # reported by the very step that completed it
    with pytest.raises(AssertionError, match="stopped"):
        detok.step(ids[:1])


def test_earliest_stop_string_wins(tokenizer) -> None:
    """Guards against reporting the first stop string of the list instead of the first one in
    the text when one step completes several."""
    text = "stop here ### and go on"
    detok = make(tokenizer, stop=["go", "##", "here"])
    _, hit = stream(detok, encode(tokenizer, text), chunk=100)
    assert hit == "here" and detok.output_text == "stop "


def test_stop_string_in_prompt_is_ignored(tokenizer) -> None:
    """Guards against matching a stop string in the prompt instead of the output."""
    detok = make(tokenizer, prompt="say ### now", stop=["###"])
    _, hit = stream(detok, encode(tokenizer, " fine"))
    assert hit is None and detok.output_text == " fine"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip: bool) -> None:
    """Guards against special tokens leaking into text when skipped (or vanishing when not)."""
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    ids = encode(tokenizer, "hello") + [eos_id] + encode(tokenizer, " café")
    detok = make(tokenizer, skip=skip)
    deltas, _ = stream(detok, ids)
    expected = "hello café" if skip else f"hello{EOS} café"
    assert "".join(deltas) == detok.output_text == expected


def test_without_tokenizer_text_stays_empty() -> None:
    """Guards against token-id-only models crashing in the detokenizer or matching stop strings."""
    detok = IncrementalDetokenizer(None, [1, 2, 3], True, ["x"], False)
    assert detok.step([4, 5]) is None and detok.output_text == "" and detok.token_ids == [1, 2, 3, 4, 5]


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.text(ALPHABET, min_size=0, max_size=12),
    text=st.text(ALPHABET, min_size=1, max_size=40),
    cut=st.integers(0, 3),
    chunk=st.sampled_from([5, 7, 13, 1000]),
    skip=st.booleans(),
    silent=st.lists(st.tuples(st.integers(0, 60), st.booleans()), max_size=3),
)
def test_many_tokens_at_once_read_as_one_by_one(
    tokenizer, prompt: str, text: str, cut: int, chunk: int, skip: bool, silent: list[tuple[int, bool]]
) -> None:
    """Guards against the one-call path for many tokens (a request's whole output decoded when it
    ends; accepted drafts) giving other text than stepping each token: above all an output that
    ends inside a multi-byte character, whose complete characters before it must still show.
    `cut` drops the last tokens of the text, often inside a character; `silent` puts ids with no
    text at those places: past the tokenizer's vocabulary (a model's padded rows, which random
    weights sample), or EOS again (between two bytes of a character, it leaves bytes that are no
    character). Outputs that end inside a character after such ids once lost their whole text."""
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    ids = encode(tokenizer, text)
    ids = (ids[: len(ids) // 2] + [eos_id] + ids[len(ids) // 2 :])[: max(len(ids) + 1 - cut, 1)]
    for where, padded in silent:
        ids.insert(where % (len(ids) + 1), len(tokenizer) + 7 if padded else eos_id)
    one_by_one, _ = stream(make(tokenizer, prompt, skip=skip), ids, chunk=1)
    at_once = make(tokenizer, prompt, skip=skip)
    stream(at_once, ids, chunk)
    assert at_once.output_text == "".join(one_by_one)
    assert at_once.token_ids[-len(ids) :] == ids


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize(
    ("text", "cut", "padded_at", "chunk"),
    [("a日aa", 3, (2, 2), 7), ("aü𝄞𝄞", 1, (), 13)],
    ids=["padded ids, cut inside a character", "EOS between a character's bytes, cut inside the next"],
)
def test_output_ending_inside_a_character(tokenizer, skip: bool, text: str, cut: int, padded_at: tuple, chunk: int) -> None:
    """The examples hypothesis found (`test_many_tokens_at_once_read_as_one_by_one`'s layout):
    outputs cut inside a character whose text before it must show, as stepping each id shows it."""
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    ids = encode(tokenizer, text)
    ids = (ids[: len(ids) // 2] + [eos_id] + ids[len(ids) // 2 :])[: max(len(ids) + 1 - cut, 1)]
    for where in padded_at:
        ids.insert(where, len(tokenizer) + 7)
    one_by_one, _ = stream(make(tokenizer, "", skip=skip), ids, chunk=1)
    at_once = make(tokenizer, "", skip=skip)
    stream(at_once, ids, chunk)
    assert at_once.output_text == "".join(one_by_one)


def test_padded_ids_keep_the_one_call_path(tokenizer, monkeypatch) -> None:
    """An output holding ids past the tokenizer's vocabulary still goes to the DecodeStream in one
    call: before, one such id sent the whole list through one call per token."""
    at_once = make(tokenizer, "hello")
    if at_once._stream is None:
        pytest.skip("the python-windows path has no DecodeStream")
    ids = encode(tokenizer, "the quick brown fox jumps over the lazy dog") * 3
    ids.insert(5, len(tokenizer) + 7)
    calls = []
    real = IncrementalDetokenizer._stream_step
    monkeypatch.setattr(IncrementalDetokenizer, "_stream_step", lambda self, t: calls.append(t) or real(self, t))
    at_once.step(ids)
    assert calls == []  # the output ends in a whole character: all of it in one call
    monkeypatch.undo()
    one_by_one, _ = stream(make(tokenizer, "hello"), ids, chunk=1)
    assert at_once.output_text == "".join(one_by_one)
