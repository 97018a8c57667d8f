"""slotrunner: a lean LLM inference runner.

The public face is small: `LLM`, `SamplingParams` and the output records. Everything else lives
in `slotrunner.core_runner` (architecture-agnostic machinery), `slotrunner.model_states`
(per-family runner-side state), `slotrunner.models` and `slotrunner.registry`. In the repository
those four are top-level folders; the installed package (editable or wheel, see setup.py) maps
them into this namespace, and that mapping is the only way they resolve.
"""

from slotrunner.outputs import CompletionOutput, Logprob, RequestOutput
from slotrunner.sampling_params import SamplingParams


def __getattr__(name: str):
    # LLM pulls in torch and transformers; keep `import slotrunner` cheap until it is used.
    if name == "LLM":
        from slotrunner.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
