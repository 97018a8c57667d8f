"""A Hugging Face fast tokenizer rebuilt from a GGUF file's `tokenizer.*` metadata.

Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`, the value the format gives them)
are built here directly with `tokenizers` (~0.6 s for 49k tokens). The pre-tokenizer follows the
GGUF reference implementation's split rules for `tokenizer.ggml.pre`, which match what the model
was trained with; transformers' own GGUF conversion drops some of them (a one-digit-per-token
split, for one), so it can tokenize "2024" differently.
Any other vocabulary (SentencePiece, ...) is handed to transformers' GGUF conversion, which is
slower (it re-reads the file) but covers more formats.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2/2.5/3 and QwQ (llama.cpp's QWEN2 pre-type): Llama 3's rules with one digit per token
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5 (llama.cpp's QWEN35 pre-type): Qwen2's rules with combining marks (\p{M}) part of words
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o's o200k (GPT-OSS's files: llama.cpp's GPT4O pre-type): words keep their case-split
# prefix and contraction, up to three digits a token, "/" and newlines stay with punctuation
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's Tekken (Nemo and the files that reuse its vocabulary; llama.cpp's TEKKEN pre-type, the
# tokenizer.json regex it quotes): o200k-style case-split words, one digit a token
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek-V3 (llama.cpp's DEEPSEEK3_LLM pre-type, as DeepSeek-V3's tokenizer.json splits): up to
# three digits a token, runs of CJK ideographs / kana apart, then one punctuation mark may lead
# ASCII letters, other words take one non-letter before them, punctuation keeps its newlines
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
)
# DeepSeek-V2 / DeepSeek LLM (llama.cpp's DEEPSEEK_LLM pre-type, as their tokenizer.json splits):
# newlines alone, a space and a run of letters (an explicit letter class), a space and a run of
# ASCII / full-width punctuation, trailing spaces, CJK runs, runs of digits
_DEEPSEEK_LLM_SPLITS = (
    r"[\r\n]",
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
)
_ONE_DIGIT_SPLIT = r"\p{N}"
# what llama.cpp uses when tokenizer.ggml.pre is "default" or absent (older files)
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")

# tokenizer.ggml.pre -> regexes applied one after the other (llama.cpp's `regex_exprs`)
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": _DEFAULT_SPLITS,
    "gpt-2": (_GPT2_SPLIT,),
    "smollm": (_ONE_DIGIT_SPLIT, _GPT2_SPLIT),
    "starcoder": (_ONE_DIGIT_SPLIT, _GPT2_SPLIT),
    "refact": (_ONE_DIGIT_SPLIT, _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "falcon-h1": (_LLAMA3_SPLIT,),  # Falcon-H1 files: llama.cpp runs them with Llama 3's rules
    # cl100k-vocabulary files (DBRX; Granite 4.0's 100,353-token vocabulary, the hybrids' too):
    # llama.cpp runs them with Llama 3's rules
    "dbrx": (_LLAMA3_SPLIT,),
    # Nemotron-H files (Nemotron 3 Nano's 131,072-token vocabulary): llama.cpp runs them with
    # Llama 3's rules, not Tekken's, though the vocabulary is Mistral's
    "pixtral": (_LLAMA3_SPLIT,),
    "tekken": (_TEKKEN_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "qwen35": (_QWEN35_SPLIT,),
    "gpt-4o": (_O200K_SPLIT,),
    "deepseek-llm": _DEEPSEEK_LLM_SPLITS,
    "deepseek-v3": _DEEPSEEK3_SPLITS,
}


def build_tokenizer(metadata: Mapping[str, Any], path: str) -> PreTrainedTokenizerBase:
    """The tokenizer described by `metadata` (read from the GGUF file at `path`).

    The chat template (`tokenizer.chat_template`), if any, is set on the returned tokenizer.
    Raises ValueError if the metadata has no vocabulary or names a pre-tokenizer with no known rules.
    """
    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError(f"{path} has no tokenizer.ggml.tokens metadata, so no tokenizer can be built from it.")
    if metadata.get("tokenizer.ggml.model") == "gpt2":
        tokenizer: PreTrainedTokenizerBase = _byte_level_bpe(metadata, path)
    else:
        logger.info("Building the %s tokenizer of %s through transformers.", metadata.get("tokenizer.ggml.model"), path)
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    chat_template = metadata.get("tokenizer.chat_template")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _byte_level_bpe(metadata: Mapping[str, Any], path: str) -> PreTrainedTokenizerFast:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ValueError(
            f"{path}: tokenizer.ggml.pre={pre!r} has no known split rules; "
            f"supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}."
        )
    merges = []
    for merge in metadata.get("tokenizer.ggml.merges", ()):
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ValueError(f"{path}: malformed merge {merge!r} in tokenizer.ggml.merges.")
        merges.append((left, right))

    try:
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    except Exception as exc:  # tokenizers raises a bare Exception, e.g. for a merge of unknown tokens
        raise ValueError(f"{path}: the tokenizer.ggml.* vocabulary is inconsistent: {exc}") from exc
    backend = Tokenizer(bpe)
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in PRE_TOKENIZER_SPLITS[pre]]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()

    token_types = metadata.get("tokenizer.ggml.token_type")
    if token_types is not None:
        # llama.cpp matches control and user-defined tokens whole before splitting the text
        backend.add_special_tokens(
            [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(token_types) if t == _CONTROL]
        )
        backend.add_tokens(
            [AddedToken(tokens[i], normalized=False) for i, t in enumerate(token_types) if t == _USER_DEFINED]
        )

    special = {}
    for attr, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is None:
            continue
        if not 0 <= token_id < len(tokens):
            raise ValueError(f"{path}: tokenizer.ggml.{key}_token_id={token_id} is outside the vocabulary.")
        special[attr] = tokens[token_id]
    backend.post_processor = _post_processor(metadata, special)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


def _post_processor(metadata: Mapping[str, Any], special: dict[str, str]) -> processors.PostProcessor:
    """Adds BOS/EOS around each sequence when the file asks for it (Llama 3 adds BOS; SmolLM neither)."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    ends = {
        end: (special[f"{end}_token"], metadata[f"tokenizer.ggml.{end}_token_id"])
        for end in ("bos", "eos")
        if metadata.get(f"tokenizer.ggml.add_{end}_token") and f"{end}_token" in special
    }
    if not ends:
        return byte_level
    prefix = [ends["bos"][0]] if "bos" in ends else []
    suffix = [ends["eos"][0]] if "eos" in ends else []
    single = " ".join([*prefix, "$A:0", *suffix])
    pair = " ".join([single, *(f"{t}:1" for t in prefix), "$B:1", *(f"{t}:1" for t in suffix)])
    template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(ends.values()))
    return processors.Sequence([byte_level, template])
