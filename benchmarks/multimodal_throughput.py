"""Multimodal throughput: LLaVA with images against the same LM fed text, and transformers `generate`.

A LLaVA-shaped model with random bf16 weights -- a CLIP-L/14-336 tower (24 layers, 1024 wide,
576 patches per 336x336 image) and a 0.45B Llama LM (24 layers, 1024 wide) -- on N requests of
one random 336x336 image plus 50 text tokens, greedy, exactly `--output-len` new tokens each (EOS
ignored). Four runs of the same prompts' lengths, printed side by side:

- slotrunner, multimodal: the image prompts through `MultimodalModelState` (tower, merge);
- slotrunner, LLaVA text-only: the same model, each image replaced by 576 text tokens (the
  multimodal state with nothing to merge: what the family costs on its own);
- slotrunner, LM as a decoder: the LM's weights saved as `LlamaForCausalLM`, the same text
  prompts through the default decoder state (the reference the text-only run should equal);
- transformers `generate` on the image prompts, in batches of `--hf-batch`.

Each slotrunner row also prints the run's engine steps, those that replayed a CUDA graph, and the
mean wall time of a step. `--pre-read` adds a row: the multimodal engine again, its prompts read
(media decoded and preprocessed) before the clock starts and added at once -- the run without its
intake overlapping the steps; `--eager-tower-too` adds the multimodal engine with its vision
tower launched eagerly instead of replayed as CUDA graphs (model_states/tower_graphs.py), runs
alternating; `--intake-workers N` sets the workers that read media prompts, `--intake threads|processes` how;
`--alternate 4,8` times one LLaVA engine, alternating pools of 4 and 8 intake processes and the
text prompts in every repeat, and the LM as a decoder in a second engine of the same process.

Goals (docs: benchmarks/RESULTS.md): the multimodal run >= 0.85x the text-only run; the LLaVA
text-only run within 10% of the LM as a decoder.

    python benchmarks/multimodal_throughput.py                      # one GPU, 128 x (image + 50) -> 256
    python benchmarks/multimodal_throughput.py --tiny --device cpu  # a small shape, to check the script
    python benchmarks/multimodal_throughput.py --tiny-widths --device cpu --skip-hf --profile  # host costs on a CPU

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from throughput import warm_up  # the workload's shapes once, untimed


def llava_config(args: argparse.Namespace):
    from slotrunner.registry import tiny_configs as tc

    if args.tiny or args.tiny_widths:
        vision = dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, image_size=336 if args.tiny_widths else 56, patch_size=14, projection_dim=64)
        text = dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    else:  # CLIP-L/14-336 and a 0.45B Llama
        vision = dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                      num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768)
        text = dict(model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                    num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    return tc.llava(vision_config=vision, text_config=text, image_seq_length=patches)


def build(directory: Path, args: argparse.Namespace, dtype: torch.dtype):
    """Save the LLaVA model (with its processor) and its LM alone as a LlamaForCausalLM."""
    import transformers

    from slotrunner.registry import tiny_configs as tc

    config = llava_config(args)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).to(dtype).eval()
    model.save_pretrained(str(directory / "llava"))
    tc.llava_processor(config).save_pretrained(str(directory / "llava"))
    lm = transformers.LlamaForCausalLM(config.text_config).to(dtype).eval()
    lm.model.load_state_dict(model.model.language_model.state_dict())
    lm.lm_head.load_state_dict(model.lm_head.state_dict())
    lm.config.architectures = ["LlamaForCausalLM"]
    lm.save_pretrained(str(directory / "lm"))
    # The same tokenizer, so that both runs detokenize their outputs: host work alike.
    tc.llava_processor(config).tokenizer.save_pretrained(str(directory / "lm"))
    return model, config


def prompts_for(args: argparse.Namespace, config) -> tuple[list[dict], list[dict]]:
    """(image prompts, text prompts of the same token counts): '<image>' + 50 words; the text
    form puts image_seq_length word tokens where the image's placeholders would be."""
    from PIL import Image

    size = config.vision_config.image_size
    rng = np.random.RandomState(0)
    media, text = [], []
    for i in range(args.num_requests):
        words = " ".join(f"w{10 + (7 * i + j) % 900}" for j in range(args.text_len))
        img = Image.fromarray((rng.rand(size, size, 3) * 255).astype(np.uint8))
        media.append({"prompt": f"<image> {words}", "multi_modal_data": {"image": img}})
        ids = [1] + [10 + (3 * i + j) % 900 for j in range(config.image_seq_length)] + [10 + (7 * i + j) % 900 for j in range(args.text_len)]
        text.append({"prompt_token_ids": ids})
    return media, text


def make_engine(path: str, args: argparse.Namespace):
    """A slotrunner engine of the benchmark's settings, and the run's sampling parameters."""
    from slotrunner import LLM, SamplingParams

    llm = LLM(path, device=args.device, dtype=args.dtype, max_model_len=2048, max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=False)  # fmt: skip
    return llm, SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)


def timed_run(llm, prompts: list[dict], params, name: str) -> tuple:
    """(name, wall s, tokens, step stats) of serving `prompts` once."""
    with step_stats(llm) as stats:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync()
        return name, time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs), stats


def run_slotrunner(name: str, path: str, prompts: list[dict], args: argparse.Namespace) -> list[tuple]:
    """Rows (name, wall s, tokens, step stats) of one engine: the timed run, and with `--pre-read`
    and media prompts a second one whose prompts were read (media decoded and preprocessed)
    beforehand and are added at once: what the run costs without its intake overlapping it."""
    llm, params = make_engine(path, args)
    warm_up(llm, prompts, params if args.full_warm_up else None)
    t0 = time.perf_counter()
    read = list(llm._read_prompts(prompts, name_prompts=True))  # what reading the prompts (media) costs, on an idle engine
    args.intake_s = time.perf_counter() - t0
    sync()
    runs, pre_read, eager_tower = [], [], []

    def timed(runs: list[tuple], name: str) -> None:
        if args.profile:
            with step_stats(llm) as stats:
                runs.append((name, *profiled(lambda: llm.generate(prompts, params, use_tqdm=False)), stats))
        else:
            runs.append(timed_run(llm, prompts, params, name))

    for r in range(args.repeats):
        timed(runs, name)
        state = llm.engine.runner.model_state
        if args.eager_tower_too and getattr(state, "tower_graphs", None) is not None and "multi_modal_data" in prompts[0]:
            graphs, state.tower_graphs = state.tower_graphs, None  # the same engine, its tower launched eagerly
            try:
                timed(eager_tower, name + ", eager tower")
            finally:
                state.tower_graphs = graphs
        if args.pre_read and "multi_modal_data" in prompts[0]:
            engine = llm.engine
            with step_stats(llm) as stats:
                t0 = time.perf_counter()
                for i, prompt in enumerate(read):
                    engine.add_request(f"pre-read-{r}-{i}", prompt, params)
                tokens = 0
                while engine.has_unfinished_requests():
                    tokens += sum(len(o.outputs[0].token_ids) for o in engine.step(final_only=True) if o.finished)
                sync()
                pre_read.append((name + ", read before", time.perf_counter() - t0, tokens, stats))
    rows = [median_run(runs)] + [median_run(more) for more in (eager_tower, pre_read) if more]
    return rows


TEXT_RUN = "slotrunner, LLaVA text-only (same engine)"  # run_alternating's rows
LM_RUN = "slotrunner, LM as a decoder (same process)"


def run_alternating(path: str, lm_path: str, media: list[dict], text: list[dict], args: argparse.Namespace) -> list[tuple]:
    """Rows of `--alternate`: one LLaVA engine, each repeat timing the image prompts read by a
    pool of each worker count in turn (every pool forked and warmed before the clock), then the
    text prompts of the same lengths; then, in a second engine of the same process, the LM alone
    as a decoder on those text prompts."""
    from slotrunner.intake_pool import IntakePool

    (llm, params), (lm, _) = make_engine(path, args), make_engine(lm_path, args)
    warm_up(llm, media, params if args.full_warm_up else None)
    warm_up(llm, text, params if args.full_warm_up else None)
    warm_up(lm, text, params if args.full_warm_up else None)
    state_cls = type(llm.engine.runner.model_state)
    counts = [int(w) for w in args.alternate.split(",")]
    pools = {w: IntakePool(state_cls, llm.engine.intake, w) for w in counts}
    for w, pool in pools.items():  # fork and warm every worker, untimed
        llm._intake_pool = pool
        t0 = time.perf_counter()
        list(llm._read_prompts(media, name_prompts=True))
        args.intake_s = time.perf_counter() - t0
    sync()
    runs: dict[str, list] = {f"slotrunner, multimodal, {w} intake workers": [] for w in counts}
    runs[TEXT_RUN] = []
    runs[LM_RUN] = []

    def timed(name: str, prompts: list[dict], served=llm) -> None:
        runs[name].append(timed_run(served, prompts, params, name))

    try:
        for _ in range(args.repeats):
            for w in counts:
                llm._intake_pool = pools[w]
                timed(f"slotrunner, multimodal, {w} intake workers", media)
            timed(TEXT_RUN, text)
            timed(LM_RUN, text, lm)
    finally:
        llm._intake_pool = None
        for pool in pools.values():
            pool.close()
    lm_runs = runs.pop(LM_RUN)
    text_runs = runs.pop(TEXT_RUN)

    def ratios(label: str, over: list[tuple], under: list[tuple]) -> None:
        """Each repeat's wall ratio: drift between repeats moves both runs of a repeat alike."""
        r = [a[1] / b[1] for a, b in zip(over, under)]
        print(f"{label}, repeat by repeat: {' '.join(f'{x:.2f}' for x in r)} (median {statistics.median(r):.2f})")

    ratios("LM as a decoder / LLaVA text-only", lm_runs, text_runs)
    for w in counts:
        ratios(f"text-only / multimodal with {w} intake workers", text_runs, runs[f"slotrunner, multimodal, {w} intake workers"])
    return [median_run(r) for r in runs.values()] + [median_run(text_runs), median_run(lm_runs)]


def median_run(runs: list[tuple]) -> tuple:
    """The run of median wall time among repeats (the host's speed varies from run to run), its
    name suffixed with the spread of the walls when there are several."""
    ordered = sorted(runs, key=lambda run: run[1])
    name, wall, tokens, stats = ordered[len(ordered) // 2]
    if len(runs) > 1:
        name = f"{name} [{ordered[0][1]:.2f}-{ordered[-1][1]:.2f}]"
    return name, wall, tokens, stats


@contextlib.contextmanager
def step_stats(llm):
    """Count the run's engine steps, the seconds spent in them, the decode steps that replayed a
    CUDA graph (the rest ran eagerly) and the seconds spent in the steps that launched no graph,
    into the dict it yields."""
    engine, graphs = llm.engine, llm.engine.runner.cuda_graphs
    counts = {"steps": 0, "step_s": 0.0, "replays": 0, "eager_s": 0.0, "gc_s": 0.0, "gc_full": 0}
    step = engine.step
    gc_start = [0.0]

    def gc_timer(phase: str, info: dict) -> None:  # the interpreter's cycle collections during the run
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            counts["gc_s"] += time.perf_counter() - gc_start[0]
            counts["gc_full"] += info["generation"] == 2

    def timed_step(*a, **kw):
        t0, replays = time.perf_counter(), counts["replays"]
        try:
            return step(*a, **kw)
        finally:
            counts["steps"] += 1
            counts["step_s"] += time.perf_counter() - t0
            if counts["replays"] == replays:  # launched no graph: a prefill or mixed step (or an empty one)
                counts["eager_s"] += time.perf_counter() - t0

    engine.step = timed_step
    gc.callbacks.append(gc_timer)
    if graphs is not None:
        replay = graphs.run

        def counted(batch):
            counts["replays"] += 1
            return replay(batch)

        graphs.run = counted
    try:
        yield counts
    finally:
        del engine.step
        gc.callbacks.remove(gc_timer)
        if graphs is not None:
            del graphs.run


def profiled(generate) -> tuple[float, int]:
    """`generate()` under cProfile and the torch profiler: prints the host functions by
    cumulative time and the GPU kernels by total time (the wall time returned includes the
    profilers' overhead)."""
    import cProfile
    import pstats

    host = cProfile.Profile()
    activities = [torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available() else torch.profiler.ProfilerActivity.CPU]
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        host.enable()
        outs = generate()
        sync()
        host.disable()
    wall = time.perf_counter() - t0
    print(f"--- profile of a run ({wall:.2f} s wall with the profilers): host, by cumulative time")
    pstats.Stats(host).sort_stats("cumulative").print_stats(25)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events)
    print(f"--- GPU kernels: {total / 1e6:.3f} s in all")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:15]:
        print(f"  {e.self_device_time_total / 1e6:7.3f} s  x{e.count:<6} {e.key[:100]}")
    return wall, sum(len(o.outputs[0].token_ids) for o in outs)


def run_hf(model, directory: Path, prompts: list[dict], args: argparse.Namespace) -> tuple[float, int]:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(directory / "llava"))
    model = model.to(args.device)
    total, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch):
        group = prompts[i : i + args.hf_batch]
        inputs = processor(
            text=[p["prompt"] for p in group], images=[p["multi_modal_data"]["image"] for p in group], return_tensors="pt", padding=True
        ).to(args.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)  # fmt: skip
        total += (out.shape[1] - inputs["input_ids"].shape[1]) * len(group)
    sync()
    return time.perf_counter() - t0, total


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--text-len", type=int, default=50)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--hf-batch", type=int, default=32)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a small shape (CPU smoke run)")
    p.add_argument("--tiny-widths", action="store_true",
                   help="the tiny model's widths with 336 px images (576 tokens each): the host's work of the real workload on a cheap model")  # fmt: skip
    p.add_argument("--full-warm-up", action="store_true",
                   help="warm up on the whole run (full outputs), not two tokens a request: Triton specializes its "
                        "kernels on step sizes the short warm-up does not meet, and the first run of the process "
                        "would otherwise compile them while timed")
    p.add_argument("--repeats", type=int, default=1,
                   help="time each run this many times (the same engine) and report the median, with the range of the walls")
    p.add_argument("--pre-read", action="store_true",
                   help="also time the multimodal engine on its prompts read beforehand (no intake during the run)")
    p.add_argument("--intake-workers", type=int, default=None, help="workers reading media prompts (the family's default)")
    p.add_argument("--alternate", default=None, metavar="W1,W2,...",
                   help="one LLaVA engine, its runs alternating in each repeat: the image prompts read by a pool of "
                        "each of these numbers of worker processes, then the text prompts, then the LM as a decoder (a second "
                        "engine in the process) -- comparisons that the host's drift between processes does not blur")
    p.add_argument("--intake", choices=("threads", "processes"), default=None,
                   help="how media prompts are read (default: processes on CUDA, threads elsewhere; slotrunner/intake_pool.py)")
    p.add_argument("--eager-tower-too", action="store_true",
                   help="also time the multimodal engine with its vision tower launched eagerly, not replayed as CUDA graphs (alternating)")
    p.add_argument("--multimodal-only", action="store_true", help="only the multimodal engine's runs (e.g. under a sampling profiler)")
    p.add_argument("--profile", action="store_true", help="profile the slotrunner runs (host and GPU); their wall times then include the profilers")
    args = p.parse_args()
    args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    dtype = getattr(torch, args.dtype)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        directory = Path(d)
        model, config = build(directory, args, dtype)
        media, text = prompts_for(args, config)
        print(f"{args.num_requests} requests x (one {config.vision_config.image_size}px image = "
              f"{config.image_seq_length} tokens + {args.text_len} text tokens) -> {args.output_len} tokens, {args.device}")  # fmt: skip
        if args.intake is not None:
            import slotrunner.intake_pool as intake_pool

            intake_pool.USE_PROCESSES = args.intake == "processes"
        if args.intake_workers is not None:
            from slotrunner.model_states.multimodal import MultimodalModelState

            MultimodalModelState.intake_workers = args.intake_workers
        if args.alternate:
            rows += run_alternating(str(directory / "llava"), str(directory / "lm"), media, text, args)
            args.multimodal_only = True
        else:
            rows += run_slotrunner("slotrunner, multimodal", str(directory / "llava"), media, args)
        intake = args.intake_s  # reading the image prompts (decode, preprocess), overlapped with the multimodal run's steps
        if not args.multimodal_only:
            rows += run_slotrunner("slotrunner, LLaVA text-only", str(directory / "llava"), text, args)
            rows += run_slotrunner("slotrunner, LM as a decoder", str(directory / "lm"), text, args)
        if not args.skip_hf:
            rows.append(("transformers generate", *run_hf(model, directory, media, args), None))
    base = rows[0][2] / rows[0][1]
    print(f"{'run':<46} {'wall s':>8} {'tok/s':>9} {'vs multimodal':>14} {'steps':>6} {'graph steps':>11} {'ms a step':>9} {'s eager':>7} {'gc s (full)':>11}")
    for name, wall, tokens, st in rows:
        steps = "" if st is None else f" {st['steps']:>6} {st['replays']:>11} {1000 * st['step_s'] / max(st['steps'], 1):>9.2f} {st['eager_s']:>7.2f} {st['gc_s']:>6.2f} ({st['gc_full']})"
        print(f"{name:<46} {wall:>8.2f} {tokens / wall:>9.0f} {tokens / wall / base:>13.2f}x{steps}")
    print(f"reading the {args.num_requests} image prompts alone: {intake:.2f} s (on an idle engine; --pre-read times the run without it)")


if __name__ == "__main__":
    main()
