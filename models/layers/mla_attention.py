"""MLAAttention: multi-head latent attention over a paged cache of compressed latents.

DeepSeek-V2/V3 project each token to a latent `c` (kv_lora_rank wide, after kv_a_layernorm) and
one rotary key `k_pe` shared by all heads; per-head keys and values are `c @ W_UK[h]^T` (no
rope part) and `c @ W_UV[h]^T`, with `W_UK`, `W_UV` the two halves of each head's rows of
`kv_b_proj`. The cache keeps only `c` and `k_pe` per token (`KVCacheSpec` "mla_latent": one row
of rank + rope channels), about 2 * heads * head_dim / (rank + rope) times less than K and V.

How a batch row attends depends on its query length alone (a decode row's sums may run in
another order in a batch of another row count: `decode_splits`, mla_decode.py):
- one query token (decode): the absorbed form -- the query is taken into the latent space
  through W_UK, attends over the cached latents (`mla_decode`: Triton where it runs, its torch
  reference elsewhere) and leaves through W_UV. A decode-only step (every CUDA-graph step) reads
  no device value on the host.
- several query tokens (a prefill chunk, speculative drafts): the row's cached latents,
  including any cached prefix, are expanded into per-head K/V and attended causally; every such
  row of the step goes through one gather, one expansion matmul and one attention launch
  (`mla_prefill`).

Under tensor parallelism the layer is built with the rank's heads and is handed their rows of
`kv_b_proj`; the latent cache is the same on every rank (there is no KV head to split).
"""

from __future__ import annotations

import numpy as np
import torch

from slotrunner.core_runner.attention.backend import AttentionMetadata
from slotrunner.core_runner.attention.cache_spec import KVCacheSpec, PagedCacheLayer
from slotrunner.core_runner.attention.forward_context import get_forward_context
from slotrunner.models.layers.mla_decode import mla_decode, write_latent
from slotrunner.models.layers.mla_prefill import mla_prefill


class MLAAttention(PagedCacheLayer):
    # Rows of several query tokens are laid out from host-side lengths (`MLAPrefillPlan`).
    multi_token_rows_in_graphs = False

    def __init__(
        self,
        num_heads: int,  # this rank's heads
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        scale: float,
        layer_idx: int,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.nope = qk_nope_head_dim
        self.rope = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.rank = kv_lora_rank
        self.scale = scale
        self.layer_idx = layer_idx
        self.kv_cache: torch.Tensor | None = None  # [num_blocks, block_size, rank + rope], bound by the runner

    def kv_cache_spec(self) -> KVCacheSpec:
        # Not divided by tensor parallelism: `num_heads` is this rank's share of the heads, but
        # every head reads the whole latent and rope key, so each rank caches all of them.
        # Its kernels read a float8 cache too (kv_cache_dtype="fp8": mla_decode.py).
        return KVCacheSpec("mla_latent", (self.rank + self.rope,), supports_fp8=True)

    def forward(
        self,
        q_nope: torch.Tensor,  # [num_tokens, num_heads, qk_nope_head_dim]
        q_pe: torch.Tensor,  # [num_tokens, num_heads, qk_rope_head_dim], rotated
        latent: torch.Tensor,  # [num_tokens, kv_lora_rank], normed
        k_pe: torch.Tensor,  # [num_tokens, qk_rope_head_dim], rotated
        w_kv_b: torch.Tensor,  # [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]: kv_b_proj.weight
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
        assert self.kv_cache is not None, f"layer {self.layer_idx}: KV cache not bound before the forward"
        meta = get_forward_context().attn
        write_latent(self.kv_cache, latent, k_pe, meta.slot_mapping)
        w = w_kv_b.view(self.num_heads, self.nope + self.v_head_dim, self.rank)
        num_tokens = q_nope.shape[0]
        if meta.max_query_len == 1 and num_tokens == meta.num_reqs:  # decode only: token i is row i
            return self._decode(q_nope, q_pe, w, meta.block_tables, meta.seq_lens)
        out = q_nope.new_zeros(num_tokens, self.num_heads, self.v_head_dim)  # tokens of no row stay 0
        qsl = meta.query_start_loc_np
        query_lens = np.diff(qsl[: meta.num_reqs + 1])
        decode_rows = np.flatnonzero(query_lens == 1)
        if len(decode_rows):
            rows = torch.from_numpy(decode_rows).to(q_nope.device)
            tokens = torch.from_numpy(qsl[decode_rows].astype(np.int64)).to(q_nope.device)
            o = self._decode(q_nope[tokens], q_pe[tokens], w, meta.block_tables[rows], meta.seq_lens[rows])
            out.index_copy_(0, tokens, o)
        if meta.max_query_len > 1:
            self._prefill(q_nope, q_pe, w_kv_b, meta, out)
        return out

    def _decode(
        self,
        q_nope: torch.Tensor,  # [rows, num_heads, nope]: one query token per row
        q_pe: torch.Tensor,  # [rows, num_heads, rope]
        w: torch.Tensor,  # [num_heads, nope + v_head_dim, rank]
        block_tables: torch.Tensor,  # [rows, max_num_blocks_per_req]
        seq_lens: torch.Tensor,  # [rows]
    ) -> torch.Tensor:  # [rows, num_heads, v_head_dim]
        q_lat = torch.einsum("thn,hnc->thc", q_nope, w[:, : self.nope])  # absorbed through W_UK
        o_lat = mla_decode(q_lat, q_pe, self.kv_cache, block_tables, seq_lens, self.scale)  # [rows, heads, rank]
        # Out through W_UV, each head's product written straight into its columns of a [rows,
        # heads, v] tensor (cuBLAS takes the row stride), so o_proj reads it without a copy.
        out = o_lat.new_empty(o_lat.shape[0], self.num_heads, self.v_head_dim)
        torch.bmm(o_lat.transpose(0, 1), w[:, self.nope :].transpose(1, 2), out=out.transpose(0, 1))
        return out

    def _prefill(
        self,
        q_nope: torch.Tensor,  # [num_tokens, num_heads, nope]: every token of the step
        q_pe: torch.Tensor,  # [num_tokens, num_heads, rope]
        w_kv_b: torch.Tensor,  # [num_heads * (nope + v_head_dim), rank]
        meta: AttentionMetadata,
        out: torch.Tensor,  # [num_tokens, num_heads, v_head_dim]: the rows' tokens written
    ) -> None:
        """Every row with several query tokens at once: expanded K/V, causal after its prefix."""
        mla_prefill(q_nope, q_pe, self.kv_cache, w_kv_b, meta, self.scale, out)
