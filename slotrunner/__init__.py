"""slotrunner: a lean LLM inference runner.

The public face is small, with vLLM's names: `LLM`, `SamplingParams`, the output records,
`EngineArgs` + `LLMEngine`, the prompt forms (`slotrunner.inputs`). Everything else lives
in `slotrunner.core_runner` (architecture-agnostic machinery), `slotrunner.model_states`
(per-family runner-side state), `slotrunner.models` and `slotrunner.registry`. In the repository
those four are top-level folders; the installed package (editable or wheel, see setup.py) maps
them into this namespace, and that mapping is the only way they resolve.
"""

from slotrunner.inputs import ExplicitEncoderDecoderPrompt, PromptType, TextPrompt, TokensPrompt
from slotrunner.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from slotrunner.sampling_params import SamplingParams

# Pulled in on first use: they import torch and transformers, and `import slotrunner` stays cheap.
_LAZY = {"LLM": "slotrunner.llm", "EngineArgs": "slotrunner.builder", "LLMEngine": "slotrunner.llm_engine"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = [
    "LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics",
    "Logprob", "PromptType", "TextPrompt", "TokensPrompt", "ExplicitEncoderDecoderPrompt",
]  # fmt: skip
__version__ = "0.1.0"
