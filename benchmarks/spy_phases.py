"""Where the engine's thread spends a multimodal_throughput.py run, from a py-spy sampling profile.

    py-spy record --nonblocking --idle --threads -r 200 -f raw -o mm.txt -- \
        python benchmarks/multimodal_throughput.py --device cuda --skip-hf --multimodal-only --pre-read --full-warm-up
    python benchmarks/spy_phases.py mm.txt

py-spy samples every thread's Python stack without stopping the process, so host time that a
tracing profiler would distort (thousands of short launches) shows as it is. This reads its raw
output (one collapsed stack and its count per line) and splits the main thread's samples by the
benchmark's phases -- the timed run whose media is read while the engine steps (`timed`), the run
on media read before (`--pre-read`), the reading alone -- then, within each, by the engine call
the sample was inside and by the innermost function. The warm-up run is left out.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

# Engine calls a sample is attributed to (the innermost one on its stack wins).
ENGINE_CALLS = (
    "schedule", "execute_model", "sample_tokens", "prepare_inputs_embeds", "_encode_missing", "update", "_process",
    "_settle", "prepare_inputs", "add_request", "result", "_step_while_reading", "get_output", "wait", "synchronize",
)  # fmt: skip
PHASES = ("media read while stepping", "media read before", "reading alone")


def phase_of(stack: str) -> str | None:
    if "warm_up (" in stack:
        return None
    if "timed (" in stack:
        return PHASES[0]
    if "run_slotrunner" in stack and "step (" in stack:
        return PHASES[1]
    if "_read_prompts" in stack and "run_slotrunner" in stack:
        return PHASES[2]
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw", help="py-spy's output with -f raw")
    p.add_argument("--top", type=int, default=25, help="innermost functions listed per phase")
    args = p.parse_args()
    calls: dict[str, Counter] = defaultdict(Counter)
    leaves: dict[str, Counter] = defaultdict(Counter)
    for line in open(args.raw):
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        phase = phase_of(stack)
        if phase is None or "MainThread" not in frames[0]:
            continue
        n = int(count)
        call = None
        for frame in frames:
            m = re.match(r"\s*([\w.<>]+) \(", frame)
            if m and m.group(1).split(".")[-1] in ENGINE_CALLS:
                call = m.group(1).split(".")[-1]
        calls[phase][call] += n
        leaves[phase][re.sub(r":\d+\)", ")", frames[-1])] += n
    for phase in PHASES:
        total = sum(calls[phase].values())
        print(f"== {phase}: {total} samples of the engine's thread")
        print("   by engine call: " + ", ".join(f"{name or 'other'} {n}" for name, n in calls[phase].most_common(12)))
        for leaf, n in leaves[phase].most_common(args.top):
            print(f"   {n:6d}  {leaf}")


if __name__ == "__main__":
    main()
