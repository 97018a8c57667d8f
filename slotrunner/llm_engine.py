"""LLMEngine as vLLM users call it: `LLMEngine.from_engine_args(EngineArgs(...))`, then
`add_request` / `step` / `abort_request`.

The step loop is `core_runner/engine/engine.py`'s; this face adds what only the public API
needs: building from EngineArgs (core_runner may not import the builder), the model's default
sampling parameters (generation_config.json), the per-prompt limits vLLM checks at submission
(`max_logprobs`, `limit_mm_per_prompt`), vLLM's argument forms (a list of ids to abort,
`arrival_time`), and the tokenizer accessors vLLM code calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from slotrunner.core_runner.engine import engine as core
from slotrunner.core_runner.engine.intake import ProcessedPrompt, PromptType
from slotrunner.sampling_params import MAX_LOGPROBS, SamplingParams
from slotrunner.vllm_options import GENERATION_KEYS

if TYPE_CHECKING:
    from slotrunner.tensor_parallel import TensorParallelLaunch

_RENAMED = {"max_new_tokens": "max_tokens"}  # generation_config.json name -> SamplingParams name


class LLMEngine(core.LLMEngine):
    """The engine: one `step()` is one scheduler step and one model step (see the base class).

    Build it with `LLMEngine.from_engine_args(EngineArgs(model=...))` (or `build_engine`).
    """

    def __init__(
        self,
        *args: Any,
        sampling_defaults: Mapping[str, Any] | None = None,
        max_logprobs: int = MAX_LOGPROBS,
        limit_mm_per_prompt: Mapping[str, int] | None = None,
        tensor_parallel: TensorParallelLaunch | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        # This process's rank of a tensor-parallel engine (a single rank when not parallel).
        self.tensor_parallel = tensor_parallel
        self.sampling_defaults = dict(sampling_defaults or {})  # SamplingParams fields from generation_config
        self.max_logprobs = MAX_LOGPROBS if max_logprobs < 0 else max_logprobs
        self.limit_mm_per_prompt = dict(limit_mm_per_prompt or {})

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> LLMEngine:
        """Build an engine from an `EngineArgs` (vLLM's constructor)."""
        from slotrunner.builder import build_engine  # the builder constructs this class

        return build_engine(engine_args)

    def get_tokenizer(self) -> Any | None:
        return self.tokenizer

    def get_tokenizer_group(self) -> TokenizerGroup:
        return TokenizerGroup(self.tokenizer)

    def get_default_sampling_params(self) -> SamplingParams:
        """A new SamplingParams from the model's generation_config.json (temperature, top_k,
        top_p, min_p, repetition_penalty, max_new_tokens as max_tokens), vLLM's defaults for the
        rest; `EngineArgs.generation_config="vllm"` ignores the file."""
        return SamplingParams(**self.sampling_defaults)

    def close(self) -> None:
        """Stop a tensor-parallel engine's other ranks and leave its process group (nothing to do
        on one device); no step runs afterwards. Idempotent, and run at exit anyway."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: Any = None,
        tokenization_kwargs: Mapping[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue one request (vLLM's signature); raises ValueError on bad input.
        `params=None` takes the model's default sampling parameters."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported (merge the adapter into the weights)")
        if priority != 0:
            raise ValueError("priority: requests run first come, first served (no priority scheduling)")
        if tokenization_kwargs:
            raise ValueError(f"tokenization_kwargs {sorted(tokenization_kwargs)} are not supported: tokenize the prompt yourself")
        params = self.get_default_sampling_params() if params is None else params
        self._check_logprob_limits(params)
        self._check_media_limits(prompt)  # a ProcessedPrompt was checked by process_prompt
        super().add_request(request_id, prompt, params, arrival_time)

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        """`add_request`'s reading of a prompt, for any thread (see the base class), with the
        engine-wide media limit applied."""
        self._check_media_limits(prompt)
        return super().process_prompt(prompt)

    def abort_request(self, request_id: str | Iterable[str], *, report: bool = True) -> None:
        """Abort one request or several (vLLM passes a list); unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for req_id in ids:
            super().abort_request(req_id, report=report)

    def _check_logprob_limits(self, params: Any) -> None:
        """The engine-wide limit vLLM applies at submission: max_logprobs."""
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name, None)
            asked = 1 if asked is True else asked  # vLLM's spelling of 1
            if isinstance(asked, int) and not isinstance(asked, bool) and asked > self.max_logprobs:
                raise ValueError(f"{name}={asked} exceeds this engine's max_logprobs={self.max_logprobs}")

    def _check_media_limits(self, prompt: PromptType) -> None:
        """The engine-wide limit vLLM applies at submission: limit_mm_per_prompt."""
        if not self.limit_mm_per_prompt or not isinstance(prompt, Mapping):
            return
        parts = [prompt, prompt.get("encoder_prompt"), prompt.get("decoder_prompt")]
        for part in parts:
            media = part.get("multi_modal_data") if isinstance(part, Mapping) else None
            if not isinstance(media, Mapping):
                continue
            for modality, items in media.items():
                limit = self.limit_mm_per_prompt.get(modality)
                count = len(items) if isinstance(items, list) else 1
                if limit is not None and count > limit:
                    raise ValueError(
                        f"the prompt has {count} {modality} item(s); limit_mm_per_prompt allows {limit} per prompt"
                    )


class TokenizerGroup:
    """vLLM's tokenizer wrapper, for code written against it (`get_tokenizer_group().encode(prompt=...)`);
    anything else is the tokenizer's own attribute."""

    def __init__(self, tokenizer: Any | None) -> None:
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init, or none saved with the model)")
        self.tokenizer = tokenizer

    def encode(
        self,
        prompt: str,
        max_length: int | None = None,
        truncation: bool | None = None,
        lora_request: Any = None,
        add_special_tokens: bool | None = None,
    ) -> list[int]:
        kwargs: dict[str, Any] = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if max_length is not None:
            kwargs.update(max_length=max_length, truncation=bool(truncation))
        return list(self.tokenizer.encode(prompt, **kwargs))

    def get_lora_tokenizer(self, lora_request: Any = None) -> Any:
        return self.tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def sampling_defaults(generation_config: Mapping[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """SamplingParams fields from a generation_config dict and `override_generation_config`
    (vLLM's `get_diff_sampling_param`: only the sampling keys, max_new_tokens as max_tokens)."""
    merged = {k: v for k, v in generation_config.items() if k in GENERATION_KEYS and v is not None}
    merged.update(overrides or {})
    defaults = {_RENAMED.get(k, k): v for k, v in merged.items()}
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the model's default sampling parameters (generation_config) are invalid: {e}") from None
    return defaults
