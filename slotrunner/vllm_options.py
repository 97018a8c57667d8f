"""vLLM's engine option names beyond slotrunner's own, checked: `EngineArgs` declares them and
calls `check_vllm_options` from its `__post_init__`.

Three kinds (README's "vLLM names" list them):

- honoured: they do what vLLM's do (hub `revision`, `tokenizer`, `gpu_memory_utilization`,
  `max_logprobs`, `generation_config`, ...), each value checked here;
- one value only: slotrunner runs that one value (`pipeline_parallel_size=1`,
  `trust_remote_code=False`, ...); any other is refused with a ValueError saying why and what to
  do instead (`ONE_VALUE`);
- without effect here: accepted as vLLM accepts them (`swap_space`, `disable_log_stats`, ...).

A name EngineArgs lacks is refused by `unknown_option` with the nearest one it has.
"""

from __future__ import annotations

import difflib
import numbers
import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from slotrunner.sampling_params import MAX_LOGPROBS

# name -> (the values slotrunner runs, why no other and what to do instead)
ONE_VALUE: dict[str, tuple[tuple[Any, ...], str]] = {
    "trust_remote_code": (
        (False,),
        "slotrunner never runs Python code shipped with a checkpoint: every architecture runs slotrunner's own "
        "implementation (`python -m slotrunner models` lists them). Leave trust_remote_code False, or add the "
        "architecture as a plugin (docs/adding_a_model.md)",
    ),
    "pipeline_parallel_size": ((1,), "an engine runs on one device; pick it with device='cuda:N'"),
    "data_parallel_size": ((1,), "an engine runs on one device: build one LLM per GPU (device='cuda:N') instead"),
    "enable_expert_parallel": ((False,), "an engine runs on one device; MoE experts all run on it"),
    "quantization": (
        (None, "gguf"),
        "slotrunner reads unquantized checkpoints and GGUF files (on CPU their Q4_0/Q4_1/Q4_K/Q6_K/Q8_0 matrices stay "
        "packed, see quantized_weights): give the model's GGUF file or its unquantized checkpoint",
    ),
    "tokenizer_mode": (("auto", "hf"), "the tokenizer is the checkpoint's Hugging Face tokenizer (or the GGUF file's)"),
    "runner": (("auto", "generate"), "slotrunner generates text; it has no pooling (embedding, scoring) runner"),
    "task": (("auto", "generate"), "slotrunner generates text; it has no embedding, scoring or reward task"),
    "model_impl": (("auto", "vllm"), "every architecture runs slotrunner's own implementation"),
    "enable_lora": (
        (False,),
        "LoRA adapters are not supported: merge the adapter into the weights (peft's merge_and_unload) and load that",
    ),
    "enable_sleep_mode": (
        (False,),
        "there is no sleep mode: delete the LLM and call slotrunner.distributed.cleanup_dist_env_and_memory()",
    ),
    "cpu_offload_gb": ((0,), "weights are not offloaded: the model lives on its device (on CPU, see quantized_weights)"),
    "disable_sliding_window": ((False,), "sliding-window layers attend within the window they were trained with"),
    "scheduling_policy": (("fcfs",), "requests run first come, first served; there is no priority scheduling"),
    "mm_processor_kwargs": (
        (None, {}),
        "the processor's options are the ones saved with the checkpoint (preprocessor_config.json): edit those, "
        "or give media as pre-computed tensors",
    ),
    "logits_processors": (
        (None, [], ()),
        "custom logits processors are not supported: SamplingParams has logit_bias, allowed_token_ids, bad_words",
    ),
}

# vLLM names EngineArgs does not have, and what to use instead.
_INSTEAD = {
    "num_gpu_blocks_override": "num_kv_blocks",
    "compilation_config": "enforce_eager and cuda_graph_sizes (nothing is compiled with torch.compile)",
    "max_seq_len_to_capture": "cuda_graph_sizes",
    "rope_scaling": "hf_overrides={'rope_scaling': ...}",
    "rope_theta": "hf_overrides={'rope_theta': ...}",
    "enforce_eager_mode": "enforce_eager",
    "lora_modules": "a checkpoint with the adapter merged into its weights",
    "worker_cls": "the ModelState registry (docs/adding_a_model.md)",
}

# override_generation_config keys that become default sampling parameters (vLLM's list).
GENERATION_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens")


def unknown_option(name: str, known: Collection[str], what: str = "engine option") -> ValueError:
    """The error for an option EngineArgs does not have: the nearest one it has, or what to do."""
    hint = _INSTEAD.get(name)
    if hint is None:
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
        hint = close[0] if close else None
    instead = f"; use {hint} instead" if hint else ""
    return ValueError(
        f"unknown {what} {name!r}{instead} (slotrunner.EngineArgs lists the options; README.md the vLLM names accepted)"
    )


def check_vllm_options(args: Mapping[str, Any]) -> None:
    """Check the vLLM-named fields of EngineArgs (`args`: field name -> value); ValueError names the option."""
    for name, (allowed, why) in ONE_VALUE.items():
        if not any(_same(args[name], v) for v in allowed):
            runs = " or ".join(repr(v) for v in allowed if v not in ({}, [], ()))
            raise ValueError(f"{name}={args[name]!r} is not supported: {why} ({name}={runs} is what slotrunner runs)")
    for name in ("revision", "tokenizer", "tokenizer_revision", "download_dir", "generation_config", "distributed_executor_backend"):
        value = args[name]
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise ValueError(f"{name} must be a string, got {value!r} ({type(value).__name__})")
    if args["hf_token"] is not None and not isinstance(args["hf_token"], (str, bool)):
        raise ValueError(f"hf_token must be a string (or True: the saved login), got {type(args['hf_token']).__name__}")
    tp = args["tensor_parallel_size"]
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int (the number of ranks), got {tp!r}")
    for name in ("skip_tokenizer_init", "disable_log_stats", "disable_custom_all_reduce"):
        if not isinstance(args[name], bool):
            raise ValueError(f"{name} must be True or False, got {args[name]!r}")
    if args["enable_chunked_prefill"] is not None and not isinstance(args["enable_chunked_prefill"], bool):
        raise ValueError(f"enable_chunked_prefill must be True, False or None, got {args['enable_chunked_prefill']!r}")
    util = args["gpu_memory_utilization"]
    if util is not None and (not _is_number(util) or not 0 < util <= 1):
        raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {util!r}")
    kv_bytes = args["kv_cache_memory_bytes"]
    if kv_bytes is not None and (isinstance(kv_bytes, bool) or not isinstance(kv_bytes, int) or kv_bytes < 1):
        raise ValueError(f"kv_cache_memory_bytes must be a positive int, got {kv_bytes!r}")
    swap = args["swap_space"]
    if not _is_number(swap) or swap < 0:
        raise ValueError(f"swap_space must be a number of GiB >= 0, got {swap!r}")
    max_logprobs = args["max_logprobs"]
    if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or not -1 <= max_logprobs <= MAX_LOGPROBS:
        raise ValueError(
            f"max_logprobs must be an int in [0, {MAX_LOGPROBS}] (or -1: no limit below SamplingParams' cap of "
            f"{MAX_LOGPROBS}), got {max_logprobs!r}"
        )
    _check_generation_config(args["generation_config"], args["override_generation_config"])
    _check_str_mapping("hf_overrides", args["hf_overrides"])
    limits = args["limit_mm_per_prompt"]
    _check_str_mapping("limit_mm_per_prompt", limits)
    for modality, limit in (limits or {}).items():
        count = limit.get("count") if isinstance(limit, Mapping) else limit
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be an int >= 0 (or {{'count': n}}), got {limit!r}")
    name = args["served_model_name"]
    if name is not None and not isinstance(name, str) and not (
        isinstance(name, Sequence) and all(isinstance(n, str) for n in name)
    ):
        raise ValueError(f"served_model_name must be a string or a list of strings, got {name!r}")


def mm_limits(limits: Mapping[str, Any] | None) -> dict[str, int]:
    """limit_mm_per_prompt as {modality: count} (vLLM also takes {modality: {"count": n, ...}})."""
    return {m: int(v["count"] if isinstance(v, Mapping) else v) for m, v in (limits or {}).items()}


def _check_generation_config(source: Any, override: Any) -> None:
    if source not in ("auto", "vllm") and not os.path.isfile(os.path.join(os.fspath(source), "generation_config.json")):
        raise ValueError(
            f"generation_config must be 'auto' (the model's generation_config.json), 'vllm' (none) or a directory "
            f"holding a generation_config.json, got {source!r}"
        )
    _check_str_mapping("override_generation_config", override)
    unknown = sorted(set(override or ()) - set(GENERATION_KEYS))
    if unknown:
        raise ValueError(f"override_generation_config has unknown key(s) {unknown}; it takes {list(GENERATION_KEYS)}")


def _check_str_mapping(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{name} must be a dict with string keys, got {type(value).__name__}")


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _same(value: Any, allowed: Any) -> bool:
    """`value` is `allowed` in kind as well as value: True is not 1, and 0.0 is 0."""
    if _is_number(value) and _is_number(allowed):
        return value == allowed
    return type(value) is type(allowed) and value == allowed
