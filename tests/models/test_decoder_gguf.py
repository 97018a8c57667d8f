"""GGUF files of every Llama-style decoder against transformers' GGUF loader as the oracle.

Each case is a tiny random model written as llama.cpp's converter writes it
(`slotrunner.conformance_gguf.write_gguf`, checked here against the model it came from through
transformers' own reader); then slotrunner's reader must give transformers' tensors bit for
bit and its config, and slotrunner running the file must give transformers' logits at every
position and its greedy tokens.

Guards against: a GGUF tensor name or norm offset (Gemma's 1 + w) read wrong, Q/K rows
un-interleaved where the converter never interleaved them (everything but `llama`), metadata
keys read from the wrong place, a tokenizer kind or pre-tokenizer a family's files use refused.

transformers' GGUF loader fills what its mapping does not read with its config defaults
(Qwen3's head_dim 128, Gemma's query_pre_attn_scalar 256 and soft caps 50 / 30, full rotary for
Phi-3), so the tiny configs take those values: then both readers must agree.

GPT-OSS files are the exception: transformers' GGUF loader cannot read them (see the tests at
the end), so their oracle is the Hugging Face model the file was written from, with its
experts rounded to MXFP4 as the file stores them.
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from slotrunner import LLM  # noqa: E402
from slotrunner.conformance import build_case, check_case, single_thread  # noqa: E402
from slotrunner.conformance_gguf import load_gguf_oracle, write_gguf  # noqa: E402
from slotrunner.conformance_oracle import ConformanceError  # noqa: E402
from slotrunner.registry import read_gguf, tiny_config  # noqa: E402

_GEMMA_ROPE = {"sliding_attention": dict(rope_type="default", rope_theta=10_000.0),
               "full_attention": dict(rope_type="default", rope_theta=1_000_000.0)}  # fmt: skip
CASES = {
    "LlamaForCausalLM": {},
    "Qwen2ForCausalLM": {},
    "Qwen3ForCausalLM": dict(head_dim=128),
    "Gemma2ForCausalLM": dict(head_dim=256, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0, tie_word_embeddings=True),
    "Gemma3ForCausalLM": dict(num_hidden_layers=6, sliding_window_pattern=6, head_dim=256, query_pre_attn_scalar=256,
                              final_logit_softcapping=None, rope_parameters=_GEMMA_ROPE),
    "Phi3ForCausalLM": dict(rope_parameters=dict(rope_type="default", rope_theta=10_000.0)),
    # every layer sparse, as llama.cpp runs them; transformers' default expert width (768)
    "Qwen3MoeForCausalLM": dict(mlp_only_layers=[], head_dim=128, moe_intermediate_size=768, num_experts=4,
                                num_experts_per_tok=2),
}  # fmt: skip


def per_expert(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors ([experts, 2 x ff, hidden] gate|up, [experts, hidden,
    ff] down) under the per-expert names its checkpoints store (and slotrunner's reader yields)."""
    out = {}
    for name, tensor in state_dict.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            for e, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1))):
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate
                out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            out.update((f"{name[:-len('down_proj')]}{e}.down_proj.weight", t) for e, t in enumerate(tensor))
        else:
            out[name] = tensor
    return out
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [900, 3]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


@pytest.mark.parametrize("architecture", CASES)
def test_file_reads_and_runs_like_transformers(architecture, tmp_path):
    config = tiny_config(architecture, **CASES[architecture])
    config.architectures = [architecture]
    original = build_case(config, tmp_path / "hf")
    path = write_gguf(original, tmp_path / "tiny.gguf")
    oracle = load_gguf_oracle(path, architecture)
    # The writer is llama.cpp's layout: transformers reads the original weights back (Gemma's
    # norms to within the rounding of (w + 1) - 1).
    for name, tensor in original.state_dict().items():
        torch.testing.assert_close(oracle.state_dict()[name], tensor, rtol=0, atol=1e-7, msg=name)

    checkpoint = read_gguf(path, torch.float32)
    assert checkpoint.config.architectures == [architecture]
    weights = dict(checkpoint.weights())
    reference = per_expert(oracle.state_dict())
    expected = set(reference) - ({"lm_head.weight"} if checkpoint.config.tie_word_embeddings else set())
    assert set(weights) == expected
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name
    tokenizer = checkpoint.tokenizer  # byte-level BPE with the family's pre-tokenizer
    assert tokenizer.decode(tokenizer("It's 2024 ok").input_ids) == "It's 2024 ok"

    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, block_size=4, enable_prefix_caching=False,
              quantized_weights="dequantized")  # fmt: skip
    report = check_case(llm, oracle, PROMPTS, max_tokens=4)
    assert report.passed, report.table()


@pytest.mark.parametrize("architecture", ["Gemma2ForCausalLM", "Phi3ForCausalLM"])
def test_sentencepiece_files_tokenize_like_transformers(architecture, tmp_path):
    """Gemma and Phi-3 files carry SentencePiece vocabularies (`tokenizer.ggml.model = llama`),
    which transformers converts per architecture (Phi-3's prefix space differs): slotrunner's
    tokenizer for the file must be transformers' one."""
    from transformers import AutoTokenizer

    config = tiny_config(architecture, **CASES[architecture])
    config.architectures = [architecture]
    path = write_gguf(build_case(config, tmp_path / "hf"), tmp_path / "spm.gguf", tokenizer="llama")
    ours = read_gguf(path, torch.float32).tokenizer
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ["ab ba", "  hello world", "zz q"]:
        assert ours(text).input_ids == ref(text).input_ids, text
    assert ours("a").input_ids[0] == 1  # <s>, as the file's bos_token_id


def test_qwen2_pre_tokenizer_splits_like_qwen(tmp_path):
    """`tokenizer.ggml.pre = qwen2`: one digit per token, contractions case-insensitive, as
    Qwen's own tokenizer.json splits (and llama.cpp)."""
    from slotrunner.core_runner.loader.gguf_tokenizer import PRE_TOKENIZER_SPLITS
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS["qwen2"][0]), behavior="isolated")
    pieces = [p for p, _ in split.pre_tokenize_str("It'S 2024 ok!!\n\n  x")]
    assert pieces == ["It", "'S", " ", "2", "0", "2", "4", " ok", "!!\n\n", " ", " x"]


def test_falcon_h1_pre_tokenizer_is_llama3s():
    """`tokenizer.ggml.pre = falcon-h1`: llama.cpp maps it to its LLAMA3 pre-type (llama-vocab.cpp),
    Llama 3's rules: digits three at a time."""
    from slotrunner.core_runner.loader.gguf_tokenizer import PRE_TOKENIZER_SPLITS
    from tokenizers import Regex, pre_tokenizers

    assert PRE_TOKENIZER_SPLITS["falcon-h1"] == PRE_TOKENIZER_SPLITS["llama-bpe"]
    split = pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS["falcon-h1"][0]), behavior="isolated")
    assert [p for p, _ in split.pre_tokenize_str("It's 12345")] == ["It", "'s", " ", "123", "45"]


def test_tekken_dbrx_and_pixtral_pre_tokenizers():
    """`tekken` (Mistral Nemo's vocabulary): case-split words, one digit a token; `dbrx` (Granite
    4.0's files) and `pixtral` (Nemotron-H's): llama.cpp runs them with Llama 3's rules
    (llama-vocab.cpp)."""
    from slotrunner.core_runner.loader.gguf_tokenizer import PRE_TOKENIZER_SPLITS
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS["tekken"][0]), behavior="isolated")
    assert [p for p, _ in split.pre_tokenize_str("HelloWorld 42 a/b\n")] == ["Hello", "World", " ", "4", "2", " a", "/b", "\n"]
    assert PRE_TOKENIZER_SPLITS["dbrx"] == PRE_TOKENIZER_SPLITS["llama-bpe"]
    assert PRE_TOKENIZER_SPLITS["pixtral"] == PRE_TOKENIZER_SPLITS["llama-bpe"]


def test_gpt4o_pre_tokenizer_splits_like_o200k():
    """`tokenizer.ggml.pre = gpt-4o` (GPT-OSS files; llama.cpp's GPT4O pre-type): o200k's rules --
    a word splits before an inner capital and keeps its contraction (any case), digits go three
    at a time, "/" and newlines stay with the punctuation before them. Qwen2's rules would
    split digits one by one and contractions off."""
    from slotrunner.core_runner.loader.gguf_tokenizer import PRE_TOKENIZER_SPLITS
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS["gpt-4o"][0]), behavior="isolated")
    pieces = [p for p, _ in split.pre_tokenize_str("It'S 2024 HelloWorld!!\n\n  a//\nb")]
    assert pieces == ["It'S", " ", "202", "4", " Hello", "World", "!!\n\n", " ", " a", "//\n", "b"]


def copy_gguf(path, out, add, arch="llama", drop=()) -> object:
    """A copy of the `arch` file at `path` without the metadata keys `drop` and with what
    `add(writer)` adds (metadata or tensors); quantized tensors are copied as their blocks."""
    writer = gguf.GGUFWriter(str(out), arch)
    reader = gguf.GGUFReader(str(path))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in drop:
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    add(writer)
    for tensor in reader.tensors:
        if tensor.tensor_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, tensor.data.reshape([int(d) for d in reversed(tensor.shape)]))
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_mixtral_file_runs_like_the_model_it_came_from(tmp_path):
    """A Mixtral written as llama.cpp writes it (the `llama` architecture, Q/K rows interleaved,
    `llama.expert_count`, the router and the experts as [experts, ...] stacks) read back: a
    MixtralConfig with the model's expert counts, every tensor equal under Mixtral's per-expert
    checkpoint names, logits and greedy tokens equal. transformers' GGUF loader reads `llama`
    files without their experts, so the oracle is the HF model the file was written from."""
    config = tiny_config("MixtralForCausalLM", sliding_window=None)  # llama.cpp's files carry none
    config.architectures = ["MixtralForCausalLM"]
    original = build_case(config, tmp_path / "hf")
    path = write_gguf(original, tmp_path / "mixtral.gguf")
    renamed = {".mlp.gate.": ".block_sparse_moe.gate.", ".mlp.experts.": ".block_sparse_moe.experts.",
               ".gate_proj.": ".w1.", ".up_proj.": ".w3.", ".down_proj.": ".w2."}  # fmt: skip
    reference = {}
    for name, tensor in per_expert(original.state_dict()).items():
        if ".experts." in name or ".mlp.gate." in name:
            for old, new in renamed.items():
                name = name.replace(old, new)
        reference[name] = tensor
    fields = ("num_local_experts", "num_experts_per_tok", "intermediate_size", "num_key_value_heads", "sliding_window")
    check_file_against_its_model(path, original, fields, reference, "no oracle for Mixtral files")


def check_file_against_its_model(path, original, fields, reference, oracle_refusal, rtol=0.0) -> None:
    """A file transformers' GGUF loader cannot check, read back: the model's architecture and
    config `fields`, every tensor equal to `reference` (within `rtol`; 0: bit for bit),
    transformers refused as its oracle for the reason `oracle_refusal` matches, and the logits
    at every position and greedy tokens of `original`, the model the file was written from."""
    checkpoint = read_gguf(path, torch.float32)
    assert checkpoint.config.architectures == original.config.architectures
    for field in fields:
        assert getattr(checkpoint.config, field) == getattr(original.config, field), field
    weights = dict(checkpoint.weights())
    assert set(weights) == set(reference)
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, reference[name], rtol=rtol, atol=0, msg=name)
    with pytest.raises(ConformanceError, match=oracle_refusal):
        load_gguf_oracle(path, original.config.architectures[0])
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, block_size=4, enable_prefix_caching=False)
    report = check_case(llm, original, PROMPTS, max_tokens=4)
    assert report.passed, report.table()


def test_expert_count_without_expert_tensors_is_refused(tmp_path):
    config = tiny_config("LlamaForCausalLM")
    config.architectures = ["LlamaForCausalLM"]
    path = write_gguf(build_case(config, tmp_path / "hf"), tmp_path / "llama.gguf")
    moe = copy_gguf(path, tmp_path / "moe.gguf", lambda writer: writer.add_expert_count(8))
    with pytest.raises(ValueError, match="llama.expert_count is 8 but the file has no expert tensors"):
        read_gguf(moe, torch.float32)


def test_unsupported_architecture_lists_the_supported(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "jamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    supported = (
        "deepseek2, falcon-h1, gemma2, gemma3, gpt-oss, granitehybrid, llama, mamba2, nemotron_h, nemotron_h_moe, phi3, "
        "qwen2, qwen3, qwen35, qwen35moe, qwen3moe, qwen3next"
    )
    with pytest.raises(ValueError, match=f"'jamba' is not supported; supported: {supported}") as e:
        read_gguf(tmp_path / "x.gguf", torch.float32)
    assert "transformers' GGUF loader does not read it either" in str(e.value)


@pytest.mark.parametrize("architecture", [*CASES, "GptOssForCausalLM"])
def test_quantized_file_runs_packed_like_dequantized(architecture, tmp_path):
    """A Q8_0 file (how users' files come) keeps its matrices packed on CPU -- fused QKV and
    gate/up (Phi-3), sandwich norms (Gemma), experts (Qwen3-MoE), biased attention and router
    beside MXFP4 experts (GPT-OSS) included -- and gives the tokens and logprobs of the same file
    dequantized."""
    config = tiny_config(architecture, **CASES.get(architecture, {}))
    config.architectures = [architecture]
    check_packed_like_dequantized(write_gguf(build_case(config, tmp_path / "hf"), tmp_path / "q8.gguf", matrix_type="Q8_0"))


def check_packed_like_dequantized(path) -> None:
    """The quantized file at `path` runs with packed matrices on CPU and gives the greedy tokens
    and top logprobs of the same file dequantized."""
    from slotrunner import SamplingParams
    from slotrunner.core_runner.cpu.native import native_unavailable_reason

    if native_unavailable_reason() is not None:
        pytest.skip(str(native_unavailable_reason()))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    runs = {}
    for mode in ("packed", "dequantized"):
        llm = LLM(str(path), device="cpu", dtype="float32", quantized_weights=mode, max_model_len=64)
        packed = sum(getattr(m, "packed", None) is not None for m in llm.engine.runner.model.modules())
        runs[mode] = packed, llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)[0].outputs[0]
    assert runs["packed"][0] > 0 and runs["dequantized"][0] == 0
    ours, ref = runs["packed"][1], runs["dequantized"][1]
    assert ours.token_ids == ref.token_ids
    for a, b in zip(ours.logprobs, ref.logprobs):
        assert a.keys() == b.keys()
        for token in a:
            assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)


def test_llama31_rope_freqs_file_runs_like_the_checkpoint_it_came_from(tmp_path):
    """Llama 3.1/3.2 files carry their RoPE scaling as a `rope_freqs` tensor (one divisor per
    frequency) and no metadata. transformers' GGUF loader drops that tensor, so the oracle is
    the Hugging Face model the file was written from. Head dim 16 and an original context of
    512 give divisors of 1, of `factor` and in between, so a reader that ignored any kind would
    move the logits."""
    rope = dict(rope_type="llama3", rope_theta=10_000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=512)  # fmt: skip
    config = tiny_config("LlamaForCausalLM", head_dim=16, rope_parameters=rope, max_position_embeddings=4096)
    config.architectures = ["LlamaForCausalLM"]
    original = build_case(config, tmp_path / "hf")
    path = write_gguf(original, tmp_path / "llama31.gguf")

    divisors = read_gguf(path, torch.float32).config.rope_parameters["short_factor"]
    assert divisors[0] == 1.0 and divisors[-1] == 8.0 and any(1.0 < d < 8.0 for d in divisors), divisors
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, block_size=4, enable_prefix_caching=False,
              quantized_weights="dequantized")  # fmt: skip
    report = check_case(llm, original, PROMPTS, max_tokens=4)
    assert report.passed, report.table()


def test_rope_freqs_of_the_wrong_length_is_refused(tmp_path):
    config = tiny_config("LlamaForCausalLM", head_dim=16)
    config.architectures = ["LlamaForCausalLM"]
    path = write_gguf(build_case(config, tmp_path / "hf"), tmp_path / "plain.gguf")
    bad = copy_gguf(path, tmp_path / "bad.gguf", lambda writer: writer.add_tensor("rope_freqs.weight", torch.ones(5).numpy()))
    with pytest.raises(ValueError, match="rope_freqs.weight has 5 values, expected head_dim / 2 = 8"):
        read_gguf(bad, torch.float32)


def test_conformance_refuses_transformers_as_the_oracle_of_a_rope_freqs_file(tmp_path):
    rope = dict(rope_type="llama3", rope_theta=10_000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=512)  # fmt: skip
    config = tiny_config("LlamaForCausalLM", head_dim=16, rope_parameters=rope, max_position_embeddings=4096)
    config.architectures = ["LlamaForCausalLM"]
    path = write_gguf(build_case(config, tmp_path / "hf"), tmp_path / "llama31.gguf")
    with pytest.raises(ConformanceError, match="RoPE with rope_freqs.weight"):
        load_gguf_oracle(path, "LlamaForCausalLM")


def test_phi3_longrope_file_runs_like_the_checkpoint_it_came_from(tmp_path):
    """Phi-3 128k files carry LongRoPE as `rope_factors_long` / `rope_factors_short` tensors plus
    the original context and attention factor in metadata; transformers' GGUF loader reads
    neither, so the oracle is the Hugging Face model the file came from, on a prompt past the
    original context (where transformers uses the long factors, as slotrunner does for a model
    that can outgrow it: tests/models/test_phi3.py)."""
    config = tiny_config("Phi3ForCausalLM")  # LongRoPE: original context 4, max_position_embeddings 256
    config.architectures = ["Phi3ForCausalLM"]
    original = build_case(config, tmp_path / "hf")
    path = write_gguf(original, tmp_path / "phi3-128k.gguf")
    rope = read_gguf(path, torch.float32).config.rope_parameters
    expected = original.config.rope_parameters
    assert rope["rope_type"] == "longrope" and rope["long_factor"] == pytest.approx(expected["long_factor"])
    assert rope["short_factor"] == pytest.approx(expected["short_factor"]) and rope["long_factor"] != rope["short_factor"]
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, block_size=4, enable_prefix_caching=False,
              quantized_weights="dequantized")  # fmt: skip
    report = check_case(llm, original, PROMPTS[:1], max_tokens=4)
    assert report.passed, report.table()


# -- GPT-OSS: transformers' GGUF loader cannot read its files, so the oracle is the HF model ---


def gpt_oss_file(tmp_path):
    """A tiny GPT-OSS (sliding window 6 on layer 0, full attention on layer 1, YaRN) written as
    llama.cpp's converter writes it, experts in MXFP4; and the model it came from."""
    config = tiny_config("GptOssForCausalLM")
    config.architectures = ["GptOssForCausalLM"]
    original = build_case(config, tmp_path / "hf")
    return original, write_gguf(original, tmp_path / "gpt-oss.gguf")


def gpt_oss_held(original, path):
    """`original` with the experts the file holds: its MXFP4 blocks dequantized by gguf-py (not
    by slotrunner's reader) and put back in HF's layout ([experts, in, out], gate and up
    interleaved). Every other tensor is stored as float32, so it is the original's."""
    import copy

    held = copy.deepcopy(original)
    stored = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        stored[t.name] = torch.from_numpy(values.copy())
    with torch.no_grad():
        for i, layer in enumerate(held.model.layers):
            gate, up = stored[f"blk.{i}.ffn_gate_exps.weight"], stored[f"blk.{i}.ffn_up_exps.weight"]  # [E, ff, hidden]
            layer.mlp.experts.gate_up_proj.copy_(torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2))
            layer.mlp.experts.down_proj.copy_(stored[f"blk.{i}.ffn_down_exps.weight"].transpose(1, 2))
    return held


def gpt_oss_per_expert(state_dict):
    """A GPT-OSS state dict under the per-expert names slotrunner's GGUF reader yields."""
    out = {}
    for name, tensor in state_dict.items():
        head, _, leaf = name.rpartition(".experts.")
        if leaf in ("gate_up_proj", "gate_up_proj_bias"):  # [E, hidden, 2 x ff] / [E, 2 x ff], interleaved
            both, kind = (tensor.transpose(1, 2), "weight") if leaf == "gate_up_proj" else (tensor, "bias")
            for e in range(both.shape[0]):
                out[f"{head}.experts.{e}.gate_proj.{kind}"] = both[e, 0::2]
                out[f"{head}.experts.{e}.up_proj.{kind}"] = both[e, 1::2]
        elif leaf == "down_proj":  # [E, ff, hidden]
            out.update((f"{head}.experts.{e}.down_proj.weight", t.T) for e, t in enumerate(tensor))
        elif leaf == "down_proj_bias":
            out.update((f"{head}.experts.{e}.down_proj.bias", t) for e, t in enumerate(tensor))
        else:
            out[name] = tensor
    return out


def test_gpt_oss_file_runs_like_the_model_it_holds(tmp_path):
    """A GPT-OSS file read back: every tensor equal to the model the file holds (sinks, biased
    router and experts, gate/up de-interleaved the converter's way, MXFP4 experts dequantized
    exactly), the config the HF model had (YaRN from the rope.scaling keys, the sliding window
    and llama.cpp's alternating layer pattern), and its logits at every position and greedy
    tokens. transformers' GGUF loader cannot read these files, so the oracle is the HF model the
    file was written from, with its experts rounded to MXFP4 as the file stores them."""
    original, path = gpt_oss_file(tmp_path)
    held = gpt_oss_held(original, path)
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(held.state_dict()[gate_up], original.state_dict()[gate_up])  # MXFP4 did round
    torch.testing.assert_close(held.state_dict()[gate_up], original.state_dict()[gate_up], atol=0.02, rtol=0.3)

    checkpoint = read_gguf(path, torch.float32)
    config, expected = checkpoint.config, original.config
    assert config.architectures == ["GptOssForCausalLM"]
    for field in ("layer_types", "sliding_window", "rope_parameters", "num_local_experts", "num_experts_per_tok",
                  "intermediate_size", "head_dim", "num_key_value_heads", "swiglu_limit", "tie_word_embeddings"):  # fmt: skip
        assert getattr(config, field) == getattr(expected, field), field
    weights = dict(checkpoint.weights())
    reference = gpt_oss_per_expert(held.state_dict())
    assert set(weights) == set(reference)
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name
    tokenizer = checkpoint.tokenizer  # byte-level BPE, pre gpt-4o
    assert tokenizer.decode(tokenizer("It's 2024 ok").input_ids) == "It's 2024 ok"

    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, block_size=4, enable_prefix_caching=False,
              quantized_weights="dequantized")  # fmt: skip
    report = check_case(llm, held, PROMPTS, max_tokens=4)
    assert report.passed, report.table()


def test_transformers_is_no_oracle_for_gpt_oss_files(tmp_path):
    """transformers' GGUF loader fails on llama.cpp's gpt-oss files (it reads their
    rope.scaling.* values from the wrong field part), so `conformance --model x.gguf` must say so
    rather than crash or compare against it. Should a transformers release read them, the
    first check fails: then make it the oracle of these files."""
    import transformers

    _, path = gpt_oss_file(tmp_path)
    with pytest.raises(Exception):
        transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    with pytest.raises(ConformanceError, match="no oracle for llama.cpp's gpt-oss files"):
        load_gguf_oracle(path, "GptOssForCausalLM")


_GPT_OSS_MALFORMED = {
    "linear RoPE scaling": (("gpt-oss.rope.scaling.type",), lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
                            "gpt-oss files scale RoPE with YaRN; this one has rope.scaling.type='linear'"),
    "no sliding window": (("gpt-oss.attention.sliding_window",), lambda w: None,
                          "required metadata gpt-oss.attention.sliding_window is missing"),
    "fewer experts than stored": (("gpt-oss.expert_count",), lambda w: w.add_expert_count(4),
                                  r"experts\.\*\.gate_proj\.weight has shape \(8, 32, 64\), expected \(4, 32, 64\)"),
    "YaRN attention factor": ((), lambda w: w.add_rope_scaling_yarn_attn_factor(2.0),
                              "gpt-oss.rope.scaling.yarn_attn_factor is not supported"),
    "gate and up fused": ((), lambda w: w.add_tensor("blk.0.ffn_gate_up_exps.weight", torch.zeros(8, 64, 64).numpy()),
                          "blk.0.ffn_gate_up_exps.weight .*gate and up fused in one stack are not read yet"),
}  # fmt: skip


@pytest.mark.parametrize("case", _GPT_OSS_MALFORMED)
def test_malformed_gpt_oss_file_is_refused(case, tmp_path):
    """What the reader cannot run as the file means is refused, naming the file and the key or
    tensor: another RoPE scaling than YaRN, a missing window, metadata that disagrees with the
    expert stacks, YaRN keys whose llama.cpp meaning differs from transformers' parameters,
    gate and up experts in one stack (a newer converter option)."""
    drop, add, message = _GPT_OSS_MALFORMED[case]
    _, path = gpt_oss_file(tmp_path)
    bad = copy_gguf(path, tmp_path / "bad.gguf", add, arch="gpt-oss", drop=drop)
    with pytest.raises(ValueError, match=message) as e:
        read_gguf(bad, torch.float32)
    assert "bad.gguf" in str(e.value)
