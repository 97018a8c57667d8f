"""GPU launches of one decode step's model forward, counted on a CPU.

Runs a tiny random-weight model of `--arch` (its registered tiny config) in float16 on the CPU with
every Triton kernel executed by the Triton interpreter, so the forward takes the GPU's path (not
the CPU's native float32 kernels), then
counts, over one decode step of `--batch` rows: Triton launches by kernel, and the torch
operators that launch a kernel on a GPU (aten operators, composite ones as what they decompose
into, minus views and empty allocations). A step replayed from a CUDA graph still runs each of these launches; at decode batch
sizes most of them cost their launch latency (a few microseconds each on one H100), so their
number bounds a step from below whatever the bytes it reads.

    python benchmarks/forward_launches.py --arch DeepseekV2ForCausalLM --batch 4
    python benchmarks/forward_launches.py --arch DeepseekV2ForCausalLM --batch 4 --prefill 40  # a prefill step

This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import os

# Before triton is imported: its kernels run interpreted on the CPU, dispatched as on a GPU.
os.environ.update(TRITON_INTERPRET="1", SLOTRUNNER_FORCE_TRITON="1")

import argparse  # noqa: E402
import tempfile  # noqa: E402
from collections import Counter  # noqa: E402

import torch  # noqa: E402

from step_overhead import OpCounter, kernels_counted_by  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# aten operators that launch nothing on a GPU: views, metadata, allocation.
NO_LAUNCH = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "slice", "select", "t", "transpose", "permute", "expand", "unsqueeze",
    "squeeze", "split", "split_with_sizes", "unbind", "alias", "as_strided", "detach", "empty", "empty_like",
    "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "narrow", "view_as", "diagonal", "unfold",
})  # fmt: skip


def count_decode_forward(arch: str, batch: int, prefill: int = 0) -> tuple[Counter, Counter, int]:
    """Launches of a decode step of `batch` rows; with `prefill` > 0, of the first step instead:
    `batch` prompts of `prefill` tokens each."""
    from slotrunner import LLM, SamplingParams, registry
    from slotrunner.conformance import tiny_case

    with tempfile.TemporaryDirectory() as d:
        config = registry.tiny_config(arch)
        tiny_case(arch, d, config)
        llm = LLM(d, device="cpu", dtype="float16", max_model_len=256, max_num_seqs=batch, enforce_eager=True)
        engine, runner = llm.engine, llm.engine.runner
        for i in range(batch):
            sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
            engine.add_request(f"r{i}", {"prompt_token_ids": [1 + (i + j) % 50 for j in range(prefill or 5)]}, sp)
        if not prefill:
            engine.step()  # the prefill
        forward, counter = runner.model.forward, OpCounter()

        class _Aten(TorchDispatchMode):  # composite operators counted as what they decompose into
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
                    with self:
                        out = func.decompose(*args, **kwargs)
                    if out is not NotImplemented:
                        return out
                if not counter._inside_kernel:
                    counter.aten[func.__name__] += 1
                return func(*args, **kwargs)

        def counted(*args, **kwargs):
            with kernels_counted_by(counter), _Aten():
                return forward(*args, **kwargs)

        runner.model.forward = counted
        sched = engine.scheduler.schedule()
        assert prefill or all(n == 1 for n in sched.num_scheduled_tokens.values()), "not a decode step"
        assert not prefill or all(n == prefill for n in sched.num_scheduled_tokens.values()), "not one whole prefill a row"
        runner.execute_model(sched)
        engine._process(sched, runner.sample_tokens().get(), final_only=True)
        aten = Counter({k: v for k, v in counter.aten.items() if k.split(".")[0] not in NO_LAUNCH})
        return aten, counter.kernels, config.num_hidden_layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="DeepseekV2ForCausalLM")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prefill", type=int, default=0, metavar="N", help="count the prefill step of prompts of N tokens instead")
    args = p.parse_args()
    torch.manual_seed(0)
    aten, kernels, layers = count_decode_forward(args.arch, args.batch, args.prefill)
    total = sum(aten.values()) + sum(kernels.values())
    what = f"prefill step of {args.batch} x {args.prefill} tokens" if args.prefill else f"decode step of {args.batch} rows"
    print(f"{args.arch}, {layers} layers, {what}: {total} launches "
          f"({sum(kernels.values())} Triton, {sum(aten.values())} torch operators)")  # fmt: skip
    print(f"  Triton: {dict(kernels.most_common())}")
    print(f"  torch:  {dict(aten.most_common())}")


if __name__ == "__main__":
    main()
