"""RWKV-4 (RwkvForCausalLM): a recurrent language model with no attention and no KV cache.

Each layer mixes every token with the previous one (the token shift) and replaces attention by
WKV, a running exponentially decayed average of values. Both need state carried from one step
to the next per request, which RwkvModelState keeps (rwkv_state.py) and hands to forward().
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from slotrunner.models.weights import WeightLoader
from slotrunner_example_plugin.rwkv_state import RwkvState


@dataclass(frozen=True)
class RwkvArgs:
    vocab_size: int
    hidden_size: int
    attention_hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_norm_eps: float
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, c: object) -> RwkvArgs:
        # `rescale_every` halves the hidden state every few layers to keep fp16 in range; every
        # layer reads it through a LayerNorm, so in exact arithmetic it changes nothing.
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            attention_hidden_size=c.attention_hidden_size or c.hidden_size,
            intermediate_size=c.intermediate_size or 4 * c.hidden_size,
            num_layers=c.num_hidden_layers,
            layer_norm_eps=c.layer_norm_epsilon,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        )


@dataclass(frozen=True)
class StepRows:
    """Where each request's tokens sit in this step's flat token list."""

    slots: torch.Tensor  # [num_reqs] state row of each batch row
    first: torch.Tensor  # [num_reqs] index of each row's first token
    last: torch.Tensor  # [num_reqs] index of each row's last token
    row_of_token: torch.Tensor  # [num_tokens]
    col_of_token: torch.Tensor  # [num_tokens] offset within its row
    max_query_len: int

    @classmethod
    def build(cls, slots: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, num_tokens: int) -> StepRows:
        qsl = query_start_loc.long()
        lens = qsl[1:] - qsl[:-1]
        rows = torch.arange(len(lens), device=qsl.device)
        row_of_token = torch.repeat_interleave(rows, lens, output_size=num_tokens)
        col_of_token = torch.arange(num_tokens, device=qsl.device) - qsl[row_of_token]
        return cls(slots, qsl[:-1], qsl[1:] - 1, row_of_token, col_of_token, max_query_len)


def token_shift(x: torch.Tensor, shift_state: torch.Tensor, rows: StepRows) -> torch.Tensor:
    """Each token's predecessor: the previous token of its row, or for a row's first token the
    last token of its previous step (from the state). Then the state takes each row's last."""
    prev = torch.cat([x.new_zeros(1, x.shape[1]), x[:-1]])  # [num_tokens, hidden]
    prev[rows.first] = shift_state[rows.slots]
    shift_state[rows.slots] = x[rows.last]
    return prev


def wkv(
    decay: torch.Tensor,  # [dim] w = -exp(time_decay): log-decay per step
    bonus: torch.Tensor,  # [dim] u = time_first: extra weight of the current token
    k: torch.Tensor,  # [num_tokens, dim]
    v: torch.Tensor,  # [num_tokens, dim]
    state: torch.Tensor,  # [3, num_rows, dim] float32: numerator a, denominator b, offset p
    rows: StepRows,
) -> torch.Tensor:  # [num_tokens, dim]
    """out_t = (a + e^(u + k_t) v_t) / (b + e^(u + k_t)), where a and b sum e^(k_i) v_i and e^(k_i)
    over earlier tokens, decayed by e^w per step. The sums are kept scaled by e^(-p) so that no
    exponent overflows. Rows advance in lockstep; a row past its last token keeps its state."""
    num_reqs = len(rows.slots)
    padded = (num_reqs, rows.max_query_len, k.shape[1])
    kp = k.new_zeros(padded, dtype=torch.float32)
    vp = k.new_zeros(padded, dtype=torch.float32)
    kp[rows.row_of_token, rows.col_of_token] = k.float()
    vp[rows.row_of_token, rows.col_of_token] = v.float()
    a, b, p = state[:, rows.slots]  # each [num_reqs, dim]
    lens = rows.last - rows.first + 1
    out = torch.empty(padded, dtype=torch.float32, device=k.device)
    for t in range(rows.max_query_len):
        kt, vt = kp[:, t], vp[:, t]
        # Output: the state plus the current token weighted by e^(u + k).
        q = torch.maximum(p, bonus + kt)
        old, cur = torch.exp(p - q), torch.exp(bonus + kt - q)
        out[:, t] = (old * a + cur * vt) / (old * b + cur)
        # Next state: the old sums decayed by e^w plus the current token weighted by e^k.
        q = torch.maximum(p + decay, kt)
        old, cur = torch.exp(p + decay - q), torch.exp(kt - q)
        live = (t < lens)[:, None]
        a = torch.where(live, old * a + cur * vt, a)
        b = torch.where(live, old * b + cur, b)
        p = torch.where(live, q, p)
    state[:, rows.slots] = torch.stack([a, b, p])
    return out[rows.row_of_token, rows.col_of_token].to(k.dtype)


class RwkvSelfAttention(nn.Module):
    """The time mix: receptance-gated WKV over token-shifted keys and values."""

    def __init__(self, args: RwkvArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        d, h = args.attention_hidden_size, args.hidden_size
        self.time_decay = nn.Parameter(torch.empty(d))
        self.time_first = nn.Parameter(torch.empty(d))
        self.time_mix_key = nn.Parameter(torch.empty(h))
        self.time_mix_value = nn.Parameter(torch.empty(h))
        self.time_mix_receptance = nn.Parameter(torch.empty(h))
        self.key = nn.Linear(h, d, bias=False)
        self.value = nn.Linear(h, d, bias=False)
        self.receptance = nn.Linear(h, d, bias=False)
        self.output = nn.Linear(d, h, bias=False)

    def forward(self, x: torch.Tensor, state: RwkvState, rows: StepRows) -> torch.Tensor:
        prev = token_shift(x, state.attn_shift[self.layer_idx], rows)

        def mix(w: torch.Tensor) -> torch.Tensor:
            return x * w + prev * (1 - w)

        k, v = self.key(mix(self.time_mix_key)), self.value(mix(self.time_mix_value))
        r = torch.sigmoid(self.receptance(mix(self.time_mix_receptance)))
        out = wkv(-torch.exp(self.time_decay.float()), self.time_first.float(), k, v, state.wkv[self.layer_idx], rows)
        return self.output(r * out)


class RwkvFeedForward(nn.Module):
    """The channel mix: a squared-ReLU MLP over token-shifted input, gated by receptance."""

    def __init__(self, args: RwkvArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        h = args.hidden_size
        self.time_mix_key = nn.Parameter(torch.empty(h))
        self.time_mix_receptance = nn.Parameter(torch.empty(h))
        self.key = nn.Linear(h, args.intermediate_size, bias=False)
        self.receptance = nn.Linear(h, h, bias=False)
        self.value = nn.Linear(args.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, state: RwkvState, rows: StepRows) -> torch.Tensor:
        prev = token_shift(x, state.ffn_shift[self.layer_idx], rows)
        k = x * self.time_mix_key + prev * (1 - self.time_mix_key)
        r = x * self.time_mix_receptance + prev * (1 - self.time_mix_receptance)
        return torch.sigmoid(self.receptance(r)) * self.value(torch.relu(self.key(k)).square())


class RwkvBlock(nn.Module):
    def __init__(self, args: RwkvArgs, layer_idx: int) -> None:
        super().__init__()
        # The first block also normalises the embeddings.
        self.pre_ln = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps) if layer_idx == 0 else nn.Identity()
        self.ln1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.ln2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.attention = RwkvSelfAttention(args, layer_idx)
        self.feed_forward = RwkvFeedForward(args, layer_idx)

    def forward(self, x: torch.Tensor, state: RwkvState, rows: StepRows) -> torch.Tensor:
        x = self.pre_ln(x)
        x = x + self.attention(self.ln1(x), state, rows)
        return x + self.feed_forward(self.ln2(x), state, rows)


class RwkvModel(nn.Module):
    def __init__(self, args: RwkvArgs) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.blocks = nn.ModuleList(RwkvBlock(args, i) for i in range(args.num_layers))
        self.ln_out = nn.LayerNorm(args.hidden_size)  # transformers builds it with the default eps


class RwkvForCausalLM(nn.Module):
    def __init__(self, hf_config: object) -> None:
        super().__init__()
        self.args = RwkvArgs.from_hf(hf_config)
        self.rwkv = RwkvModel(self.args)
        self.head = None if self.args.tie_word_embeddings else nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]; unused: the order of the recurrence is the position
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden]
        *,
        state: RwkvState,
        state_indices: torch.Tensor,  # [num_reqs]
        query_start_loc: torch.Tensor,  # [num_reqs + 1]
        max_query_len: int,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.rwkv.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        rows = StepRows.build(state_indices, query_start_loc, max_query_len, x.shape[0])
        for block in self.rwkv.blocks:
            x = block(x, state, rows)
        return self.rwkv.ln_out(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab]
        weight = self.rwkv.embeddings.weight if self.head is None else self.head.weight
        return torch.nn.functional.linear(hidden, weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # The loader's tied-embedding rule knows `lm_head`; RWKV calls its head `head`.
        tied = self.head is None
        return WeightLoader(self).load((n, t) for n, t in checkpoint_to_model(weights) if not (tied and n == "head.weight"))


def checkpoint_to_model(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stores the time-mix vectors as [1, 1, hidden] (to broadcast over
    [batch, seq, hidden]); this model's tokens are flat, so they become [hidden]."""
    for name, tensor in weights:
        yield name, (tensor.reshape(-1) if ".time_mix_" in name else tensor)
