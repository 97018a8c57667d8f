"""Shared fixtures: tiny random-weight checkpoints saved once per test session."""

from __future__ import annotations

import pytest

from slotrunner.conformance import build_case
from slotrunner.registry import tiny_config


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """An untied tiny Llama saved with transformers (config.json + model.safetensors)."""
    directory = tmp_path_factory.mktemp("tiny_llama")
    build_case(tiny_config("LlamaForCausalLM"), directory)
    return directory


@pytest.fixture(scope="session")
def smollm2_hf_dir(tmp_path_factory):
    """The default model (SmolLM2-135M-Instruct GGUF) extracted once into a transformers
    directory, so oracle tests load it in a second instead of re-running transformers' slow GGUF
    path. tests/core_runner/loader/test_gguf_loader.py proves the extraction equals
    transformers' own GGUF loading tensor for tensor."""
    import torch

    from slotrunner.core_runner.loader.gguf_loader import default_model_path
    from slotrunner.registry import read_gguf

    try:
        path = default_model_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    from transformers import LlamaForCausalLM

    ckpt = read_gguf(path, torch.float32)
    model = LlamaForCausalLM(ckpt.config)
    missing, unexpected = model.load_state_dict(dict(ckpt.weights()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    directory = tmp_path_factory.mktemp("smollm2_hf")
    model.save_pretrained(str(directory))
    ckpt.tokenizer.save_pretrained(str(directory))
    return directory


class AlwaysDrafts:
    """A draft gate that always wants drafts. The engine's gate (core_runner/engine/draft_gate.py)
    withholds them once they cost more than they save on this machine's clock -- a loaded
    machine, a draft never accepted -- which would leave what drafts do untested."""

    def want_drafts(self) -> bool:
        return True

    def observe(self, with_drafts: bool, seconds: float, num_emitted: int) -> None:
        pass


@pytest.fixture
def with_drafts():
    """A function that gives an engine that speculates `AlwaysDrafts` and returns it."""

    def install(llm):
        if llm.engine.scheduler.draft_gate is not None:
            llm.engine.scheduler.draft_gate = AlwaysDrafts()
        return llm

    return install


@pytest.fixture
def run_interpreted():
    """Run a module-level check function of a test file in a subprocess where Triton kernels
    execute through the Triton interpreter on CPU (`TRITON_INTERPRET=1`), dispatched by the
    kernels' wrappers (`SLOTRUNNER_FORCE_TRITON=1`). The environment must be set before triton
    is imported, hence the subprocess. Skips when triton is not installed."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    import torch

    if torch.cuda.is_available():
        # On a GPU machine the compiled kernels are checked by the GPU tests; older Triton
        # interpreters (3.6) also reject loop bounds the compiler accepts.
        pytest.skip("a GPU is present: kernels are checked compiled, not interpreted")

    def run(func) -> str:
        path = sys.modules[func.__module__].__file__
        code = f"import runpy; runpy.run_path({path!r})[{func.__name__!r}]()"
        env = dict(os.environ, TRITON_INTERPRET="1", SLOTRUNNER_FORCE_TRITON="1")
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{func.__name__} failed under the Triton interpreter:\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    return run


@pytest.fixture
def run_decode_steps_without_sync():
    """A function that runs decode-only engine steps on CUDA with any host-device sync raising
    (`torch.cuda.set_sync_debug_mode("error")`); returns how many ran."""
    import torch

    def run(engine, steps: int, decode_only: bool = True) -> int:
        """Run `steps` steps (decode-only ones, unless `decode_only` is False) with any host-device
        sync raising; returns how many ran."""
        checked = 0
        for _ in range(steps):
            sched = engine.scheduler.schedule()
            assert not decode_only or all(n == 1 for n in sched.num_scheduled_tokens.values()), "expected a decode-only step"
            torch.cuda.set_sync_debug_mode("error")
            try:
                engine.runner.execute_model(sched)
                pending = engine.runner.sample_tokens()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            engine.scheduler.update(sched, pending.get())
            checked += 1
        return checked

    return run


class RealRowsAttention:
    """The attention backend on a padded replay: the real rows through the reference backend
    with the step's own metadata (it plans from host-side lengths), padding rows' outputs zero
    and their K/V unwritten -- what the Triton backend does for slot -1."""

    def __init__(self, inner, meta) -> None:
        self.inner, self.meta = inner, meta

    def forward(self, spec, q, k, v, kv_cache, meta, position_bias=None, sinks=None, rotate=None):
        import torch

        if rotate is not None:  # the layer's rotary embedding, over every token as a replay runs it
            q, k = rotate(q, k, None)
        r = self.meta.num_tokens
        out = torch.zeros_like(q)
        out[:r] = self.inner.forward(spec, q[:r], k[:r], v[:r], kv_cache, self.meta, position_bias, sinks)
        return out


@pytest.fixture
def replayed_decode():
    """A `CudaGraphs` that does on the CPU what a replay does to the family: the family metadata
    and inputs are taken once per (rows, tokens a row) at "capture" (`prepare_dummy_attn` /
    `prepare_dummy_inputs`), and every padded step it serves runs the model over the padded
    buffers with those same objects -- the state must have rewritten them in place. Attention:
    `RealRowsAttention` (graph safety of attention itself is tested on the GPU). Counts
    `replays` (per tokens a row) and `padded` steps."""
    from collections import Counter

    import torch

    from slotrunner.core_runner.attention.forward_context import ForwardContext, forward_context
    from slotrunner.core_runner.runner.cuda_graphs import CudaGraphs

    class ReplayedDecode(CudaGraphs):
        def capture(self) -> None:
            keys = [(n, 1) for n in self.sizes] + [(n, self.draft_query_len) for n in self.draft_sizes]
            keys += [(1, q) for q in self.prefill_lens]
            self.captured = {(n, q): self._dummy_inputs(n, q) for n, q in keys}
            self.replays, self.padded = Counter(), 0

        def run(self, batch) -> torch.Tensor:
            n, b = batch.num_reqs_padded, self.buffers
            q = batch.num_tokens_padded // n
            extra, family_attn = self.captured[n, q]
            real = batch.attn_metadata()
            ctx = ForwardContext(RealRowsAttention(self.backend, real), real, family_attn)
            with torch.inference_mode(), forward_context(ctx):
                hidden = self.model(b.input_ids[: n * q], b.positions[: n * q], inputs_embeds=None, **extra.as_kwargs())
            self.replays[q] += 1
            self.padded += n > batch.num_reqs
            return hidden[: batch.num_tokens]

    return ReplayedDecode


@pytest.fixture
def compile_for_hopper():
    """Compile a Triton kernel for sm_90 on this machine, GPU or not (Triton's frontend, then
    the ptxas its wheel ships): what the interpreter never checks -- constexpr rules, types
    the compiler infers, shapes tl.dot accepts. `compile(kernel, signature, constexprs,
    num_warps=4, num_stages=3)` takes each runtime argument's Triton type (`"*bf16"`, `"i32"`)
    and each constexpr's value, and returns the cuobjdump resource line (registers, local
    memory), `DYNAMIC_SHARED:<bytes>` (the shared memory a launch asks for; an H100 / H200
    gives a program at most 232,448), `ASYNC_COPIES:<n>` (loads issued as asynchronous
    copies to shared memory: those the software pipeliner took), `SHARED_BYTE_LOADS:<n>`
    (reads of shared memory one byte an instruction, in the PTX), `GDC_WAITS:<n>` (programmatic
    dependent launch's waits, in the PTX). Constexprs the kernel gives a default take it unless
    given. Skips where Triton or its NVIDIA backend is missing.

    Every pointer is compiled as 16-byte aligned, as the JIT specializes a launch whose tensors
    are (torch's allocations and the staged fields are): without that hint Triton can prove no
    alignment, so loads stay scalar and none goes through an asynchronous copy -- a variant no
    launch runs. `divisible` names integer arguments to compile as multiples of 16 as well."""
    import inspect
    import os
    import subprocess
    import tempfile

    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not os.path.exists(os.path.join(bin_dir, "ptxas")):
        pytest.skip("this Triton ships no ptxas")

    def compile(kernel, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3, divisible=()) -> str:
        jit = kernel if isinstance(kernel, triton.runtime.jit.JITFunction) else kernel.fn  # CachedLaunch wraps one
        params = list(inspect.signature(jit.fn).parameters)
        defaults = {n: q.default for n, q in inspect.signature(jit.fn).parameters.items() if q.default is not q.empty}
        constexprs = {**{n: v for n, v in defaults.items() if n not in signature}, **constexprs}  # defaults unless given
        assert set(params) == set(signature) | set(constexprs), f"arguments {set(params) ^ (set(signature) | set(constexprs))}"
        assert set(divisible) <= set(signature), f"divisible {set(divisible) - set(signature)} are not runtime arguments"
        sig = {p: "constexpr" if p in constexprs else signature[p] for p in params}
        aligned = [p for p in signature if signature[p].startswith("*") or p in divisible]
        attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in aligned}
        src = ASTSource(jit, sig, constexprs={(params.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            dump = [os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", f.name]
            out = subprocess.run(dump, capture_output=True, text=True, check=True).stdout
        usage = " ".join(line.strip() for line in out.splitlines() if "REG:" in line)
        copies = compiled.asm["ttgir"].count("ttg.async_copy_global_to_local")  # loads the pipeliner made asynchronous
        ptx = compiled.asm["ptx"]
        byte_loads = ptx.count("ld.shared.b8")  # shared-memory reads of one byte each
        gdc = ptx.count("griddepcontrol.wait")  # programmatic dependent launch's waits (triton_utils.pdl_enter)
        return (f"{usage} DYNAMIC_SHARED:{compiled.metadata.shared} ASYNC_COPIES:{copies} SHARED_BYTE_LOADS:{byte_loads}"
                f" GDC_WAITS:{gdc}")

    return compile
