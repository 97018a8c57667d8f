"""A conversation rendered with the model's chat template and tokenized into a prompt.

Template options are vLLM's (`tools`, `chat_template_kwargs`, `continue_final_message`,
`chat_template_content_format`); content parts are read by `chat_content.py`.

Special-token text inside message content is tokenized as plain text by default
(`split_special_tokens=True`): a user who writes "<|im_start|>system ..." gets those characters,
not a system turn. Only the template's own special tokens (roles, turn ends) are special. The
text is otherwise tokenized exactly as the whole rendered prompt would be: each special-token
string found in content is cut out and tokenized on its own with special tokens split. With
`split_special_tokens=False` the rendered prompt is tokenized whole (vLLM's behaviour), so
content can open and close turns.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slotrunner.chat_content import MediaSpec, as_template_content, read_content
from slotrunner.core_runner.engine.intake import tokenize

_MARK = "\ue000{}\ue001"  # private-use characters stand in for special-token text while rendering
_MARK_RE = re.compile("\ue000(\\d+)\ue001")
_PROBE = "\ue002probe\ue003"
CONTENT_FORMATS = ("auto", "string", "openai")
# Arguments of apply_chat_template that chat() sets itself: chat_template_kwargs may not.
_RESERVED = frozenset({"conversation", "chat_template", "tokenize", "add_generation_prompt", "continue_final_message",
                       "tools", "return_dict", "return_tensors", "padding", "truncation", "max_length"})


@dataclass(frozen=True)
class ChatOptions:
    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Sequence[Mapping[str, Any]] | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    content_format: str = "auto"  # vLLM's chat_template_content_format
    split_special_tokens: bool = True


@dataclass(frozen=True)
class ChatPrompt:
    text: str  # the rendered template, content as the user wrote it
    prompt: dict[str, Any]  # what LLM.generate takes: token ids (+ text when they are its plain tokenization, + media)


class ChatRenderer:
    """Renders conversations for one tokenizer; remembers each template's content format."""

    def __init__(self, tokenizer: Any, media: MediaSpec | None = None, default_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.media = media
        self.default_template = default_template  # used when the tokenizer has none (a processor's)
        self._formats: dict[str | None, str] = {}
        specials = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
        specials |= set(getattr(tokenizer, "all_special_tokens", ()))
        specials.discard("")
        self._special_re = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))) if specials else None

    def render(self, conversation: Sequence[Mapping[str, Any]], opts: ChatOptions) -> ChatPrompt:
        template = opts.chat_template or self.default_template
        if template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=...")
        if opts.continue_final_message and opts.add_generation_prompt:
            raise ValueError("continue_final_message=True continues the last message: pass add_generation_prompt=False")
        if opts.content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {CONTENT_FORMATS}, got {opts.content_format!r}")
        extra = dict(opts.chat_template_kwargs or {})
        reserved = sorted(set(extra) & _RESERVED)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved}: pass them as chat()'s own arguments")
        fmt = opts.content_format if opts.content_format != "auto" else self._content_format(template)
        found: list[str] = []  # special-token strings cut out of content, by mark index
        messages, media = [], []
        for i, message in enumerate(conversation):
            if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {message!r}")
            content = read_content(message["content"], self.media, f"message {i}")
            if opts.split_special_tokens:
                content.parts = [(k, self._protect(v, found) if k == "text" else v) for k, v in content.parts]
            media += content.media
            messages.append({**message, "content": as_template_content(content, fmt, self.media)})
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False, add_generation_prompt=opts.add_generation_prompt,
                continue_final_message=opts.continue_final_message, tools=opts.tools, **extra,
            )  # fmt: skip
        except Exception as e:  # the template is third-party code (Jinja): any type
            raise ValueError(f"the chat template could not render the conversation: {type(e).__name__}: {e}") from e
        if not isinstance(rendered, str):
            raise ValueError(f"the chat template rendered {type(rendered).__name__}, not text")
        text = _MARK_RE.sub(lambda m: found[int(m.group(1))], rendered)
        # The template writes the special tokens itself: tokenizing must not add a second BOS.
        prompt: dict[str, Any] = {"prompt_token_ids": self._tokenize(rendered, found)}
        if not found:
            prompt["prompt"] = text  # the ids are the text's own tokenization: intake can check them
        if media:
            prompt["multi_modal_data"] = {self.media.modality: [item for _, item in media]}
        return ChatPrompt(text, prompt)

    def _protect(self, text: str, found: list[str]) -> str:
        """`text` with each special-token string replaced by a mark (its index in `found`)."""
        if self._special_re is None:
            return text

        def mark(m: re.Match[str]) -> str:
            found.append(m.group(0))
            return _MARK.format(len(found) - 1)

        return self._special_re.sub(mark, text)

    def _tokenize(self, rendered: str, found: list[str]) -> list[int]:
        if not found:
            return tokenize(self.tokenizer, rendered, False, "rendered chat")
        pieces = _MARK_RE.split(rendered)  # text, mark index, text, mark index, ..., text
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                ids += tokenize(self.tokenizer, piece, False, "rendered chat") if piece else []
                continue
            try:
                ids += self.tokenizer(found[int(piece)], add_special_tokens=False, split_special_tokens=True)["input_ids"]
            except Exception as e:  # third-party code: any type
                raise ValueError(f"the tokenizer cannot split special tokens in message content: {type(e).__name__}: {e}") from e
        return ids

    def _content_format(self, template: str | None) -> str:
        """"openai" when the template reads content parts (a list of {"type": ...}), else "string":
        found by rendering a probe message of one text part (vLLM inspects the template instead)."""
        if template not in self._formats:
            probe = [{"role": "user", "content": [{"type": "text", "text": _PROBE}]}]
            try:
                out = self.tokenizer.apply_chat_template(probe, chat_template=template, tokenize=False)
            except Exception:  # a template that needs string content fails on a list: any type
                out = ""
            reads_parts = isinstance(out, str) and _PROBE in out and "'type'" not in out and '"type"' not in out
            self._formats[template] = "openai" if reads_parts else "string"
        return self._formats[template]
