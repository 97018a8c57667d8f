"""Request: one prompt's life inside the engine (tokens, status, stop checks)."""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field

from slotrunner.core_runner.engine.intake import FamilyInputs
from slotrunner.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted and waiting to recompute
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    def __init__(self, value: str) -> None:
        # An attribute of each member, not a property: it is read per row per step.
        self.finished = value not in ("waiting", "running")


@dataclass(eq=False)
class Request:
    """Engine-side record of a request. The runner never sees this object, only `NewRequestData`.

    Equal only to itself: the scheduler finds a request in its queues (`list.remove`) for every
    request that finishes, and a field-by-field comparison with each one before it cost ~0.3 ms
    at the end of 512 running requests.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]  # the model's end-of-sequence ids (several for some chat models)
    arrival: int  # admission order; FCFS ties are broken by it
    seed: int  # resolved Gumbel seed (the user's seed, or one drawn at intake)
    prompt: str | None = None
    family_inputs: FamilyInputs | None = None  # what the family's process_prompt extracted
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # SamplingParams.bad_words, tokenized at intake
    # Parallel sampling (n > 1): the user's request becomes n requests at intake, sample i seeded
    # with seed + i; they share the prompt's KV through the prefix cache.
    group: str | None = None  # the user's request id, when it differs from req_id
    sample_index: int = 0
    # Prefix cache: whether this request may take cached blocks (not when it wants prompt
    # logprobs, which need every prompt position computed), the hashes of its full blocks of
    # known tokens, and how many prompt tokens its first admission found in the cache.
    cacheable: bool = True
    block_hashes: list[bytes] = field(default_factory=list)
    # Full blocks already handed to the block manager's cache (the scheduler's watermark: each
    # step registers only the blocks filled since). Reset when the request loses its blocks.
    num_registered_blocks: int = 0
    num_cached_tokens: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Async scheduling: tokens that steps still in flight will sample, not known yet. The
    # scheduler schedules them (the runner reads them from its device-side history).
    num_pending: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Speculative decoding: drafts the runner holds for the request's next step (proposed by the
    # last step that sampled for it and was processed), drafts scheduled in steps not processed
    # yet (their KV counts in num_computed_tokens until update() rolls the rejected ones back),
    # and the totals proposed to and accepted by the target (RequestOutput.metrics).
    num_spec_tokens: int = 0
    num_inflight_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # What check_stop reads every token, taken from `sampling_params` once: the request's own
    # copy (intake copies the user's), never changed after the request is made.
    _stop_ids: frozenset[int] = field(init=False, repr=False)  # EOS (unless ignore_eos) and stop_token_ids
    _max_tokens: int = field(init=False, repr=False)  # sys.maxsize when max_tokens is None
    group_id: str = field(init=False, repr=False)  # the user's request id (`group`, else req_id)
    # Output tokens it may reach at most: min(max_tokens, max_model_len - prompt length), set by
    # the scheduler that takes it (`set_output_limit`), read per row per step (None before).
    max_output: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.group_id = self.group if self.group is not None else self.req_id
        sp = self.sampling_params
        self._stop_ids = frozenset(sp.stop_token_ids or ()) | frozenset(() if sp.ignore_eos else self.eos_token_ids)
        self._max_tokens = sys.maxsize if sp.max_tokens is None else sp.max_tokens

    def output_limit(self, max_model_len: int) -> int:
        """Output tokens it may reach at most under `max_model_len` (and its max_tokens)."""
        if self.max_output is not None:
            return self.max_output
        return min(self._max_tokens, max_model_len - len(self.prompt_token_ids))

    def set_output_limit(self, max_model_len: int) -> None:
        self.max_output = None
        self.max_output = self.output_limit(max_model_len)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_from(self, start: int) -> list[int]:
        """The known tokens from position `start` on: a copy of those alone, not of the sequence."""
        num_prompt = len(self.prompt_token_ids)
        return self.output_token_ids[start - num_prompt :] if start >= num_prompt else self.prompt_token_ids[start:] + self.output_token_ids

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    def draft_room(self, max_model_len: int) -> int:
        """Drafts a decode step may carry: all accepted plus the bonus token must stay within
        max_tokens and max_model_len (drafts past a stop would be dropped anyway), counting
        every token that steps in flight may still add."""
        ahead = self.num_pending + self.num_inflight_drafts
        room = max_model_len - self.num_tokens - ahead - 1
        max_tokens = self.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - len(self.output_token_ids) - ahead - 1)
        return max(room, 0)

    def done_when_pending_arrive(self, max_model_len: int, with_drafts: bool = False) -> bool:
        """Whether the tokens in flight already bring the request to max_tokens or to
        max_model_len: it finishes when they arrive, so no further step is scheduled for it.
        `with_drafts`: whether they may, counting every draft in flight as accepted (a step
        scheduled on that count could pass the limits: it waits for them)."""
        num_output = len(self.output_token_ids) + self.num_pending + (self.num_inflight_drafts if with_drafts else 0)
        return num_output >= self.output_limit(max_model_len)

    @property
    def min_tokens_reached(self) -> bool:
        """Whether the known output already holds min_tokens (the count under async scheduling
        may lag, never lead)."""
        return len(self.output_token_ids) >= (self.sampling_params.min_tokens or 0)

    def settle_drafts(self, num_drafts: int, num_sampled: int) -> None:
        """A step that verified `num_drafts` of its drafts sampled `num_sampled` tokens for it (the
        accepted drafts and the token after them). The KV of rejected drafts is not the request's:
        it recomputes from the first rejected position (the new token's KV is computed next step,
        as in any decode). A request preempted since has no KV to roll back."""
        num_accepted = num_sampled - 1
        assert 0 <= num_accepted <= num_drafts, f"{self.req_id!r}: {num_sampled} tokens for {num_drafts} drafts"
        if self.status == RequestStatus.RUNNING:
            self.num_computed_tokens -= num_drafts - num_accepted
        self.num_inflight_drafts -= num_drafts
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted

    def append_sampled(self, token_ids: list[int], max_model_len: int) -> bool:
        """Append a step's sampled tokens (several with drafts) up to the first one that finishes
        the request -- EOS, a stop id, max_tokens or max_model_len -- and set its finished status;
        tokens after that one are dropped. Returns whether it finished. Called for every
        sampling row every step: one call a row, not one a token."""
        output = self.output_token_ids
        max_len = self.max_output  # set by the scheduler; output_limit() for a request outside one
        if max_len is None:
            max_len = self.output_limit(max_model_len)
        # A step scheduled ahead (async scheduling) left one token pending, whatever number of
        # drafts it accepts: counting each accepted draft off it too would leave the request's
        # next step in flight uncounted, and it would go unscheduled a step (the pipeline empties).
        if self.num_pending:
            self.num_pending -= 1
        for token_id in token_ids:
            output.append(token_id)
            if token_id in self._stop_ids:  # EOS wins over a stop id that is also EOS: no stop_reason
                is_eos = not self.sampling_params.ignore_eos and token_id in self.eos_token_ids
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, None if is_eos else token_id
                return True
            if len(output) >= max_len:
                self.status = RequestStatus.FINISHED_LENGTH
                return True
        return False
