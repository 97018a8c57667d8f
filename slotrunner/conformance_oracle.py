"""The conformance oracle: tiny random-weight cases saved by transformers, and transformers'
answer for one request (logits over a sequence, greedy continuation). Part of the harness in
`slotrunner/conformance.py`, which re-exports these names.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


class ConformanceError(ValueError):
    """A case that cannot be built or checked as asked (not a failed check)."""


# -- building cases ---------------------------------------------------------------------------


def perturb_constants(model: torch.nn.Module, seed: int = 0) -> None:
    """Multiply constant-initialised tensors (norm weights = 1, biases = 0) by (1 + N(0, 0.1))
    and add N(0, 0.02), so a bug that ignores them cannot hide behind their init values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.detach().flatten()
            if flat.numel() and bool((flat == flat[0]).all()):
                noise = torch.randn(p.shape, generator=gen)
                p.mul_(1 + 0.1 * noise.to(p.dtype)).add_(0.02 * torch.randn(p.shape, generator=gen).to(p.dtype))


def transformers_class(architecture: str) -> type:
    """The transformers class named `architecture`: the oracle. Registering under transformers'
    own class name is also what makes its checkpoints resolve to your model."""
    import transformers

    cls = getattr(transformers, architecture, None)
    if not isinstance(cls, type) or not hasattr(cls, "from_pretrained"):
        raise ConformanceError(
            f"transformers {transformers.__version__} has no model class {architecture!r}: conformance compares "
            "against transformers' implementation, so register the architecture under the class name that "
            "transformers writes into config.json's 'architectures'"
        )
    return cls


def _auto_class(hf_config: Any) -> type:
    """The class that builds `hf_config`: the one its `architectures` names, else the Auto class."""
    import transformers

    archs = getattr(hf_config, "architectures", None) or []
    if archs:
        return transformers_class(archs[0])
    if getattr(hf_config, "is_encoder_decoder", False):
        if type(hf_config) in transformers.AutoModelForSpeechSeq2Seq._model_mapping:
            return transformers.AutoModelForSpeechSeq2Seq
        return transformers.AutoModelForSeq2SeqLM
    return transformers.AutoModelForCausalLM


def build_case(hf_config: Any, directory: str | Path, seed: int = 0) -> torch.nn.Module:
    """Instantiate `hf_config` in transformers (the class its `architectures` names, else the
    Auto class) with a fixed seed, perturb constants, save it to `directory` and return it in
    eval mode. The weights are saved once: random init differs between transformers versions.
    Constant *buffers* that checkpoints store (BART's zero `final_logits_bias`, NemotronH's
    router correction bias) are perturbed too, so a model that drops them fails."""
    cls = _auto_class(hf_config)
    torch.manual_seed(seed)
    if hasattr(cls, "from_config"):  # an Auto class
        model = cls.from_config(hf_config, dtype=torch.float32)
    else:
        model = cls(hf_config).float()
    perturb_constants(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    saved = set(model.state_dict())
    with torch.no_grad():
        for name, buf in model.named_buffers():
            flat = buf.detach().flatten()
            if buf.is_floating_point() and name in saved and flat.numel() and bool((flat == flat[0]).all()):
                buf.add_(0.5 * torch.randn(buf.shape, generator=gen).to(buf.dtype))
    model.eval()
    model.save_pretrained(str(directory))
    return model


def build_seq2seq_case(hf_config: Any, directory: str | Path, seed: int = 0) -> torch.nn.Module:
    """`build_case` for an encoder-decoder config (kept for the callers that name the family)."""
    return build_case(hf_config, directory, seed)


# -- oracles: transformers' answer for one request --------------------------------------------


@dataclass(frozen=True)
class ConformanceRequest:
    """One request as slotrunner takes it and as the oracle takes it."""

    prompt: Any  # what LLM.generate takes: {"prompt_token_ids": [...]}, {"encoder_prompt": ...}, ...
    # transformers' inputs beside the decoder token ids (an encoder's input_ids or input_features)
    oracle_inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)


def hf_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits over one unpadded sequence: [len, vocab]. Positions are passed
    explicitly where the model takes them (GPT-2's absolute positions, Bamba's offset)."""
    ids = torch.tensor([token_ids])
    kwargs = {}
    if "position_ids" in inspect.signature(hf_model.forward).parameters:
        kwargs["position_ids"] = torch.arange(len(token_ids))[None]
    with torch.no_grad():
        out = hf_model(input_ids=ids, **kwargs)
    return out.logits[0].float()


def hf_greedy(hf_model: torch.nn.Module, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation through `generate` (its own cache path)."""
    with torch.no_grad():
        seq = hf_model.generate(
            torch.tensor([prompt_token_ids]),
            attention_mask=torch.ones(1, len(prompt_token_ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return seq[0, len(prompt_token_ids) :].tolist()


def hf_seq2seq_logits(hf_model: torch.nn.Module, encoder_kwargs: Mapping[str, torch.Tensor], decoder_ids: list[int]) -> torch.Tensor:
    """transformers' logits over one decoder sequence given one encoder input: [len, vocab].
    Float inputs (audio features) take the model's dtype, so a float64 oracle runs in float64."""
    dtype = next(hf_model.parameters()).dtype
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in encoder_kwargs.items()}
    with torch.no_grad():
        out = hf_model(**inputs, decoder_input_ids=torch.tensor([decoder_ids]))
    return out.logits[0].float()


def hf_seq2seq_greedy(
    hf_model: torch.nn.Module, encoder_kwargs: Mapping[str, torch.Tensor], decoder_prompt: list[int], max_tokens: int
) -> list[int]:
    """Greedy continuation by transformers' forward, one full pass per token (generate() adds
    model-specific logits processors -- Whisper's especially -- that are not the model)."""
    seq = list(decoder_prompt)
    for _ in range(max_tokens):
        seq.append(int(hf_seq2seq_logits(hf_model, encoder_kwargs, seq)[-1].argmax()))
    return seq[len(decoder_prompt) :]


class CausalLMOracle:
    """A decoder-only transformers model: the request's tokens are all it reads."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        self.hf_model = hf_model

    def logits(self, request: ConformanceRequest, token_ids: list[int]) -> torch.Tensor:  # [len, vocab]
        return hf_logits(self.hf_model, token_ids)

    def greedy(self, request: ConformanceRequest, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
        return hf_greedy(self.hf_model, prompt_token_ids, max_tokens)


class Seq2SeqOracle:
    """An encoder-decoder transformers model: the encoder input comes from `oracle_inputs`."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        self.hf_model = hf_model

    def logits(self, request: ConformanceRequest, token_ids: list[int]) -> torch.Tensor:  # [len, vocab]
        return hf_seq2seq_logits(self.hf_model, request.oracle_inputs, token_ids)

    def greedy(self, request: ConformanceRequest, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
        return hf_seq2seq_greedy(self.hf_model, request.oracle_inputs, prompt_token_ids, max_tokens)


# -- the noise floor of a real checkpoint -----------------------------------------------------


class PerturbedOracle:
    """The oracle with every float32 weight moved by one ulp, in a random direction per element:
    its distance from the unperturbed oracle is the model's float32 sensitivity, the noise floor
    when a float64 copy of a large model does not fit in memory. The weights are moved in place
    for each call and moved back exactly (one ulp up, then one down), so no second copy exists."""

    def __init__(self, oracle: Any, seed: int = 0) -> None:
        self.oracle = oracle
        self.seed = seed

    def _step(self, sign: float) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.oracle.hf_model.parameters()):
                if p.dtype != torch.float32:
                    continue
                gen = torch.Generator().manual_seed(self.seed + i)  # the same directions both ways
                up = torch.rand(p.shape, generator=gen) < 0.5
                direction = torch.where(up, sign * torch.inf, -sign * torch.inf).to(p.device)
                p.copy_(torch.nextafter(p, direction))

    def logits(self, request: ConformanceRequest, token_ids: list[int]) -> torch.Tensor:  # [len, vocab]
        self._step(1.0)
        try:
            return self.oracle.logits(request, token_ids)
        finally:
            self._step(-1.0)


def floor_oracle(oracle: Any, method: str) -> Any:
    """The oracle whose distance from `oracle` is the noise floor: "float64" (a float64 copy of
    the model: transformers' own float32 error) or "ulp" (`PerturbedOracle`: no copy)."""
    import copy

    if method == "float64":
        return type(oracle)(copy.deepcopy(oracle.hf_model).double())
    if method == "ulp":
        return PerturbedOracle(oracle)
    raise ConformanceError(f"noise floor method {method!r}: use 'float64', 'ulp' or 'auto'")


def floor_method(hf_model: torch.nn.Module) -> str:
    """"float64" when a float64 copy of the model fits in half the memory available now, else "ulp"."""
    import os

    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not Linux: assume the copy fits
        return "float64"
    copy_bytes = 8 * sum(p.numel() for p in hf_model.parameters())
    return "float64" if copy_bytes < available // 2 else "ulp"
