"""Mamba2 (SSD) layers: the mixer shared by Mamba2 and the Mamba hybrids, its per-step metadata,
and its kernels (causal conv1d, chunked scan for prefill, single-step recurrence for decode)."""
