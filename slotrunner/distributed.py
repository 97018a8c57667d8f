"""vLLM's distributed clean-up call, for scripts that build one LLM after another.

slotrunner runs one engine in one process on one device: there is no process group to tear
down. What remains of the call is freeing the memory of engines the caller has dropped.
"""

from __future__ import annotations

import gc


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Free the memory of deleted engines (`del llm` first): collect garbage, then hand cached
    CUDA blocks back to the driver. Safe to call any time, with or without a GPU."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
