"""Hugging Face repo ids as model names: the cache first, a download when the hub may be used,
`revision`, HF_HUB_OFFLINE, a GGUF file chosen inside a repo, a clear error otherwise.

No network here: the cache is a folder in huggingface_hub's layout (models--org--name/refs,
snapshots/<commit>), and "downloading" is a stand-in that writes such a snapshot.

Guards against: repo ids read as missing local paths, a cached snapshot missing its weights
being used (or refusing a download), the wrong GGUF file of a repo, errors that don't say
whether the cache or the network failed.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import huggingface_hub
import pytest

from slotrunner import LLM
from slotrunner.core_runner.loader.hub import HubOptions, resolve_model_path


def snapshot(cache: Path, repo_id: str, revision: str = "main", files: dict[str, bytes] | None = None) -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    folder = repo / "snapshots" / commit
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in (files or {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def online(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def test_a_cached_repo_runs_and_its_revision_is_honoured(tmp_path, tiny_llama_dir, offline):
    cache = tmp_path / "cache"
    shutil.copytree(tiny_llama_dir, snapshot(cache, "org/tiny"), dirs_exist_ok=True)
    v1 = snapshot(cache, "org/tiny", "v1")
    shutil.copytree(tiny_llama_dir, v1, dirs_exist_ok=True)
    config = (v1 / "config.json").read_text().replace('"max_position_embeddings": 256', '"max_position_embeddings": 128')
    (v1 / "config.json").write_text(config)
    main = LLM("org/tiny", download_dir=str(cache), device="cpu")
    assert main.config.max_model_len == 256 and "snapshots" in main.config.model
    assert LLM("org/tiny", revision="v1", download_dir=str(cache), device="cpu").config.max_model_len == 128


def test_missing_local_paths_stay_file_not_found(tmp_path):
    for name in (str(tmp_path / "nope"), "./nope", "../a/b/c"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            resolve_model_path(name)


def test_offline_and_not_cached_says_so(tmp_path, offline):
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE is set.*hf download org/absent"):
        LLM("org/absent", download_dir=str(tmp_path), device="cpu")


def test_an_incomplete_snapshot_is_not_used(tmp_path, offline):
    """A cache that got only config.json (AutoConfig did that) has no weights: offline, say so."""
    cache = tmp_path / "cache"
    snapshot(cache, "org/partial", files={"config.json": b"{}"})
    with pytest.raises(FileNotFoundError, match="no complete snapshot"):
        resolve_model_path("org/partial", HubOptions(cache_dir=str(cache)))


def test_not_cached_and_online_downloads_the_checkpoint_files(tmp_path, tiny_llama_dir, online, monkeypatch):
    cache = tmp_path / "cache"
    calls = []

    def list_repo_files(self, repo_id, revision=None, token=None):
        return ["config.json", "model.safetensors", "README.md", "model-q4.gguf"]

    real_snapshot_download = huggingface_hub.snapshot_download

    def snapshot_download(repo_id, local_files_only=False, allow_patterns=None, **kw):
        if local_files_only:
            return real_snapshot_download(repo_id, local_files_only=True, **kw)
        calls.append((repo_id, kw["revision"], allow_patterns))
        folder = snapshot(cache, repo_id, kw["revision"] or "main")
        shutil.copytree(tiny_llama_dir, folder, dirs_exist_ok=True)
        return str(folder)

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    path = resolve_model_path("org/remote", HubOptions(revision="v2", cache_dir=str(cache)))
    assert (path / "model.safetensors").is_file()
    [(repo, revision, patterns)] = calls
    assert repo == "org/remote" and revision == "v2" and "*.safetensors" in patterns and "*.gguf" not in patterns
    assert resolve_model_path("org/remote", HubOptions(revision="v2", cache_dir=str(cache))) == path
    assert len(calls) == 1, "the second lookup is served by the cache"


def test_a_failed_download_is_a_clear_error(tmp_path, online, monkeypatch):
    def list_repo_files(self, repo_id, revision=None, token=None):
        raise RuntimeError("[Errno -3] Temporary failure in name resolution")  # the HTTP client's errors are no OSErrors

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", list_repo_files)
    with pytest.raises(FileNotFoundError, match="not a local path.*downloading it failed.*name resolution"):
        resolve_model_path("org/missing", HubOptions(cache_dir=str(tmp_path)))


@pytest.mark.parametrize(
    "name, expected",
    [
        ("org/q", "q-Q4_K_M.gguf"),  # a repo with one GGUF file and no config.json
        ("org/many:q8_0", "many-Q8_0.gguf"),  # vLLM's repo:QUANT form, case-insensitive
        ("org/many/sub/many-Q4_K_M.gguf", "sub/many-Q4_K_M.gguf"),  # a file path in the repo
    ],
)
def test_a_gguf_file_is_chosen_inside_a_repo(tmp_path, offline, name, expected):
    cache = tmp_path / "cache"
    snapshot(cache, "org/q", files={"q-Q4_K_M.gguf": b"GGUF"})
    snapshot(cache, "org/many", files={"many-Q8_0.gguf": b"GGUF", "sub/many-Q4_K_M.gguf": b"GGUF"})
    path = resolve_model_path(name, HubOptions(cache_dir=str(cache)))
    assert path.as_posix().endswith(expected) and path.is_file()


def test_several_gguf_files_need_a_choice(tmp_path, online, monkeypatch):
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda self, *a, **k: ["a-Q4_0.gguf", "a-Q8_0.gguf"])
    with pytest.raises(FileNotFoundError, match="several GGUF files.*org/a:QUANT.*a-Q4_0.gguf, a-Q8_0.gguf"):
        resolve_model_path("org/a", HubOptions(cache_dir=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="no GGUF file whose name holds 'Q5_K'"):
        resolve_model_path("org/a:Q5_K", HubOptions(cache_dir=str(tmp_path)))


def test_the_default_gguf_from_a_repo_runs(tmp_path, offline):
    """End to end: a GGUF repo in the cache, named with vLLM's repo:QUANT form."""
    from slotrunner.core_runner.loader.gguf_loader import default_model_path

    try:
        real = Path(default_model_path())
    except RuntimeError as e:
        pytest.skip(str(e))
    folder = snapshot(tmp_path, "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF")
    (folder / real.name).symlink_to(real)
    llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1", download_dir=str(tmp_path), device="cpu", max_model_len=64)
    assert llm.config.model.endswith(real.name) and llm.tokenizer is not None
