"""The ModelState contract: the hooks the common runner calls for family-specific state.

The runner owns what every architecture has (token history, lengths, block tables, sampling
state). Whatever one family needs beyond that -- per-slot recurrent state pools (recurrent hybrids), encoder
outputs and cross-attention caches (encoder-decoders), media embeddings and M-RoPE deltas
(multimodal) -- lives in a ModelState subclass, indexed by the request's stable slot.

At intake, before a request is queued, the class method `process_prompt` reads its prompt.
Hooks run in this order in a step:

    remove_request / add_request      (slot bookkeeping, before inputs are built)
    preprocess_state(batch)           (before the forward: encoder runs, state copies)
    prepare_attn(batch)               (family attention metadata)
    prepare_inputs_embeds(batch)      (merged embeddings, or None)
    prepare_inputs(batch)             (typed extra model inputs)
    -- forward --
    save_state_checkpoints(slots, entries)  (only with checkpoints_state, for prefix caching)
    -- logits, sampling --
    postprocess_state(batch, ...)     (advance state by accepted tokens)

Rules for every hook: never reorder or move persistent per-slot state (a step only gathers
through `batch.idx_mapping`); never synchronize host and device in the step hooks
(`preprocess_state` .. `postprocess_state`) unless the family truly cannot avoid it; never
raise for user input (that is rejected at intake).
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from slotrunner.core_runner.attention.backend import FamilyAttnMetadata
from slotrunner.core_runner.engine.intake import IntakeContext, ProcessedPrompt, PromptType, process_text_prompt

if TYPE_CHECKING:
    from slotrunner.core_runner.config import EngineConfig
    from slotrunner.core_runner.runner.scheduler_output import NewRequestData
    from slotrunner.core_runner.runner.input_batch import InputBatch


@dataclass(frozen=True)
class ModelInputs:
    """Typed extra keyword inputs of the model's forward, beyond `input_ids` and `positions`.

    Families subclass it (e.g. encoder outputs, recurrent-state indices, an M-RoPE position
    override [3, num_tokens]); every field becomes a keyword argument of `model.forward`.
    """

    def as_kwargs(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class CacheSpec:
    """What `initialize_cache` learns about the allocated KV cache."""

    num_blocks: int
    block_size: int
    dtype: torch.dtype
    device: torch.device


class ModelState(abc.ABC):
    """Runner-side state of one model family, one row per slot.

    Subclasses implement `add_request` (it carries the preemption rule: everything a slot holds
    must be rebuilt from NewRequestData alone); every other hook defaults to doing nothing and is
    overridden where the family needs it.
    """

    # Human-readable family name, shown by `python -m slotrunner models`.
    family: ClassVar[str] = "abstract"
    # Whether a request may be admitted with KV blocks it did not compute itself: prefix-cache
    # hits, which is also how parallel samples (n > 1) share their prompt. True when
    # `add_request` rebuilds all other per-request state from NewRequestData alone, whatever
    # `num_computed_tokens` it arrives with, and when everything the KV depends on besides the
    # tokens is in the request's `FamilyInputs.cache_key_spans`. A family whose state summarises
    # the tokens outside KV blocks sets False -- the engine then computes every prompt from token
    # 0 and refuses an explicit enable_prefix_caching=True -- unless it checkpoints that state
    # (`checkpoints_state`).
    shares_prefix_kv: ClassVar[bool] = True
    # Whether the family's per-request state beyond KV blocks is checkpointed for prefix caching
    # (recurrent state): the engine then keeps `config.num_state_checkpoints` checkpoints, each
    # the whole state of a slot at a block boundary of a prompt, keyed by that block's hash
    # (`core_runner/engine/state_checkpoints.py`). The family allocates them (counted in
    # `cache_bytes`), fills them in `save_state_checkpoints` and restores one in `add_request`
    # from `NewRequestData.state_checkpoint`. A hit then ends only where a checkpoint exists.
    checkpoints_state: ClassVar[bool] = False
    # Whether decode steps may replay CUDA graphs. True only when, for a decode-only batch,
    # `prepare_inputs_embeds` returns None and `prepare_attn` / `prepare_inputs` return tensors
    # that live at the addresses `prepare_dummy_attn` / `prepare_dummy_inputs` gave at capture
    # (persistent buffers the hooks rewrite in place): a graph replays the capture's tensors,
    # not the step's.
    supports_cuda_graphs: ClassVar[bool] = False
    # Whether decode steps whose rows carry speculative drafts (1 + drafts query tokens per row)
    # may replay CUDA graphs too, under the same contract for such batches. False: those steps
    # run eagerly (the runner's default decode steps still replay).
    cuda_graphs_with_drafts: ClassVar[bool] = False
    # Whether a step that is one request's prefill chunk (one row of 2..PREFILL_GRAPH_LENS[-1]
    # tokens, alone in its batch: an interactive request's prompt) may replay a graph captured
    # at the next power-of-two token count, under the same contract for such batches (a prompt
    # with media, whose prepare_inputs_embeds returns embeddings, may not). False: eager.
    cuda_graphs_for_prefill: ClassVar[bool] = False
    # Whether speculative decoding may run: rejected drafts must leave no trace. True when the
    # family's per-request state is only in KV blocks (rejected positions are overwritten later)
    # or when `postprocess_state` rolls its state back to the last accepted token. False: the
    # engine builder refuses a speculative_config for the family, naming it.
    supports_speculative_rollback: ClassVar[bool] = True
    # What the family requires of its model beyond forward / compute_logits / load_weights: a
    # `typing.Protocol` declared beside the state. The registry checks a model class against it
    # when the architecture is resolved, naming any missing member (`missing_members`).
    model_protocol: ClassVar[type | None] = None

    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device) -> None:
        """Called once, after the model is built and loaded. Allocate per-slot tables sized by
        `config.max_num_seqs` here; never allocate per step."""
        self.config = config
        self.model = model
        self.device = device

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if abc.ABC in cls.__bases__:
            return
        # Checked here, at class creation, so the author sees the error where the class is
        # defined (or registered) rather than when the engine first instantiates it.
        missing = sorted(n for n in dir(cls) if getattr(getattr(cls, n, None), "__isabstractmethod__", False))
        if missing:
            raise TypeError(f"{cls.__name__} subclasses ModelState but does not implement: {', '.join(missing)}")
        if cls.checkpoints_state and cls.save_state_checkpoints is ModelState.save_state_checkpoints:
            raise TypeError(f"{cls.__name__} sets checkpoints_state but does not implement save_state_checkpoints")

    # Threads that may read the prompts of one `LLM.generate` call at once (`process_prompt` is a
    # classmethod touching no runner state): above 1 for a family whose intake decodes and
    # preprocesses media on the host, so that a batch of images is not read one by one while
    # the device waits. Capped by the machine's cores.
    intake_workers: ClassVar[int] = 1

    @classmethod
    def process_prompt(cls, prompt: PromptType, ctx: IntakeContext) -> ProcessedPrompt:
        """Called at intake, once per request, before it is queued (there is no slot yet): read
        the user's prompt into token ids plus the family's inputs (`FamilyInputs`: encoder
        features, media), raising ValueError with a clear message for anything wrong. Must not
        touch runner or device state. Default: a text or token-id prompt, no family inputs."""
        return process_text_prompt(prompt, ctx)

    def cache_bytes(self, dtype: torch.dtype) -> int:
        """Bytes `initialize_cache` will allocate on the device (recurrent-state pools,
        cross-attention caches) for a model of `dtype`. Called before the KV cache is sized, on an
        instance built for that question alone: the engine gives the KV cache only what is left."""
        return 0

    def initialize_cache(self, spec: CacheSpec) -> None:
        """Called once after the KV cache is allocated. Allocate recurrent-state pools or
        cross-attention caches here."""

    @abc.abstractmethod
    def add_request(self, slot: int, new_request: NewRequestData) -> None:
        """Called when a request is admitted to `slot` -- also when it is re-admitted after a
        preemption, in which case all family state must be rebuilt from `new_request` alone
        (recurrent state reset, positions recomputed). Runs on the host before inputs are built;
        may stage small device writes but must not run the model."""

    def remove_request(self, slot: int) -> None:
        """Called when the request in `slot` finishes, is aborted or is preempted. Free family
        state; the slot may be handed to another request in the same step."""

    def preprocess_state(self, batch: InputBatch) -> None:
        """Called every step before the forward: run encoders for newly admitted requests, copy
        or zero state rows. Must not reorder slot state."""

    def prepare_attn(self, batch: InputBatch) -> FamilyAttnMetadata | None:
        """Called every forward: family attention metadata, or None when the common attention
        metadata suffices."""
        return None

    def prepare_inputs_embeds(self, batch: InputBatch) -> torch.Tensor | None:
        """Called every forward: input embeddings [num_tokens, hidden] with media merged at
        placeholder positions, or None to let the model embed `batch.input_ids` itself."""
        return None

    def prepare_inputs(self, batch: InputBatch) -> ModelInputs:
        """Called every forward: typed extra model inputs for this batch (default: none)."""
        return ModelInputs()

    def prepare_dummy_attn(self, num_reqs: int) -> FamilyAttnMetadata | None:
        """Called for CUDA-graph capture of a decode batch of `num_reqs` rows: the family
        attention metadata over the persistent buffers `prepare_attn` rewrites every step."""
        return None

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> ModelInputs:
        """Called for warm-up and CUDA-graph capture: extra inputs of the right shapes, with no
        live requests behind them (default: none, as `prepare_inputs`)."""
        return ModelInputs()

    def save_state_checkpoints(self, slots: list[int], entries: list[int]) -> None:
        """Called after a forward, only for families with `checkpoints_state` and only when the
        step ends some rows' chunks at checkpoint positions: copy the whole state of each of
        `slots` into the state-cache entry at the same index of `entries` (on the device, no
        host sync). An entry may hold another prefix's state until then: overwrite it. A family
        with `checkpoints_state` must implement it (checked when the class is created)."""
        raise NotImplementedError(f"{type(self).__name__} does not checkpoint its state (checkpoints_state is False)")

    def postprocess_state(self, batch: InputBatch, num_sampled: torch.Tensor, num_rejected: torch.Tensor) -> None:
        """Called after sampling. `num_sampled` [num_reqs] tokens were sampled per row, of which
        `num_rejected` [num_reqs] were rejected drafts: advance recurrent state by accepted tokens
        only. Runs on device; must not synchronize."""


def missing_members(protocol: type, cls: type) -> list[str]:
    """Members `protocol` declares (methods, properties, annotated attributes) that `cls` lacks.
    Checked on the class, before any instance exists: an attribute a model sets only in its
    `__init__` must be declared as a class attribute (or property) to pass."""
    declared = set(getattr(protocol, "__annotations__", {}))
    declared |= {n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return sorted(n for n in declared if not hasattr(cls, n))
