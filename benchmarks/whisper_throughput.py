"""Whisper greedy decode throughput on the GPU: a batch of audio clips, slotrunner vs transformers.

A whisper-small-shaped model (12 + 12 layers, d_model 768, 80 mel bins, 30 s windows) with
random bf16 weights; `--num-clips` random clips of 5-30 s; each request decodes `--max-tokens`
tokens greedily with EOS ignored. slotrunner runs the encoder eagerly when a request is admitted
and the decoder steps through CUDA graphs (or eagerly with --enforce-eager); transformers runs
`generate` on the whole batch. Output tokens / wall seconds, encoder included.

    python benchmarks/whisper_throughput.py --num-clips 64 --max-tokens 128

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time

import numpy as np
import torch


def whisper_small_config():
    from transformers import WhisperConfig

    return WhisperConfig(
        vocab_size=51865, num_mel_bins=80, d_model=768, encoder_layers=12, decoder_layers=12,
        encoder_attention_heads=12, decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072,
        max_source_positions=1500, max_target_positions=448, pad_token_id=50257, bos_token_id=50257,
        eos_token_id=50257, decoder_start_token_id=50258, begin_suppress_tokens=None, suppress_tokens=None,
        architectures=["WhisperForConditionalGeneration"],
    )


def run_slotrunner(d: str, clips, args, enforce_eager: bool) -> tuple[float, int]:
    from slotrunner import LLM, SamplingParams

    llm = LLM(d, device="cuda", dtype="bfloat16", max_model_len=args.max_tokens + 8, max_num_seqs=args.num_clips,
              enforce_eager=enforce_eager)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [{"multi_modal_data": {"audio": (c, 16000)}} for c in clips]
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    del llm
    gc.collect()  # the engine's reference cycles hold its GPU memory until collected
    torch.cuda.empty_cache()
    return wall, sum(len(o.outputs[0].token_ids) for o in outs)


def run_hf(hf, extractor, clips, args) -> tuple[float, int]:
    feats = extractor([c for c in clips], sampling_rate=16000, return_tensors="pt").input_features
    feats = feats.to("cuda", torch.bfloat16)
    kwargs = dict(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False)
    with torch.no_grad():
        torch.cuda.synchronize()
        t = time.perf_counter()
        start = torch.full((len(clips), 1), hf.config.decoder_start_token_id, device="cuda")
        out = hf.generate(input_features=feats, decoder_input_ids=start, **kwargs)
        torch.cuda.synchronize()
    return time.perf_counter() - t, (out.shape[1] - 1) * len(clips)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-clips", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args()
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    rng = np.random.default_rng(0)
    clips = [(rng.standard_normal(int(rng.uniform(5, 30) * 16000)) * 0.1).astype(np.float32) for _ in range(args.num_clips)]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        with torch.device("cuda"):
            hf = WhisperForConditionalGeneration(whisper_small_config()).to(torch.bfloat16).eval()
        hf.save_pretrained(d)
        extractor = WhisperFeatureExtractor(feature_size=80)
        extractor.save_pretrained(d)
        for eager in (False, True):
            wall, n = run_slotrunner(d, clips, args, eager)
            rows.append(("slotrunner" + (" (eager)" if eager else " (CUDA graphs)"), wall, n))
        if not args.skip_hf:
            try:
                wall, n = run_hf(hf, extractor, clips, args)
                rows.append(("transformers generate", wall, n))
            except Exception as e:  # Whisper's generate has many modes; keep our figure regardless
                print(f"transformers generate failed: {type(e).__name__}: {e}")
    print(f"Whisper-small shape, random bf16 weights, {torch.cuda.get_device_name()}; {args.num_clips} clips of 5-30 s, "
          f"{args.max_tokens} greedy tokens each, EOS ignored; wall includes the encoder")
    print(f"{'system':<28} {'seconds':>8} {'out tok/s':>10} {'graphs x':>9}")
    for name, wall, n in rows:
        print(f"{name:<28} {wall:>8.2f} {n / wall:>10.0f} {(rows[0][2] / rows[0][1]) / (n / wall):>9.2f}")


if __name__ == "__main__":
    main()
