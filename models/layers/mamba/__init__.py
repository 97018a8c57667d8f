"""Mamba2 (SSD) layers: the mixer shared by Mamba2 and the Mamba hybrids, and its kernels
(causal conv1d -- also the gated delta-net's short conv --, chunked scan for prefill,
single-step recurrence for decode)."""
