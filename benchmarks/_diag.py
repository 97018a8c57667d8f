import time, statistics, sys, torch
sys.path.insert(0, "benchmarks")
from spec_decode import qwen3_shape_dir
from slotrunner import LLM
model = qwen3_shape_dir()
spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
llm = LLM(model, device="cuda", max_model_len=1024, max_num_seqs=32, enable_prefix_caching=False, speculative_config=spec)
cg = llm.engine.runner.cuda_graphs
for key in sorted(cg._graphs):
    if key[0] not in (1, 2, 16):
        continue
    g = cg._graphs[key]
    g.replay(); torch.cuda.synchronize()
    t_async, t_sync = [], []
    for _ in range(30):
        t0 = time.perf_counter(); g.replay(); t_async.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    for _ in range(30):
        t0 = time.perf_counter(); g.replay(); t_sync.append(time.perf_counter() - t0); torch.cuda.synchronize()
    s0 = torch.cuda.Event(enable_timing=True); s1 = torch.cuda.Event(enable_timing=True)
    s0.record(); [g.replay() for _ in range(20)]; s1.record(); torch.cuda.synchronize()
    print(f"graph {key}: replay host ms, queued {1e3*statistics.median(t_async):.3f}, idle GPU {1e3*statistics.median(t_sync):.3f}; GPU ms {s0.elapsed_time(s1)/20:.3f}")
