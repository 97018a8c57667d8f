"""GPU throughput on the bench workload: slotrunner vs transformers, in the same process run.

The bench workload (TARGETS.md): 256 requests, input and output lengths each uniform in
[100, 1024] (seeded), random token ids, EOS ignored, the Qwen3-0.6B shape (28 layers, hidden
1024, 16 heads / 8 KV heads, head_dim 128, vocab 151936, tied embeddings, QK-norm) with random
bf16 weights; metric: output tokens / wall seconds, prefill included.

Peers, on the same requests:
- transformers `generate`, static batches of `--hf-batch` requests, left-padded, each batch
  generating its longest requested output; only the requested tokens are counted.
- transformers `generate_batch` (continuous batching), each request with its own max_new_tokens.

It also prints the fraction of the memory-bandwidth roofline slotrunner reaches: the time the
card needs at its peak HBM bandwidth (one H200: 4.8 TB/s; `CARD_HBM_BYTES_PER_S`) just to read
the weights once per decode step and every token's KV context once per generated token, over the
measured wall time.

    python benchmarks/throughput.py                      # all systems
    python benchmarks/throughput.py --peers none         # slotrunner alone
    python benchmarks/throughput.py --num-requests 64 --peers generate
    python benchmarks/throughput.py --peers none --prefix-caching-ab 2   # caching's cost, off/on x2
    python benchmarks/throughput.py --peers none --phases   # also the time by step shape, and its GPU span
    python benchmarks/throughput.py --peers none --kv-cache-dtype fp8 --tile decode_longest_first=True   # a TileConfig field

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

# Peak HBM bandwidth by card (the vendors' figures), for the rooflines: the first key found in the
# device's name. A card not listed is counted as one H200.
CARD_HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12}


def hbm_bandwidth() -> tuple[float, str]:
    """(bytes/s, how the output names it) of this machine's GPU."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    for key, bw in CARD_HBM_BYTES_PER_S.items():
        if key in name:
            return bw, f"{bw / 1e12:.2f} TB/s, an {key}'s peak"
    return 4.8e12, "4.8 TB/s, one H200's peak (this card is not listed)"


def qwen3_06b_config() -> dict:
    return dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, hidden_act="silu", attention_bias=False, torch_dtype="bfloat16",
        bos_token_id=151643, eos_token_id=151645,
    )


def workload(n: int, seed: int, lo: int, hi: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(lo, hi + 1, n)
    out_lens = rng.integers(lo, hi + 1, n)
    prompts = [rng.integers(0, 151000, k).tolist() for k in in_lens]
    return prompts, [int(x) for x in out_lens]


def model_bytes(cfg: dict, kv_bytes: int = 2) -> tuple[int, int]:
    """(bytes of the bf16 weights a decode step reads, bytes of KV cache a token of context holds)."""
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * kv_bytes
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    qkvo = h * (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * cfg["head_dim"] + cfg["num_attention_heads"] * cfg["head_dim"] * h
    return 2 * (cfg["num_hidden_layers"] * (qkvo + 3 * h * i) + v * h), kv_per_token


def roofline_seconds(
    cfg: dict, prompts: list[list[int]], out_lens: list[int], num_steps: int, bandwidth: float, kv_bytes: int = 2
) -> float:
    """Bytes that must cross HBM at least once: weights per decode step, each generated token's
    KV context (`kv_bytes` an element: 2 bf16, 1 float8), over the bandwidth (bytes/s)."""
    weight_bytes, kv_per_token = model_bytes(cfg, kv_bytes)
    context = sum(len(p) * m + m * (m - 1) / 2 for p, m in zip(prompts, out_lens))
    return (weight_bytes * num_steps + kv_per_token * context) / bandwidth


def warm_up(llm, prompts: list, params=None) -> None:
    """Serve the workload's prompts once untimed, then forget the prefix cache. The prefill
    kernels compile at their first launch (Triton specializes on the step's sizes), so a warm-up
    of a few short prompts left their compilation inside the timed run -- up to seconds on a
    machine whose kernel cache is cold. Two tokens a request by default; with the run's own
    `params` (the whole run, untimed) also every mixed prefill/decode step shape the run meets:
    a multimodal run measured 4.29 s after the short warm-up and 2.27 s after the full one."""
    from slotrunner import SamplingParams

    llm.generate(prompts, params or SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()


def triton_cache_entries() -> dict[str, list[str]]:
    """Triton's on-disk kernel cache: entry -> the kernels it holds. Each kernel variant compiled
    since adds an entry (a variant found there is loaded, not compiled). Taken around a timed
    run, `compiled_since` names what the run paid to compile because its warm-up missed it."""
    import os

    try:
        from triton import knobs

        cache_dir = knobs.cache.dir
    except (ImportError, AttributeError):
        cache_dir = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    if not os.path.isdir(cache_dir):
        return {}
    return {
        entry: [f[: -len(".json")] for f in os.listdir(os.path.join(cache_dir, entry)) if f.endswith(".json") and not f.startswith("__grp__")]
        for entry in os.listdir(cache_dir)
    }


def compiled_since(before: dict[str, list[str]]) -> list[str]:
    """The kernels whose variants entered Triton's cache since `before`, by name."""
    return sorted(name for entry, names in triton_cache_entries().items() if entry not in before for name in names)


def tile_field(text: str) -> tuple[str, object]:
    """`FIELD=VALUE` of --tile: VALUE as the field's default's type (True / False for a flag)."""
    import dataclasses

    from slotrunner.core_runner.attention.tile_config import TileConfig

    name, _, value = text.partition("=")
    fields = {f.name: f for f in dataclasses.fields(TileConfig)}
    if name not in fields or not value:
        raise SystemExit(f"--tile {text!r}: expected FIELD=VALUE with FIELD one of {', '.join(fields)}")
    kind = type(fields[name].default)
    if kind is bool:
        if value not in ("True", "False"):
            raise SystemExit(f"--tile {text!r}: {name} takes True or False")
        return name, value == "True"
    return name, kind(value)


def run_slotrunner(model_dir: str, prompts, out_lens, args, prefix_caching: bool = True) -> dict:
    from slotrunner import LLM, SamplingParams
    from slotrunner.core_runner import triton_utils
    from slotrunner.core_runner.triton_utils import compiles_counted

    triton_utils.PDL = not args.no_pdl
    if args.tile:  # the Triton attention with these TileConfig fields, for this process's engines
        from slotrunner.core_runner.attention.tile_config import TileConfig
        from slotrunner.core_runner.attention.triton_attn import TritonBackend
        from slotrunner.core_runner.runner import model_runner

        tiles = TileConfig(**dict(tile_field(t) for t in args.tile))
        model_runner.select_attn_backend = lambda device: TritonBackend(tiles)
    t0 = time.perf_counter()
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=2100,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype,
              enable_prefix_caching=prefix_caching)
    startup = time.perf_counter() - t0
    reqs = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in out_lens]
    warm_up(llm, reqs, params if args.full_warm_up else None)
    steps = {"n": 0}
    step, scheduler, runner = llm.engine.step, llm.engine.scheduler, llm.engine.runner
    # (seconds since the last step's return, rows, tokens, tokens of KV context its rows read,
    # the step's GPU span: events before its execute_model and after its sample_tokens' launches)
    periods: list[tuple[float, int, int, int, tuple | None]] = []
    last = {"t": None, "done": None}
    spans: dict[int, list] = {}  # id(SchedulerOutput) -> [start event, end event]
    if args.phases:
        execute, sample = runner.execute_model, runner.sample_tokens

        def timed_execute(sched):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            spans[id(sched)] = [start, None]
            last["launched"] = sched
            return execute(sched)

        def timed_sample():
            out = sample()
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            spans[id(last["launched"])][1] = end
            return out

        runner.execute_model, runner.sample_tokens = timed_execute, timed_sample

    def counted_step(*a, **kw):
        steps["n"] += 1
        out = step(*a, **kw)
        if args.phases:
            # The step this call completed (under async scheduling the one before the step it
            # launched): the time between returns is the pipeline's period for it.
            now, done = time.perf_counter(), scheduler._last_updated
            if done is not None and done is not last["done"] and last["t"] is not None:
                sizes, tokens = done.num_scheduled_tokens, sum(done.num_scheduled_tokens.values())
                context = sum(done.cached_reqs.num_computed_tokens) + sum(r.num_computed_tokens for r in done.new_reqs) + tokens
                periods.append((now - last["t"], len(sizes), tokens, context, spans.pop(id(done), None)))
            last["t"], last["done"] = now, done
        return out

    llm.engine.step = counted_step
    torch.cuda.synchronize()
    spans.clear()
    keys: list[str] = []
    with compiles_counted(keys):  # kernel variants this process met first inside the timed run
        t = time.perf_counter()
        outs = llm.generate(reqs, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    for key in keys:
        print(f"  variant first launched inside the timed run: {key}"[:1200], flush=True)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(out_lens), f"generated {n_out} tokens, requested {sum(out_lens)}"
    periods = [p[:4] + ((p[4][0].elapsed_time(p[4][1]) / 1e3 if p[4] and p[4][1] else 0.0),) for p in periods]
    del llm
    gc.collect()  # the engine's reference cycles hold its GPU memory until collected
    torch.cuda.empty_cache()
    name = "slotrunner" if prefix_caching else "slotrunner, prefix caching off"
    return dict(system=name, wall_s=wall, out_tokens=n_out, steps=steps["n"], startup_s=startup, periods=periods)


PHASES = (("prefill or mixed", None), ("decode 1-4 rows", 4), ("decode 5-16", 16), ("decode 17-64", 64),
          ("decode 65-128", 128), ("decode 129-256", 256), ("decode > 256", None))  # fmt: skip


def print_phases(periods: list[tuple[float, int, int, int, float]], wall: float, cfg: dict, kv_bytes: int) -> None:
    """Where the run's time went, by the shape of the step each period completed; for decode
    steps also the bytes they must read (the weights once, each row's KV context) over the time.
    `GPU ms/step`: from the start of a step's execute_model to the end of its sample_tokens'
    launches on the GPU -- its kernels plus any wait for the host between them; below the
    period, the GPU idled between steps (waiting for the host's next launch)."""
    weight_bytes, kv_per_token = model_bytes(cfg, kv_bytes)
    table = {name: [0, 0.0, 0, 0, 0.0] for name, _ in PHASES}
    for seconds, rows, tokens, context, gpu in periods:
        if tokens > rows:
            name = PHASES[0][0]
        else:
            name = next((n for n, top in PHASES[1:-1] if rows <= top), PHASES[-1][0])
        entry = table[name]
        entry[0], entry[1], entry[2], entry[3], entry[4] = (
            entry[0] + 1, entry[1] + seconds, entry[2] + rows, entry[3] + context, entry[4] + gpu
        )
    print(f"time between step returns by the completed step's shape ({len(periods)} steps, "
          f"{sum(p[0] for p in periods):.2f} s of the {wall:.2f} s wall; decode: weights + KV context read once, over the time):")
    print(f"  {'step':<18} {'steps':>6} {'seconds':>8} {'ms/step':>8} {'GPU ms/step':>11} {'rows/step':>9} {'context/row':>11} "
          f"{'GB/step':>8} {'TB/s':>6}")  # fmt: skip
    for name, (n, seconds, rows, context, gpu) in table.items():
        if not n:
            continue
        line = f"  {name:<18} {n:>6} {seconds:>8.3f} {1e3 * seconds / n:>8.3f} {1e3 * gpu / n:>11.3f} {rows / n:>9.1f}"
        if name != PHASES[0][0]:
            moved = n * weight_bytes + context * kv_per_token
            line += f" {context / rows:>11.0f} {moved / n / 1e9:>8.2f} {moved / seconds / 1e12:>6.2f}"
        print(line)


def hf_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{k: v for k, v in qwen3_06b_config().items() if k not in ("architectures", "torch_dtype")})
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def run_hf_generate(model, prompts, out_lens, batch: int) -> dict:
    order = np.argsort([len(p) for p in prompts])  # similar lengths together: less padding
    t = time.perf_counter()
    for s in range(0, len(prompts), batch):
        idx = order[s : s + batch]
        group = [prompts[i] for i in idx]
        width = max(len(p) for p in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(group):  # left padding
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        n_new = max(out_lens[i] for i in idx)
        with torch.no_grad():
            model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=n_new, min_new_tokens=n_new,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    torch.cuda.synchronize()
    return dict(system=f"transformers generate (batch {batch})", wall_s=time.perf_counter() - t, out_tokens=sum(out_lens))


def run_hf_generate_batch(model, prompts, out_lens) -> dict:
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=max(out_lens), do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gc)
    manager.start()
    t = time.perf_counter()
    for i, (p, m) in enumerate(zip(prompts, out_lens)):
        manager.add_request(p, request_id=f"r{i}", max_new_tokens=m)
    got = 0
    for _ in prompts:
        result = manager.get_result(timeout=600)
        got += len(result.generated_tokens)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    manager.stop(block=True)
    return dict(system="transformers generate_batch", wall_s=wall, out_tokens=got)


def prefix_caching_ab(model_dir: str, prompts, out_lens, args) -> None:
    """Prefix caching's cost where no prompt shares a block: engines with it off and on,
    alternating so that the host's drift between runs falls on both."""
    walls = {False: [], True: []}
    for _ in range(args.prefix_caching_ab):
        for on in (False, True):
            row = run_slotrunner(model_dir, prompts, out_lens, args, prefix_caching=on)
            walls[on].append(row["wall_s"])
            print(f"  prefix caching {'on ' if on else 'off'}: {row['wall_s']:.2f} s, {row['out_tokens'] / row['wall_s']:.0f} tok/s",
                  flush=True)  # fmt: skip
    off, on = float(np.median(walls[False])), float(np.median(walls[True]))
    print(f"prefix caching on vs off, nothing shared: median {on:.2f} s vs {off:.2f} s = {100 * (on / off - 1):+.1f}% wall "
          f"({args.prefix_caching_ab} runs each)", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-pdl", action="store_true", help="plain launches (no programmatic dependent launch: triton_utils.pdl_launch)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 (float8 e4m3 KV cache)")
    p.add_argument("--tile", action="append", default=[], metavar="FIELD=VALUE",
                   help="a TileConfig field of the Triton attention (repeatable), e.g. decode_longest_first=True")
    p.add_argument("--peers", default="generate,generate_batch", help="comma list of generate, generate_batch; or none")
    p.add_argument("--hf-batch", type=int, default=256)
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--full-warm-up", action="store_true", help="warm up on the whole run, not two tokens a request")
    p.add_argument("--phases", action="store_true", help="also the run's time by step shape (prefill, decode batch sizes), with each step's GPU span")
    p.add_argument("--prefix-caching-ab", type=int, default=0, metavar="N",
                   help="N pairs of runs with prefix caching off, then on (nothing is shared: its cost alone)")
    args = p.parse_args()

    prompts, out_lens = workload(args.num_requests, args.seed, args.min_len, args.max_len)
    cfg = qwen3_06b_config()
    kv_bytes, kv_name = (1, "float8 KV cache") if args.kv_cache_dtype == "fp8" else (2, "bf16 KV cache")
    print(f"bench workload: {args.num_requests} requests, in/out uniform in [{args.min_len}, {args.max_len}], "
          f"{sum(out_lens)} output tokens; Qwen3-0.6B shape, bf16, {kv_name}, {torch.cuda.get_device_name()}; "
          f"torch {torch.__version__}")
    print(f"{'system':<36} {'seconds':>9} {'out tok/s':>10} {'slotrunner x':>13}", flush=True)
    rows = []

    def report(row: dict) -> None:  # printed as each system finishes: a slow peer cannot hide the others
        row["tok_s"] = row["out_tokens"] / row["wall_s"]
        rows.append(row)
        print(f"{row['system']:<36} {row['wall_s']:>9.2f} {row['tok_s']:>10.0f} {rows[0]['tok_s'] / row['tok_s']:>13.2f}", flush=True)

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        report(run_slotrunner(d, prompts, out_lens, args))
        if args.prefix_caching_ab:
            prefix_caching_ab(d, prompts, out_lens, args)
    ours = rows[0]
    bandwidth, bandwidth_name = hbm_bandwidth()
    roof = roofline_seconds(cfg, prompts, out_lens, ours["steps"], bandwidth, kv_bytes)
    print(f"slotrunner: {ours['steps']} steps, {1e3 * ours['wall_s'] / ours['steps']:.2f} ms/step; roofline "
          f"(weights per step + KV per token at {bandwidth_name}) {roof:.2f} s = {100 * roof / ours['wall_s']:.0f}% of wall; "
          f"engine start-up incl. graph capture {ours['startup_s']:.1f} s", flush=True)
    if args.phases:
        print_phases(ours["periods"], ours["wall_s"], cfg, kv_bytes)
    peers = [] if args.peers == "none" else args.peers.split(",")
    if peers:
        model = hf_model()
        for peer in peers:
            try:
                if peer == "generate":
                    report(run_hf_generate(model, prompts, out_lens, args.hf_batch))
                elif peer == "generate_batch":
                    report(run_hf_generate_batch(model, prompts, out_lens))
                else:
                    raise ValueError(f"unknown peer {peer!r}")
            except Exception as e:  # a peer's API change must not hide our figure
                print(f"{peer}: failed: {type(e).__name__}: {e}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
