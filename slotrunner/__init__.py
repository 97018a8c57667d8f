"""slotrunner: a lean LLM inference runner.

The public face is small: `LLM`, `SamplingParams` and the output records. Everything else lives
in `slotrunner.core_runner` (architecture-agnostic machinery), `slotrunner.model_states`
(per-family runner-side state), `slotrunner.models` and `slotrunner.registry`.
"""

from pathlib import Path as _Path

# In a source checkout the four sibling folders (core_runner/, model_states/, models/,
# registry/) sit next to this package rather than inside it; an installed wheel has them inside.
# Adding the checkout root to the package path makes `slotrunner.core_runner` resolve the same
# way in both cases (including `python -m slotrunner` run from the repository root).
_root = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).resolve().parent / "core_runner").is_dir() and (_root / "core_runner").is_dir():
    __path__.append(str(_root))  # noqa: F821 - __path__ is defined for packages

from slotrunner.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from slotrunner.sampling_params import SamplingParams  # noqa: E402


def __getattr__(name: str):
    # LLM pulls in torch and transformers; keep `import slotrunner` cheap until it is used.
    if name == "LLM":
        from slotrunner.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
