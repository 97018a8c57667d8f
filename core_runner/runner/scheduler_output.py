"""SchedulerOutput: what the scheduler decided for one step, as the runner receives it."""

from __future__ import annotations

from dataclasses import dataclass, field

from slotrunner.core_runner.engine.intake import FamilyInputs
from slotrunner.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request entering the runner: first admission, or re-admission after preemption.

    `prefill_token_ids` is the prompt plus, after a preemption, the tokens generated before it
    (prefill_len >= prompt_len); the first `num_computed_tokens` of them are already in the KV
    blocks it arrives with (prefix-cache hits), the rest the runner computes. `block_ids` has one
    list per KV-cache group (core_runner/runner/kv_cache.py); a sliding-window group's list has
    NULL_BLOCK where its window has passed.
    """

    req_id: str
    prompt_len: int
    prefill_token_ids: list[int]
    block_ids: list[list[int]]  # per KV-cache group, in sequence order
    num_computed_tokens: int
    sampling_params: SamplingParams
    seed: int
    family_inputs: FamilyInputs | None = None  # encoder inputs, media: see ModelState.process_prompt
    eos_token_ids: tuple[int, ...] = ()  # suppressed until min_tokens, unless ignore_eos
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # token sequences never to complete
    # Families that checkpoint their state (ModelState.checkpoints_state): the state-cache entry
    # holding the state after the first `num_computed_tokens` tokens, to restore into the slot;
    # None when nothing was computed (or the family keeps no state beyond KV blocks).
    state_checkpoint: int | None = None

    @property
    def prefill_len(self) -> int:
        return len(self.prefill_token_ids)


@dataclass(frozen=True)
class CachedRequestData:
    """The requests already in the runner that are scheduled again this step, as columns (one
    entry per request, in batch order): a decode step of a large batch builds no object per row.
    """

    req_ids: list[str] = field(default_factory=list)  # [num_cached_reqs]
    num_computed_tokens: list[int] = field(default_factory=list)  # [num_cached_reqs] before the step
    # req_id -> per KV-cache group, the block ids appended to its table row: only the requests
    # that grew this step (a decode row grows once every block_size steps).
    new_block_ids: dict[str, list[list[int]]] = field(default_factory=dict)


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    # req_id -> tokens to compute this step, in batch order (new requests after cached ones).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Requests whose slot must be freed before this step: finished, aborted or preempted.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # req_id -> state-cache entry: after this step's forward, save the slot's recurrent state
    # there (its chunk ends at a checkpoint position: engine/state_checkpoints.py).
    state_checkpoints: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: whether the speculator proposes drafts after this step (the draft
    # gate wants them for the next one); False: it is skipped, and the next step has none.
    propose_drafts: bool = True
    # How many drafts each row that carries some carries (req_id -> drafts; update() rolls back
    # the rejected ones).
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    # Whether steps with drafts overlap like plain ones (EngineConfig.overlap_drafts): the next
    # step is scheduled counting every draft in flight as accepted, and the runner takes the
    # rejected ones back on the device. Otherwise a step that carries or proposes drafts is
    # processed before another is scheduled.
    overlap_drafts: bool = False
    # Scheduled while the step before it, which carried drafts, had not been processed: its rows
    # from that step start where the drafts it accepts end, known on the device only.
    behind_drafts: bool = False
    # The draft gate measures this step (a decode-only step that carries drafts and proposes the
    # next, or does neither): True / False for the arm it measures; None: not measured.
    gate_arm: bool | None = None
    scheduled_at: float = 0.0  # time.perf_counter() at the end of schedule(), for a measured step


    @property
    def carries_drafts(self) -> bool:
        """Whether some row of this step carries drafts."""
        return bool(self.num_draft_tokens)

    @property
    def needs_settling(self) -> bool:
        """Whether the next step may be scheduled only after this one's output is processed:
        it carries drafts, or its speculator proposes some (the scheduler sets propose_drafts
        False where nothing speculates), and steps with drafts do not overlap."""
        return not self.overlap_drafts and (self.carries_drafts or self.propose_drafts)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens
