"""vLLM's distributed clean-up call, for scripts that build one LLM after another.

A tensor-parallel engine leaves its process group in `llm.close()` (or at exit); this call also
leaves any group still joined in this process, then frees the memory of engines the caller has
dropped.
"""

from __future__ import annotations

import gc


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Leave a torch.distributed process group left open, free the memory of deleted engines
    (`del llm` first): collect garbage, then hand cached CUDA blocks back to the driver. Safe to
    call any time, with or without a GPU."""
    import torch

    from slotrunner.core_runner.distributed.parallel_state import destroy_tensor_parallel

    destroy_tensor_parallel()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
