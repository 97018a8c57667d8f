"""DeepSeek-V2/V3 beyond the conformance cases: the latent cache as sized and allocated, MTP
layers loaded when present, unsupported routing refused, and the whole model with the MLA
kernels interpreted equal to transformers.

Guards against: an MLA layer cached as K and V per head (the runner sizing it from anything but
its spec), MTP tensors in a V3 checkpoint failing the load (or silently dropped when present),
a `topk_method` nothing implements routed as greedy, the Triton latent write or absorbed decode
wrong inside a real batch (decode rows beside prefill chunks, rows across blocks).
"""

from __future__ import annotations

import pytest
import torch

from slotrunner import LLM
from slotrunner.conformance import build_case
from slotrunner.registry import tiny_config

V3 = "DeepseekV3ForCausalLM"


def test_cache_holds_one_latent_row_per_token(tmp_path):
    build_case(tiny_config(V3), tmp_path)
    llm = LLM(str(tmp_path), device="cpu", max_model_len=64, max_num_seqs=2, block_size=4)
    runner = llm.engine.runner
    c = tiny_config(V3)
    width = c.kv_lora_rank + c.qk_rope_head_dim  # 40: not 2 * heads * (nope + rope) = 192
    assert [tuple(t.shape) for t in runner.kv_caches] == [(llm.config.num_kv_blocks, 4, width)] * c.num_hidden_layers
    from slotrunner.core_runner.runner.kv_cache import kv_bytes_per_block

    assert kv_bytes_per_block(runner.model, 4, torch.float32) == c.num_hidden_layers * 4 * width * 4


def _add_mtp_tensors(directory, hf_config) -> dict[str, torch.Tensor]:
    """A V3 file with one MTP layer: layer 1's tensors again as layer n, plus its own."""
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    n, h = hf_config.num_hidden_layers, hf_config.hidden_size
    gen = torch.Generator().manual_seed(5)
    mtp = {f"model.layers.{n}.{k[len('model.layers.1.'):]}": v + 0.01 for k, v in tensors.items() if k.startswith("model.layers.1.")}
    mtp[f"model.layers.{n}.enorm.weight"] = torch.rand(h, generator=gen)
    mtp[f"model.layers.{n}.hnorm.weight"] = torch.rand(h, generator=gen)
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.randn(h, 2 * h, generator=gen)
    mtp[f"model.layers.{n}.shared_head.norm.weight"] = torch.rand(h, generator=gen)
    mtp[f"model.layers.{n}.shared_head.head.weight"] = torch.randn(hf_config.vocab_size, h, generator=gen)
    save_file({**tensors, **mtp}, str(path), metadata={"format": "pt"})
    return mtp


def test_mtp_layers_load_when_present_and_change_nothing_else(tmp_path):
    c = tiny_config(V3)
    build_case(c, tmp_path / "plain")
    build_case(c, tmp_path / "mtp")
    mtp = _add_mtp_tensors(tmp_path / "mtp", c)
    prompt = {"prompt_token_ids": [5, 17, 300, 42, 7]}
    from slotrunner.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = LLM(str(tmp_path / "plain"), device="cpu", max_model_len=64, max_num_seqs=2)
    assert plain.engine.runner.model.mtp is None  # num_nextn_predict_layers=1, nothing in the file: skipped
    with_mtp = LLM(str(tmp_path / "mtp"), device="cpu", max_model_len=64, max_num_seqs=2)
    model = with_mtp.engine.runner.model
    assert model.mtp is not None and len(model.mtp) == 1
    n = c.num_hidden_layers
    torch.testing.assert_close(model.mtp[0].eh_proj.weight, mtp[f"model.layers.{n}.eh_proj.weight"])
    torch.testing.assert_close(model.mtp[0].layer.mlp.gate.weight, mtp[f"model.layers.{n}.mlp.gate.weight"])
    assert model.mtp[0].embed_tokens is None and model.mtp[0].shared_head.head is not None
    ids = [o.outputs[0].token_ids for o in (plain.generate([prompt], params)[0], with_mtp.generate([prompt], params)[0])]
    assert ids[0] == ids[1]


def test_unsupported_topk_method_is_refused(tmp_path):
    build_case(tiny_config("DeepseekV2ForCausalLM"), tmp_path)
    with pytest.raises(ValueError, match="topk_method 'noaux_tc' is not supported"):
        LLM(str(tmp_path), device="cpu", max_model_len=64, hf_overrides={"topk_method": "noaux_tc"})


def _check_interpreted_model():
    """Every kernel interpreted (MLA write and decode, MoE, rotary, norms, input preparation)
    against transformers' logits, for two requests batched with chunked prefill: decode rows
    of one request run beside prefill chunks of the other."""
    import tempfile
    from pathlib import Path

    from slotrunner.conformance import compare_logits
    from slotrunner.conformance_recorder import greedy_params, run_batch
    from slotrunner.core_runner.triton_utils import use_triton

    assert use_triton(torch.device("cpu")), "the interpreter switch did not take"
    with tempfile.TemporaryDirectory() as d:
        hf = build_case(tiny_config(V3), Path(d))
        llm = LLM(d, device="cpu", max_model_len=64, max_num_seqs=2, block_size=4, max_num_batched_tokens=6,
                  enable_prefix_caching=False)  # fmt: skip
        prompts = [[5, 17, 300], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]]
        runs = run_batch(llm, [{"prompt_token_ids": p} for p in prompts], [greedy_params(4)] * 2)
        for prompt, run in zip(prompts, runs):
            ids = prompt + run.output_token_ids[:-1]
            with torch.no_grad():
                ref = hf(input_ids=torch.tensor([ids])).logits[0].float()
            result = compare_logits("interpreted", run.logits.float(), ref)
            assert result.passed, result.detail


def test_interpreted_kernels_match_transformers(run_interpreted):
    run_interpreted(_check_interpreted_model)


def test_speculative_decoding_keeps_greedy_tokens(tmp_path):
    """Rows with drafts have several query tokens and take the expanded path, their plain
    decode the absorbed one: accepted drafts must leave every greedy token unchanged."""
    from slotrunner.sampling_params import SamplingParams

    build_case(tiny_config(V3), tmp_path)
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}, {"prompt_token_ids": [40, 41, 40, 41, 40]}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    outs = []
    for extra in ({}, {"speculative_config": spec}):
        llm = LLM(str(tmp_path), device="cpu", max_model_len=64, max_num_seqs=2, block_size=4, **extra)
        outs.append(llm.generate(prompts, params, use_tqdm=False))
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]
    assert sum(o.metrics.num_accepted_tokens for o in outs[1]) > 0, "no draft was accepted: the test tested nothing"


def _check_padded_decode_step():
    """A CUDA-graph decode step as the capture shapes it (rows past the real ones: empty query,
    seq_len 0, slot -1), through the MLA layer with its kernels interpreted: real rows equal
    the torch reference, padding rows are zeros, and the padding slots write nothing."""
    import numpy as np

    import slotrunner.models.layers.mla_decode as kernels
    from slotrunner.core_runner.attention.backend import AttentionMetadata
    from slotrunner.core_runner.attention.forward_context import ForwardContext, forward_context
    from slotrunner.core_runner.attention.torch_ref import TorchRefBackend
    from slotrunner.models.layers.mla_attention import MLAAttention

    assert kernels.use_triton(torch.device("cpu")), "the interpreter switch did not take"
    heads, nope, rope, v, rank, block = 3, 8, 8, 6, 24, 4
    gen = torch.Generator().manual_seed(0)
    layer = MLAAttention(heads, nope, rope, v, rank, 0.3, 0)
    cache = torch.randn(8, block, rank + rope, generator=gen)
    seq_lens = [5, 9, 0, 0]
    meta = AttentionMetadata(
        num_reqs=4, num_tokens=4, query_start_loc=torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32),
        query_start_loc_np=np.arange(5), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_np=np.full(4, 64), max_query_len=1, max_seq_len=64,
        block_tables=torch.tensor([[3, 1, 0], [6, 2, 7], [0, 0, 0], [0, 0, 0]], dtype=torch.int32),
        slot_mapping=torch.tensor([1 * block + 0, 7 * block + 0, -1, -1]),
    )  # fmt: skip
    args = (torch.randn(4, heads, nope, generator=gen), torch.randn(4, heads, rope, generator=gen),
            torch.randn(4, rank, generator=gen), torch.randn(4, rope, generator=gen),
            torch.randn(heads * (nope + v), rank, generator=gen))  # fmt: skip
    outs, caches = [], []
    for triton_on in (True, False):
        layer.kv_cache = cache.clone()
        kernels.use_triton = (lambda device: True) if triton_on else (lambda device: False)
        with forward_context(ForwardContext(TorchRefBackend(), meta)):
            outs.append(layer(*args))
        caches.append(layer.kv_cache)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[0], caches[1])
    assert outs[0][2:].abs().max() == 0, "padding rows must be zeros"
    changed = (caches[0] != cache).any(-1).flatten().nonzero().flatten().tolist()
    assert changed == [1 * block, 7 * block], "only the real tokens' slots are written"


def test_padded_decode_step_interpreted(run_interpreted):
    run_interpreted(_check_padded_decode_step)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_equal_eager(tmp_path):
    """Decode steps replayed from graphs (the absorbed MLA decode over captured buffers, padding
    rows included) give the eager tokens."""
    from slotrunner.sampling_params import SamplingParams

    build_case(tiny_config(V3), tmp_path)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 200, (n,), generator=gen).tolist()} for n in (3, 17, 40, 5, 33, 9)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 12, 25, 7, 30, 18)]
    runs = []
    for eager in (False, True):
        llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", enforce_eager=eager, max_model_len=128, max_num_seqs=8)
        assert (llm.engine.runner.cuda_graphs is None) == eager
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]
