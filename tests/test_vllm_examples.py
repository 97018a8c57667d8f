"""vLLM's offline examples run on slotrunner (issue #22's acceptance test).

examples/vllm_offline/ holds ports of vLLM's examples/offline_inference/ scripts that differ from
vLLM's only in the import and the model name. Each runs here as a user runs it (`python
example.py`, a fresh process) against tiny random-weight models saved in a Hugging Face cache
under the names the examples use, with HF_HUB_OFFLINE=1: the examples resolve their model names
through the cache as transformers does.

Guards against: vLLM's spellings that slotrunner lacked raising TypeError or AttributeError
(LLM(gpu_memory_utilization=...), EngineArgs.add_cli_args, LLMEngine.from_engine_args,
llm.llm_engine.get_tokenizer_group(), slotrunner.inputs, RequestOutput.encoder_prompt,
cleanup_dist_env_and_memory, get_default_sampling_params), and repo ids being read as paths.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slotrunner.conformance import build_case
from slotrunner.registry import tiny_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "vllm_offline"
DECODER = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the name the decoder examples use
BART = "facebook/bart-large-cnn"  # encoder_decoder.py's
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TIMEOUT_S = 300  # per example; each takes a few seconds


def snapshot_dir(cache: Path, repo_id: str) -> Path:
    """A snapshot folder of `repo_id` in huggingface_hub's cache layout, with refs/main naming it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    folder = repo / "snapshots" / commit
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def bpe_tokenizer(special_tokens: list[str], **named: str):
    """A byte-level BPE of 1000 tokens trained on the examples' own text (so their prompts
    tokenize into words, as with a real tokenizer), special tokens first (ids 0, 1, ...)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    corpus = [p.read_text() for p in sorted(EXAMPLES.glob("*.py"))]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus * 4, vocab_size=1000, min_frequency=1, special_tokens=special_tokens, show_progress=False)
    return bpe, lambda: PreTrainedTokenizerFast(tokenizer_object=bpe, **named)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A Hugging Face cache holding a tiny Llama (ChatML template, SmolLM2's special tokens) and
    a tiny BART under the examples' model names."""
    cache = tmp_path_factory.mktemp("hf_hub_cache")
    decoder = snapshot_dir(cache, DECODER)
    build_case(tiny_config("LlamaForCausalLM", max_position_embeddings=4096, pad_token_id=2), decoder)
    _, make = bpe_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos_token="<|im_start|>",
                            eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="<|endoftext|>")  # fmt: skip
    tok = make()
    tok.chat_template = CHATML
    tok.save_pretrained(str(decoder))
    # Sampling defaults, as instruct models ship them (get_default_sampling_params reads them).
    (decoder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.7, "top_p": 0.9}))

    from tokenizers.processors import TemplateProcessing

    bart = snapshot_dir(cache, BART)
    build_case(tiny_config("BartForConditionalGeneration"), bart)
    bpe, make = bpe_tokenizer(["<s>", "<pad>", "</s>", "<unk>"], bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                              unk_token="<unk>")  # fmt: skip
    bpe.post_processor = TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    make().save_pretrained(str(bart))
    return cache


def run_example(name: str, hub_cache: Path, *args: str, cwd: Path | None = None) -> str:
    env = dict(os.environ, HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def test_every_example_is_tested():
    tested = {"basic.py", "reproducibility.py", "generate.py", "chat.py", "llm_engine_example.py", "encoder_decoder.py",
              "prefix_caching.py", "automatic_prefix_caching.py"}  # fmt: skip
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_basic(hub_cache):
    out = run_example("basic.py", hub_cache)
    assert out.count("Output:    ") == 4 and "Prompt:    'The capital of France is'" in out


def test_reproducibility(hub_cache):
    """Sampling at temperature 0.8 gives the same text in two runs (the last line, Python's own
    random number, is the user's: slotrunner neither seeds nor draws from it)."""
    first = run_example("reproducibility.py", hub_cache).splitlines()[:-1]
    second = run_example("reproducibility.py", hub_cache).splitlines()[:-1]
    assert first == second and sum("Generated text:" in line for line in first) == 4


def test_generate_with_engine_flags_and_model_defaults(hub_cache):
    out = run_example("generate.py", hub_cache, "--max-tokens", "8", "--top_k", "5", "--max-model-len", "512")
    assert out.count("Generated text:") == 4


def test_chat_with_a_template_file(hub_cache, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    out = run_example("chat.py", hub_cache, "--max-tokens", "4", "--chat-template-path", str(template))
    assert out.count("Generated text:") == 1 + 10 + 10
    assert "<|im_start|>system\\nYou are a helpful assistant<|im_end|>" in out  # the model's template
    assert "system: You are a helpful assistant" in out  # the file's


def test_llm_engine_example(hub_cache):
    out = run_example("llm_engine_example.py", hub_cache, "--model", DECODER, "--max-model-len", "512")
    assert out.count("RequestOutput(request_id=") == 3
    assert "request_id='2'" in out and "index=1" in out  # n=2: two samples in one output
    assert "cumulative_logprob=-" in out  # logprobs=1 asked by the first request


def test_encoder_decoder(hub_cache):
    out = run_example("encoder_decoder.py", hub_cache)
    assert out.count("Generated Text:") == 8
    assert "Encoder Prompt: 'Hello, my name is'\nDecoder Prompt: None" in out
    assert "Encoder Prompt: 'Hello, my name is'\nDecoder Prompt: 'A decoder prompt'" in out  # zipped


def test_prefix_caching(hub_cache):
    out = run_example("prefix_caching.py", hub_cache)
    assert "Generated answers are the same: True" in out


def test_automatic_prefix_caching(hub_cache):
    out = run_example("automatic_prefix_caching.py", hub_cache)
    assert out.count("Generation time:") == 2
