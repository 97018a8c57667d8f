"""Gated delta-net (Qwen3-Next, Qwen3.5 linear attention): the layer and its kernels -- the
chunked delta rule for prefill rows, the single-step recurrence for decode rows. The short conv
before them is the Mamba2 causal conv1d (`models/layers/mamba/causal_conv1d.py`). Under tensor
parallelism its heads split by rank (`parallel.py`)."""
