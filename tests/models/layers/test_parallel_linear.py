"""Sharded layers load exactly their rank's part of a safetensors checkpoint.

Each rank's model is built here in one process, for any rank, without a process group (loading
runs no collective): the parameters must equal the matching slices of the checkpoint tensors.

Guards against: q/k/v (or gate/up) split as one matrix instead of per part (rank 1 would get
k/v rows in place of its q rows), KV heads split when there are fewer than ranks (a rank would
get half a head), the o/down projections split by rows instead of input columns, a vocabulary
that does not divide (the last rank reading past it, or padding rows left uninitialised), a
tied head that misses the sharded embedding, an attention spec (and KV cache) sized for all
heads on every rank, and tensor_parallel_size 1 building anything but the plain layers.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from slotrunner.conformance import build_case
from slotrunner.core_runner.distributed.parallel_state import TensorParallelGroup, tensor_parallel_scope
from slotrunner.core_runner.loader.checkpoint import iter_safetensors, load_hf_config, safetensors_files
from slotrunner.core_runner.loader.model_loader import load_model
from slotrunner.models.layers.linear import Linear, MergedLinear, VocabEmbedding
from slotrunner.models.layers.parallel_linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from slotrunner.models.llama import LlamaForCausalLM
from slotrunner.registry import tiny_config

HEAD_DIM = 16  # tiny configs: hidden 64 over 4 heads

CASES = {
    "gqa": {},  # 4 query heads, 2 KV heads: one KV head per rank
    "kv-replicated": {"num_key_value_heads": 1},  # one KV head, kept whole by both ranks
    "odd-vocab-tied": {"vocab_size": 1001, "tie_word_embeddings": True},  # last rank padded; head = embedding
}


def _rank_model(directory, rank: int, world: int) -> torch.nn.Module:
    hf_config = load_hf_config(directory)
    weights = lambda: iter_safetensors(safetensors_files(directory), torch.float32)  # noqa: E731
    with tensor_parallel_scope(TensorParallelGroup(rank, world)):
        return load_model(LlamaForCausalLM, hf_config, weights, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_rank_holds_its_slices_of_the_checkpoint(case, rank, tmp_path):
    cfg = tiny_config("LlamaForCausalLM", **CASES[case])
    build_case(cfg, tmp_path)
    full = load_file(str(tmp_path / "model.safetensors"))
    model = _rank_model(tmp_path, rank, 2)
    kv_heads = cfg.num_key_value_heads
    kv_rank = rank if kv_heads >= 2 else 0  # the KV head this rank's query heads read
    q_rows = slice(rank * 2 * HEAD_DIM, (rank + 1) * 2 * HEAD_DIM)
    kv_rows = slice(kv_rank * HEAD_DIM, (kv_rank + 1) * HEAD_DIM)
    inter = cfg.intermediate_size // 2
    mlp_rows = slice(rank * inter, (rank + 1) * inter)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        attn, mlp = model.model.layers[i].self_attn, model.model.layers[i].mlp
        assert isinstance(attn.qkv_proj, MergedColumnParallelLinear) and isinstance(attn.o_proj, RowParallelLinear)
        expected_qkv = torch.cat([full[f"{p}.self_attn.q_proj.weight"][q_rows], full[f"{p}.self_attn.k_proj.weight"][kv_rows],
                                  full[f"{p}.self_attn.v_proj.weight"][kv_rows]])  # fmt: skip
        assert torch.equal(attn.qkv_proj.weight, expected_qkv)
        assert torch.equal(attn.o_proj.weight, full[f"{p}.self_attn.o_proj.weight"][:, q_rows])
        expected_gate_up = torch.cat([full[f"{p}.mlp.gate_proj.weight"][mlp_rows], full[f"{p}.mlp.up_proj.weight"][mlp_rows]])
        assert torch.equal(mlp.gate_up_proj.weight, expected_gate_up)
        assert torch.equal(mlp.down_proj.weight, full[f"{p}.mlp.down_proj.weight"][:, mlp_rows])
        assert torch.equal(model.model.layers[i].input_layernorm.weight, full[f"{p}.input_layernorm.weight"])
        spec = attn.attn.spec  # what the KV cache is sized from
        assert (spec.num_heads, spec.num_kv_heads) == (2, 1)
    vocab = cfg.vocab_size
    per_rank = -(-vocab // 2)
    ids = slice(rank * per_rank, min((rank + 1) * per_rank, vocab))
    emb = model.model.embed_tokens
    assert isinstance(emb, VocabParallelEmbedding) and emb.weight.shape == (per_rank, cfg.hidden_size)
    owned = full["model.embed_tokens.weight"][ids]
    assert torch.equal(emb.weight[: owned.shape[0]], owned)
    assert not emb.weight[owned.shape[0] :].any()  # the last rank's padding rows are zero
    if cfg.tie_word_embeddings:
        assert model.lm_head is None
    else:
        assert isinstance(model.lm_head, ParallelLMHead)
        assert torch.equal(model.lm_head.weight, full["lm_head.weight"][ids])


def test_one_rank_builds_the_plain_layers(tiny_llama_dir):
    """tensor_parallel_size 1 (no scope): the model is exactly the single-device one."""
    model = load_model(LlamaForCausalLM, load_hf_config(tiny_llama_dir),
                       lambda: iter_safetensors(safetensors_files(tiny_llama_dir), torch.float32), torch.float32,
                       torch.device("cpu"))  # fmt: skip
    layer = model.model.layers[0]
    assert type(layer.self_attn.qkv_proj) is MergedLinear and type(layer.self_attn.o_proj) is Linear
    assert type(layer.mlp.gate_up_proj) is MergedLinear and type(layer.mlp.down_proj) is Linear
    assert type(model.model.embed_tokens) is VocabEmbedding and type(model.lm_head) is Linear
    assert layer.self_attn.attn.spec.num_heads == 4


def test_a_head_count_that_does_not_divide_is_refused_before_any_rank_starts(tmp_path):
    cfg = tiny_config("LlamaForCausalLM")
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        LlamaForCausalLM.check_tensor_parallel(cfg, 3)
    LlamaForCausalLM.check_tensor_parallel(cfg, 4)  # 4 query heads, 2 KV heads each on 2 ranks


def test_fused_checkpoint_tensors_are_split_per_part(tmp_path):
    """Phi-3 stores q/k/v as one qkv_proj and gate/up as one gate_up_proj: each rank takes its
    rows of every part of the fused tensor, not a contiguous block of it."""
    from slotrunner.models.phi3 import Phi3ForCausalLM

    cfg = tiny_config("Phi3ForCausalLM", tie_word_embeddings=False)
    build_case(cfg, tmp_path)
    full = load_file(str(tmp_path / "model.safetensors"))
    hf_config = load_hf_config(tmp_path)
    weights = lambda: iter_safetensors(safetensors_files(tmp_path), torch.float32)  # noqa: E731
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    inter = cfg.intermediate_size
    for rank in range(2):
        with tensor_parallel_scope(TensorParallelGroup(rank, 2)):
            model = load_model(Phi3ForCausalLM, hf_config, weights, torch.float32, torch.device("cpu"))
        qkv = full["model.layers.0.self_attn.qkv_proj.weight"]
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d])
        half_q, half_kv = heads * d // 2, kv_heads * d // 2
        expected = torch.cat([q[rank * half_q : (rank + 1) * half_q], k[rank * half_kv : (rank + 1) * half_kv],
                              v[rank * half_kv : (rank + 1) * half_kv]])  # fmt: skip
        assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight, expected)
        gate, up = full["model.layers.0.mlp.gate_up_proj.weight"].split([inter, inter])
        rows = slice(rank * inter // 2, (rank + 1) * inter // 2)
        assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight, torch.cat([gate[rows], up[rows]]))


def test_per_head_sinks_follow_the_rank_query_heads(tmp_path):
    """GPT-OSS's attention sinks: one logit per query head, so a rank keeps its heads' sinks."""
    from slotrunner.models.gpt_oss import GptOssForCausalLM

    build_case(tiny_config("GptOssForCausalLM", tie_word_embeddings=False), tmp_path)
    sinks = load_file(str(tmp_path / "model.safetensors"))["model.layers.0.self_attn.sinks"]
    weights = lambda: iter_safetensors(safetensors_files(tmp_path), torch.float32)  # noqa: E731
    for rank in range(2):
        with tensor_parallel_scope(TensorParallelGroup(rank, 2)):
            model = load_model(GptOssForCausalLM, load_hf_config(tmp_path), weights, torch.float32, torch.device("cpu"))
        half = sinks.shape[0] // 2
        assert torch.equal(model.model.layers[0].self_attn.sinks, sinks[rank * half : (rank + 1) * half])
        assert model.model.layers[0].mlp.experts.w_in.shape[0] == model.num_experts // 2


def test_an_encoder_decoder_splits_its_decoder_and_replicates_its_encoder(tmp_path):
    """BART: the decoder's self- and cross-attention split by head (their caches sized for the
    rank's heads), its feed-forward column/row-parallel; the encoder, the embeddings and the
    head whole on every rank."""
    from slotrunner.models.bart import BartForConditionalGeneration

    cfg = tiny_config("BartForConditionalGeneration", tie_word_embeddings=False)
    build_case(cfg, tmp_path)
    full = load_file(str(tmp_path / "model.safetensors"))
    weights = lambda: iter_safetensors(safetensors_files(tmp_path), torch.float32)  # noqa: E731
    d, half = cfg.d_model, cfg.d_model // 2
    for rank in range(2):
        with tensor_parallel_scope(TensorParallelGroup(rank, 2)):
            model = load_model(BartForConditionalGeneration, load_hf_config(tmp_path), weights, torch.float32,
                               torch.device("cpu"))  # fmt: skip
        rows = slice(rank * half, (rank + 1) * half)
        dec = model.model.decoder.layers[0]
        for name in ("self_attn", "encoder_attn"):
            for proj in ("q_proj", "k_proj", "v_proj"):
                p = f"model.decoder.layers.0.{name}.{proj}"
                assert torch.equal(getattr(getattr(dec, name), proj).weight, full[f"{p}.weight"][rows])
                assert torch.equal(getattr(getattr(dec, name), proj).bias, full[f"{p}.bias"][rows])
            out = f"model.decoder.layers.0.{name}.out_proj.weight"
            assert torch.equal(getattr(dec, name).out_proj.weight, full[out][:, rows])
        assert (dec.self_attn.attn.spec.num_heads, dec.encoder_attn.attn.num_kv_heads) == (2, 2)
        ffn = cfg.decoder_ffn_dim // 2
        assert torch.equal(dec.fc1.weight, full["model.decoder.layers.0.fc1.weight"][rank * ffn : (rank + 1) * ffn])
        enc = model.model.encoder.layers[0].self_attn.q_proj.weight
        assert torch.equal(enc, full["model.encoder.layers.0.self_attn.q_proj.weight"]) and enc.shape == (d, d)
        assert model.lm_head.weight.shape == (cfg.vocab_size, d)
