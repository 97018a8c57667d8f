"""CPU throughput: slotrunner against transformers `generate` on the same prompts.

Both systems run the default SmolLM2-135M-Instruct GGUF in fp32 on CPU, greedy, with exactly
`--max-tokens` new tokens per prompt (EOS ignored), on the same prompt token ids (built with
slotrunner's tokenizer: the two tokenizers split digits differently). Per batch size it prints
wall time, output tokens/s, time to first token and the slotrunner/transformers ratio side by
side, then how many prompts produced identical token ids and where the others diverge.

    python benchmarks/cpu_throughput.py --batch-sizes 1,8 --max-tokens 128 --repeats 3

Batch size B runs the prompts in consecutive groups of B (batch 1: one prompt at a time), so
every batch size generates the same tokens in total. transformers gets each group left-padded
with an attention mask (its Llama derives position ids from the mask); slotrunner gets each
group as B requests submitted together. Time to first token: slotrunner, from submission to
the end of the first engine step that returns a token for the request (mean over requests);
transformers, the wall time of `generate(max_new_tokens=1)` on the same group (mean over groups).

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

# Eight questions of different lengths; chat-templated they span ~35 to ~120 tokens.
QUESTIONS = (
    "What is the capital of France?",
    "Explain photosynthesis to a ten-year-old.",
    "Write a short poem about the sea at night.",
    "List three differences between Python lists and tuples, with a one-line example of each.",
    "A train leaves Paris at 9:40 and travels 460 km at an average speed of 115 km/h. "
    "At what time does it arrive, and how many minutes is the trip?",
    "Summarize the plot of Romeo and Juliet in four sentences, then say which character you find "
    "most sympathetic and why.",
    "I am planning a three-day trip to Rome in October with two children aged 7 and 11. Suggest "
    "a day-by-day itinerary that balances famous sights with breaks, and mention one place to eat "
    "each day.",
    "You are reviewing a pull request that adds a cache to a web service. The cache stores user "
    "profiles for 10 minutes, keyed by user id, in a global dictionary without locking, and the "
    "service runs with 8 worker threads. Describe the two most serious problems you would raise in "
    "the review and how to fix each one.",
)


@dataclass
class Run:
    """One timed pass over all prompts by one system at one batch size."""

    wall_s: float  # sum over groups of the generation wall time
    cpu_s: float  # process CPU time (user + system) over the same spans
    ttft_s: float  # mean time to first token
    token_ids: list[list[int]]  # [num_prompts][max_tokens]


@dataclass
class SystemResult:
    walls_s: list[float] = field(default_factory=list)
    cpus_s: list[float] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)

    def add(self, run: Run) -> None:
        self.walls_s.append(run.wall_s)
        self.cpus_s.append(run.cpu_s)
        self.ttfts_s.append(run.ttft_s)
        if not self.token_ids:
            self.token_ids = run.token_ids
        elif run.token_ids != self.token_ids:
            print("  warning: outputs changed between repeats of the same system")

    def wall(self, how: str) -> float:
        return min(self.walls_s) if how == "best" else statistics.median(self.walls_s)

    def cpu(self, how: str) -> float:
        return min(self.cpus_s) if how == "best" else statistics.median(self.cpus_s)

    def ttft(self, how: str) -> float:
        return min(self.ttfts_s) if how == "best" else statistics.median(self.ttfts_s)


class CpuMonitor:
    """CPU time that other processes take while we run: two threads that share two cores with a
    busy neighbour lose far more than half their speed (the threads wait on each other), so
    figures measured beside other work are flagged rather than trusted."""

    def __init__(self) -> None:
        self.start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float]:
        try:
            fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
            busy = sum(int(x) for i, x in enumerate(fields[:8]) if i not in (3, 4))  # not idle, iowait
            ticks = os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError):
            return (float("nan"),) * 3
        t = os.times()
        return busy / ticks, t.user + t.system, time.monotonic()

    def others_cores(self) -> float:
        """Mean number of cores busy with other processes since the monitor started."""
        busy, own, now = self._read()
        b0, o0, t0 = self.start
        return max(0.0, (busy - b0) - (own - o0)) / max(now - t0, 1e-9)


def cpu_time() -> float:
    t = os.times()
    return t.user + t.system


def groups(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


# ---- slotrunner ---------------------------------------------------------------------------------


def run_slotrunner(llm, prompts: list[list[int]], batch_size: int, max_tokens: int, counter: list[int]) -> Run:
    from slotrunner import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.engine
    outputs: dict[str, list[int]] = {}
    ttfts: list[float] = []
    wall = cpu = 0.0
    order: list[str] = []
    for group in groups(prompts, batch_size):
        ids = []
        c0, t0 = cpu_time(), time.perf_counter()
        for p in group:
            counter[0] += 1
            req_id = f"bench-{counter[0]}"
            engine.add_request(req_id, {"prompt_token_ids": p}, params)
            ids.append(req_id)
        first: dict[str, float] = {}
        while engine.has_unfinished_requests():
            step_out = engine.step()
            now = time.perf_counter()
            for out in step_out:
                if out.request_id not in first and out.outputs[0].token_ids:
                    first[out.request_id] = now - t0
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
        wall += time.perf_counter() - t0
        cpu += cpu_time() - c0
        ttfts.extend(first[r] for r in ids)
        order.extend(ids)
    return Run(wall, cpu, statistics.mean(ttfts), [outputs[r] for r in order])


# ---- transformers -------------------------------------------------------------------------------


def hf_batch(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input ids and attention mask for one group."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return input_ids, mask


def hf_generation_config(model, max_tokens: int, pad_id: int):
    from transformers import GenerationConfig

    # No EOS (rather than min_new_tokens, which masks EOS out of the logits and so changes the
    # argmax): both systems then emit exactly max_tokens greedy tokens, EOS included if it wins.
    # generate() fills every None here from model.generation_config, so EOS is cleared there too.
    model.generation_config.eos_token_id = None
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=max_tokens,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=pad_id,
        temperature=None,
        top_p=None,
        top_k=None,
    )


def run_hf(model, prompts: list[list[int]], batch_size: int, max_tokens: int, pad_id: int, time_ttft: bool) -> Run:
    gen = hf_generation_config(model, max_tokens, pad_id)
    first = hf_generation_config(model, 1, pad_id)
    token_ids: list[list[int]] = []
    ttfts: list[float] = []
    wall = cpu = 0.0
    with torch.inference_mode():
        for group in groups(prompts, batch_size):
            input_ids, mask = hf_batch(group, pad_id)
            if time_ttft:
                t0 = time.perf_counter()
                model.generate(input_ids=input_ids, attention_mask=mask, generation_config=first)
                ttfts.append(time.perf_counter() - t0)
            c0, t0 = cpu_time(), time.perf_counter()
            out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=gen)
            wall += time.perf_counter() - t0
            cpu += cpu_time() - c0
            new = out[:, input_ids.shape[1] :]
            assert new.shape[1] == max_tokens, f"transformers produced {new.shape[1]} tokens, not {max_tokens}"
            token_ids.extend(row.tolist() for row in new)
    return Run(wall, cpu, statistics.mean(ttfts) if ttfts else float("nan"), token_ids)


# ---- comparison and report ----------------------------------------------------------------------


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    """Identical prompts, and for each other one the first step (0-based) where the two differ."""
    diverged = {}
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            diverged[i] = next((s for s, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return {"identical": len(a) - len(diverged), "total": len(a), "first_divergence_step": diverged}


def describe(c: dict) -> str:
    text = f"{c['identical']}/{c['total']} identical"
    if c["first_divergence_step"]:
        text += " (prompt:step " + ", ".join(f"{i}:{s}" for i, s in c["first_divergence_step"].items()) + ")"
    return text


def environment() -> dict:
    import transformers

    def sh(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "?"

    cpu = "?"
    for line in sh(["lscpu"]).splitlines():
        if line.startswith("Model name:"):
            cpu = line.split(":", 1)[1].strip()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": sh(["git", "-C", str(Path(__file__).resolve().parent.parent), "rev-parse", "--short", "HEAD"]),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else "?",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,8", help="comma-separated, e.g. 1,8")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (EOS ignored)")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per system and batch size")
    ap.add_argument("--report", choices=("median", "best"), default="median", help="which repeat the table shows")
    ap.add_argument("--num-prompts", type=int, default=len(QUESTIONS), help="prompts (the questions, cycled)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for both systems")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument(
        "--quantized-weights",
        default="auto",
        choices=("auto", "packed", "dequantized"),
        help="slotrunner's LLM(quantized_weights=...): Q4_1/Q8_0 kept packed (auto on CPU) or dequantized like transformers",
    )
    ap.add_argument("--json", type=Path, default=None, help="write all figures to this file")
    args = ap.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from slotrunner import LLM
    from slotrunner.core_runner.loader.gguf_loader import default_model_path

    t0 = time.perf_counter()
    llm = LLM(
        device="cpu",
        dtype="float32",
        max_model_len=args.max_model_len,
        max_num_seqs=max(batch_sizes),
        quantized_weights=args.quantized_weights,
    )
    packed = sum(getattr(m, "packed", None) is not None for m in llm.engine.runner.model.modules())
    print(f"slotrunner loaded in {time.perf_counter() - t0:.1f} s ({packed} matrices packed, quantized_weights={args.quantized_weights})")
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.num_prompts)]
    prompts = [llm.render_chat([{"role": "user", "content": q}])["prompt_token_ids"] for q in questions]
    print(f"{len(prompts)} prompts, lengths {[len(p) for p in prompts]}")

    path = Path(default_model_path())
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    print(f"transformers loaded in {time.perf_counter() - t0:.1f} s (attention: {hf.config._attn_implementation})")
    tok = llm.get_tokenizer()
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    torch.set_num_threads(args.threads)  # loading may have changed it

    counter = [0]
    monitor = CpuMonitor()
    results: dict[int, dict[str, SystemResult]] = {}
    for bs in batch_sizes:
        print(f"batch {bs}: warm-up")
        warm = prompts[:bs]
        run_slotrunner(llm, warm, bs, min(args.max_tokens, 16), counter)
        run_hf(hf, warm, bs, min(args.max_tokens, 16), pad_id, time_ttft=True)
        res = {"slotrunner": SystemResult(), "transformers": SystemResult()}
        for r in range(args.repeats):
            # Alternate the systems so slow drift of the machine hits both alike.
            rep = CpuMonitor()
            sr = run_slotrunner(llm, prompts, bs, args.max_tokens, counter)
            res["slotrunner"].add(sr)
            h = run_hf(hf, prompts, bs, args.max_tokens, pad_id, time_ttft=True)
            res["transformers"].add(h)
            print(f"  repeat {r + 1}: slotrunner {sr.wall_s:.2f} s, transformers {h.wall_s:.2f} s, "
                  f"other processes {rep.others_cores():.2f} cores")
        results[bs] = res

    background = monitor.others_cores()
    num_tokens = len(prompts) * args.max_tokens
    how = args.report
    header = (
        f"{'batch':>5} | {'HF wall s':>9} | {'HF tok/s':>8} | {'HF TTFT ms':>10} | "
        f"{'SR wall s':>9} | {'SR tok/s':>8} | {'SR TTFT ms':>10} | {'SR/HF tok/s':>11} | "
        f"{'HF cpu s':>8} | {'SR cpu s':>8} | {'SR/HF cpu':>9}"
    )
    print()
    print(f"{len(prompts)} prompts x {args.max_tokens} new tokens, fp32, greedy, {args.threads} threads, "
          f"{how} of {args.repeats}; HF = transformers generate, SR = slotrunner")
    print(f"other processes kept {background:.2f} of {os.cpu_count()} cores busy during the timed runs"
          + ("  <-- WARNING: wall figures disturbed by other load" if background > 0.1 else ""))
    print(header)
    print("-" * len(header))
    rows = []
    for bs, res in results.items():
        h, s = res["transformers"], res["slotrunner"]
        h_tps, s_tps = num_tokens / h.wall(how), num_tokens / s.wall(how)
        rows.append(
            {
                "batch_size": bs,
                "transformers": {"wall_s": h.wall(how), "tok_s": h_tps, "ttft_s": h.ttft(how), "cpu_s": h.cpu(how),
                                 "walls_s": h.walls_s, "ttfts_s": h.ttfts_s, "cpus_s": h.cpus_s},
                "slotrunner": {"wall_s": s.wall(how), "tok_s": s_tps, "ttft_s": s.ttft(how), "cpu_s": s.cpu(how),
                               "walls_s": s.walls_s, "ttfts_s": s.ttfts_s, "cpus_s": s.cpus_s},
                "ratio_tok_s": s_tps / h_tps,
                "ratio_cpu": h.cpu(how) / s.cpu(how),
            }
        )
        print(
            f"{bs:>5} | {h.wall(how):>9.2f} | {h_tps:>8.1f} | {h.ttft(how) * 1e3:>10.1f} | "
            f"{s.wall(how):>9.2f} | {s_tps:>8.1f} | {s.ttft(how) * 1e3:>10.1f} | {s_tps / h_tps:>10.2f}x | "
            f"{h.cpu(how):>8.2f} | {s.cpu(how):>8.2f} | {h.cpu(how) / s.cpu(how):>8.2f}x"
        )
    print("SR/HF cpu = HF CPU seconds / SR CPU seconds: with --threads 1 it does not depend on other load;")
    print("with more threads it counts the time threads spin waiting for each other.")

    print()
    print("equality of generated token ids (first divergence as prompt:step, 0-based):")
    reference = results[1]["transformers"].token_ids if 1 in results else None
    for row in rows:
        bs = row["batch_size"]
        res = results[bs]
        same_batch = compare(res["slotrunner"].token_ids, res["transformers"].token_ids)
        row["equal_vs_hf_same_batch"] = same_batch
        line = f"  batch {bs}: slotrunner vs HF batch {bs}: {describe(same_batch)}"
        if reference is not None and bs != 1:
            row["equal_vs_hf_batch1"] = compare(res["slotrunner"].token_ids, reference)
            row["hf_batch_vs_hf_batch1"] = compare(res["transformers"].token_ids, reference)
            line += f"; slotrunner vs HF batch 1: {describe(row['equal_vs_hf_batch1'])}"
            line += f"; HF batch {bs} vs HF batch 1: {describe(row['hf_batch_vs_hf_batch1'])}"
        print(line)
    if 1 in results:
        for bs in batch_sizes:
            if bs != 1:
                c = compare(results[bs]["slotrunner"].token_ids, results[1]["slotrunner"].token_ids)
                print(f"  slotrunner batch {bs} vs slotrunner batch 1: {describe(c)}")

    if args.json is not None:
        report = {
            "environment": environment(),
            "command": "python " + " ".join(sys.argv),
            "background_cores": background,
            "num_prompts": len(prompts),
            "prompt_lens": [len(p) for p in prompts],
            "max_tokens": args.max_tokens,
            "report": how,
            "rows": rows,
            "outputs": {
                str(bs): {name: asdict(r)["token_ids"] for name, r in res.items()} for bs, res in results.items()
            },
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
