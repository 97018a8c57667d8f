#!/usr/bin/env bash
# The GPU checks and figures of one sitting on one H200, in one command: the GPU tests, then the
# benchmarks, each under its own time limit so that one failure or overrun does not cost the rest.
# Logs go to $OUT (default ./gpu_out): tests.log, bench.log, env.txt. The end of the output is a
# summary: each step's exit code and seconds, and each benchmark's table.
#
#   bash benchmarks/gpu_suite.sh                     # every step, in this order
#   bash benchmarks/gpu_suite.sh tests throughput    # some steps
#
# Every step together runs past ten minutes on one H200 (times seen there on 2026-12-01, model
# builds and graph captures included: tests 85 s, throughput / fp8 26 s each, scan 22, hybrid
# 70, multimodal 90, spec ~30 per case, moe-kernel 12, qwen3next 100, deepseek 50, latency 30,
# overhead 14, profile 75), so a sitting is two commands, e.g.
#   COMMIT=... bash benchmarks/gpu_suite.sh tests scan hybrid multimodal spec moe-kernel overhead
#   COMMIT=... bash benchmarks/gpu_suite.sh throughput fp8 latency qwen3next deepseek profile profile-mm prefix
#
# On a freshly started machine the first process runs ~25% slower than the next ones, whatever it
# runs (benchmarks/RESULTS.md, 2026-12-01 fourth sitting): keep `tests` (or a throwaway run) first
# before figures that are compared across processes.
#
# Steps: tests, throughput (throughput-phases: its time by step shape; eager-forward: an eager 8,192-token prefill step's host and GPU time), fp8, scan, hybrid (hybrid-fast: without the peer), multimodal
# (multimodal-profile: host and GPU profile of its runs; multimodal-intake: media read by worker
# processes while the engine steps against threads that read first, and the media read beforehand; multimodal-processes: the first of those alone; multimodal-tower: the vision tower replayed as CUDA graphs against launched eagerly, in one engine; multimodal-spy: a py-spy profile of the engine's thread, by phase; multimodal-spy-gil: the same counting only samples that hold the GIL; multimodal-workers: the multimodal engine alone with 4 and 8 intake processes; multimodal-alternate: one LLaVA engine alternating 2, 4 and 8 intake processes and the text prompts; multimodal-alternate-8: 8 against the text prompts only, 7 repeats), attention-fp8-sweep (the decode launch's tiles over a float8 cache), attention-split-sweep (each row's keys split over 1, 2, 4 programs at batch 256, both caches), attention-halves-ab (the decode launch's one product against the head dim's halves, both caches), attention-maxnreg-ab (the decode launch with its registers capped at 128 and 96 against the compiler's choice, both caches), spec (spec-long: n-gram at
# 512 tokens a request; spec-draft-other: its never-accepted draft model alone; spec-draft-phases: that one at batch 1 with drafts on every step, the engine's phases timed; spec-draft-steady: that one with the gate the untimed run trained; spec-draft-long: the never-accepted draft model at 512; spec-draft-small: a never-accepted
# draft a quarter of the target's depth), moe-kernel (moe-act-ab: the MoE activation in the first GEMM against its own launch; moe-prefill-sweep: each grouped GEMM at prefill sizes by launch shape and order; qwen3moe-full: the Qwen3-30B-A3B shape, 48 layers, slotrunner alone), qwen3next, deepseek (deepseek-full: all 27 layers, slotrunner alone, after serving the run once untimed; deepseek-hf: all 27 layers against transformers in the same process, after that untimed run; qwen3moe-hf: the Qwen3-30B-A3B shape against transformers alike; deepseek-cold: after two tokens a request, with Triton's kernel cache empty; deepseek-router-ab: that with the router's reference launches against its one launch, twice; profile-deepseek: its decode step's kernels; mla-splits: the MLA decode kernel by split count; tests-mla: the MLA and float8-cache GPU tests alone; mla-fp8: the MLA decode kernel over a bf16 and a float8 cache by tile, warps, stages; deepseek-fp8: all 27 layers with the float8 latent cache against bf16, alternating, twice), latency, overhead, profile, profile-mm,
# prefix, pdl-ab (programmatic dependent launch against plain launches: batch-1 latency, the bench workload), skinny (the skinny GEMM kernel against cuBLAS, with a tile sweep), profile-b1 (kernels
# of a batch-1 decode step), prefill-sweep (the prefill launch's query block, key tile, warps and stages over 8,192
# query tokens, both caches), tests-longest-first (the GPU attention cases and the engine's bitwise test of the longest-first grid), tests-attention (the attention tests, graphs == eager and the input kernels alone), rotary-decode (the rotary launch at 256 and 64 tokens), rotary-sizes (at 1,024, 2,048 and 4,096), row-order-ab (the decode launch in batch order against longest first and
# shortest first, both caches), longest-first-ab (that, then the float8 bench workload with the decode launch's
# rows longest first against batch order, alternating, twice), longest-first-bench (its bench workload runs alone), prefetch-ab (the decode launch with each tile's block ids loaded a tile early, at 2 and 3 stages, then the float8 bench workload with it at 3 stages against the default, alternating, twice), longest-first-splits (that with every decode-only
# launch's keys split in two against the split rule, by step shape), profile-prefill (the bench model's prefill of 32 x 512 tokens, kernels by GPU time), rotary-ab (the rotary
# launch with its K/V write at 8,192 tokens by heads a program and warps), spec-ngram (the n-gram case of spec alone), spec-steady (n-gram on the prompts whose outputs switch token least: nearly every draft accepted), spec-phases-steady (its batch-1 case with the phases timed), spec-phases (its batch-1 and batch-16 cases with the engine's phases timed per step), overhead-spec (host time of a step
# with n-gram drafts, all accepted, and its profile), overhead-long (host time at 1 and 256 rows with 1,000-token prompts), overhead-lines (the engine's loop at 1 and 256 rows, each line of its host functions timed), overhead-pipelined (that in the engine's own loop, async: a step's period with its wait on the device apart, then overhead-long again), overhead-probe (that with the garbage collector off and on, and where inference_mode's entry spends its time under cProfile), overhead-lockstep (overhead with equal prompts: every row crosses a block boundary in the same step, as the figures up to 2026-12-06), launch-ab (that host time with cached Triton launches against
# Triton's dispatch, three alternating pairs), small-batch (the bench workload's shape at max_num_seqs=6, both caches),
# split-graphs (the decode attention by split count at 1-32 rows, from CUDA graphs), suite (the whole CPU
# test suite, in parallel, under this machine's packages).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests scan hybrid multimodal spec moe-kernel overhead throughput fp8 latency qwen3next deepseek profile profile-mm prefix)

GPU_TESTS=(
  tests/conformance/test_decoders_gpu.py
  tests/conformance/test_multimodal.py::test_gpu_graphs_equal_eager
  tests/conformance/test_multimodal.py::test_gpu_decode_step_does_not_sync
  tests/model_states/test_multimodal_model_state.py::test_gpu_tower_inputs_do_not_wait_for_queued_kernels
  tests/model_states/test_tower_graphs.py
  tests/core_runner/runner/test_cuda_graphs.py
  tests/core_runner/runner/test_block_table.py
  tests/core_runner/runner/test_features_gpu.py
  tests/core_runner/runner/test_input_kernels.py
  tests/core_runner/runner/test_sampled_token_kernels.py
  tests/core_runner/attention
  tests/core_runner/sample/test_gumbel_kernel.py
  tests/core_runner/spec_decode
  tests/models/layers
  tests/models/test_deepseek.py::test_cuda_graphs_equal_eager
)

# The n-gram case where nearly every draft is accepted (steps spec and spec-steady).
SPEC_STEADY=(python3 benchmarks/spec_decode.py --qwen3-shape --device cuda --max-tokens 128 --steady-prompts 8 --repeats 3)

summary=()
run_step() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*" >>"$out/bench.log"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$out/bench.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc, $((SECONDS - t0)) s" >>"$out/bench.log"
  summary+=("$name: rc=$rc, $((SECONDS - t0)) s")
}
run_tests() {  # name, seconds, command...: a pytest run into $out/<name>.log, its last line in the summary
  local name=$1 limit=$2
  shift 2
  local log="$out/${name//-/_}.log" t0=$SECONDS
  timeout "$limit" "$@" >"$log" 2>&1
  summary+=("$name: rc=$?, $((SECONDS - t0)) s: $(tail -n 1 "$log")")
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import sys, torch, triton, transformers, tokenizers; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__, "tokenizers", tokenizers.__version__)'
  lscpu | grep -E '^(Model name|CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\))'
  # The commit measured: pass COMMIT=... where the copy being run has no current git history.
  echo "commit ${COMMIT:-$(git log -1 --format='%H %s' 2>/dev/null)}"
} >"$out/env.txt" 2>&1

for s in "${steps[@]}"; do
  case $s in
    tests)  # the slowest 30 listed: what to trim when device time is short
      run_tests tests 420 python3 -m pytest -n 6 --timeout 300 --durations 30 -p no:cacheprovider "${GPU_TESTS[@]}" ;;
    suite) run_tests suite 400 env OMP_NUM_THREADS=1 python3 -m pytest -n 14 --timeout 300 -p no:cacheprovider tests ;;
    throughput) run_step throughput 150 python3 benchmarks/throughput.py --peers none ;;
    throughput-phases) run_step throughput-phases 150 python3 benchmarks/throughput.py --peers none --phases ;;
    eager-forward) run_step eager-forward 120 python3 benchmarks/eager_forward.py --profile 30 ;;
    fp8) run_step fp8 150 python3 benchmarks/throughput.py --peers none --kv-cache-dtype fp8 ;;
    scan) run_step scan 90 python3 benchmarks/mamba_scan_kernel.py ;;
    moe-kernel) run_step moe-kernel 90 python3 benchmarks/moe_kernel.py ;;
    moe-prefill-sweep)  # each grouped GEMM alone at prefill sizes by launch shape and launch order, both shapes
      for shape in deepseek-v2-lite qwen3-30b-a3b; do
        run_step "moe-prefill-sweep-$shape" 300 python3 benchmarks/moe_kernel.py --shape $shape --tokens 8192,2048 --prefill-sweep
      done ;;
    moe-act-ab)  # the MoE activation in the first GEMM against its own launch, both shapes, alternating
      for shape in deepseek-v2-lite qwen3-30b-a3b; do
        run_step "moe-act-launch-$shape" 60 python3 benchmarks/moe_kernel.py --shape $shape --tokens 1,64,256,4096,8192 --act-launch
        run_step "moe-act-fused-$shape" 60 python3 benchmarks/moe_kernel.py --shape $shape --tokens 1,64,256,4096,8192
      done ;;
    hybrid-fast) run_step hybrid 120 python3 benchmarks/mamba_throughput.py --device cuda --skip-hf ;;
    hybrid)
      run_step hybrid 180 python3 benchmarks/mamba_throughput.py --device cuda
      run_step hybrid-llama-yardstick 90 python3 benchmarks/mamba_throughput.py --device cuda --shape llama --skip-hf ;;
    multimodal) run_step multimodal 300 python3 benchmarks/multimodal_throughput.py --device cuda --full-warm-up ;;
    spec)
      run_step spec-ngram 200 python3 benchmarks/spec_decode.py --qwen3-shape --device cuda --max-tokens 128 --repeats 3
      run_step spec-ngram-steady 240 "${SPEC_STEADY[@]}"
      run_step spec-draft-same 150 python3 benchmarks/spec_decode.py --qwen3-shape --device cuda --max-tokens 128 --draft-model same
      run_step spec-draft-other 150 python3 benchmarks/spec_decode.py --qwen3-shape --device cuda --max-tokens 128 --draft-model other ;;
    qwen3next) run_step qwen3next 160 python3 benchmarks/mamba_throughput.py --device cuda --shape qwen3-next --layers 4 ;;
    deepseek) run_step deepseek 160 python3 benchmarks/moe_throughput.py --shape deepseek-v2-lite --num-layers 4 ;;
    mla-splits)  # the MLA decode kernel by split count: 64 rows as the DeepSeek workload decodes, and one row
      run_step mla-splits-64 120 python3 benchmarks/mla_decode.py --rows 64 --seq-len 640 --kernel-splits 1,2,4,8,0 --warps 4,8 --stages 2,3 --repeats 200
      run_step mla-splits-1 60 python3 benchmarks/mla_decode.py --rows 1 --seq-len 2048 --kernel-splits 1,4,16,0 --warps 4,8 --repeats 200 ;;
    deepseek-hf)  # all 27 layers against transformers `generate` in the same process (#18's ratio), after a full untimed run
      run_step deepseek-hf 330 python3 benchmarks/moe_throughput.py --shape deepseek-v2-lite --full-warm-up ;;
    qwen3moe-hf)  # the Qwen3-30B-A3B shape, 48 layers, against transformers `generate` in the same process (#18's other ratio)
      run_step qwen3moe-hf 500 python3 benchmarks/moe_throughput.py --full-warm-up ;;
    deepseek-full) run_step deepseek-full 200 python3 benchmarks/moe_throughput.py --shape deepseek-v2-lite --peers none --full-warm-up ;;
    deepseek-cold)  # all 27 layers after the two-token warm-up, Triton's kernel cache empty at start: what the run compiles
      TRITON_CACHE_DIR=$(mktemp -d) run_step deepseek-cold 200 python3 benchmarks/moe_throughput.py --shape deepseek-v2-lite --peers none ;;
    qwen3moe-full) run_step qwen3moe-full 240 python3 benchmarks/moe_throughput.py --peers none --full-warm-up ;;  # 48 layers, ~61 GB
    deepseek-router-ab)  # the one-launch router against the reference's launches, alternating processes
      for i in 1 2; do
        run_step "deepseek-full-reference-router-$i" 150 python3 benchmarks/moe_throughput.py --shape deepseek-v2-lite --peers none --router reference
        run_step "deepseek-full-$i" 150 python3 benchmarks/moe_throughput.py --shape deepseek-v2-lite --peers none
      done ;;
    tests-longest-first)  # the decode launch's longest-first grid alone: the attention launches at real sizes, the engine bitwise
      run_tests tests-longest-first 240 python3 -m pytest -n 6 --timeout 200 -p no:cacheprovider \
        tests/core_runner/attention/test_triton_attn_gpu.py tests/core_runner/runner/test_cuda_graphs.py -k "longest_first or gpu_" ;;
    tests-attention)  # the attention launches compiled, graphs == eager, the step's input kernels (a grid or staging change)
      run_tests tests-attention 300 python3 -m pytest -n 6 --timeout 240 -p no:cacheprovider tests/core_runner/attention \
        tests/core_runner/runner/test_cuda_graphs.py tests/core_runner/runner/test_input_kernels.py ;;
    tests-mla)  # the MLA kernels (a float8 cache too) compiled, DeepSeek's bf16 conformance, graphs == eager, float8 engines
      run_tests tests-mla 300 python3 -m pytest -n 4 --timeout 240 -p no:cacheprovider tests/models/layers/test_mla_decode.py \
        tests/models/layers/test_mla_prefill.py tests/core_runner/attention/test_fp8_kv_cache.py \
        "tests/conformance/test_decoders_gpu.py::test_bf16_matches_transformers_bf16[DeepseekV2ForCausalLM]" \
        "tests/conformance/test_decoders_gpu.py::test_bf16_matches_transformers_bf16[DeepseekV3ForCausalLM]" \
        tests/models/test_deepseek.py::test_cuda_graphs_equal_eager ;;
    mla-fp8)  # the MLA decode kernel over a bf16 and a float8 cache, by key tile, warps and stages
      run_step mla-fp8-64 150 python3 benchmarks/mla_decode.py --rows 64 --seq-len 640 --kernel-splits 0 --cache-dtype bf16,fp8 --tile-n 16,32 --warps 4,8 --stages 2,3 --repeats 200
      run_step mla-fp8-256 120 python3 benchmarks/mla_decode.py --rows 256 --seq-len 2048 --kernel-splits 0 --cache-dtype bf16,fp8 --tile-n 16,32 --warps 4,8 --repeats 100 ;;
    deepseek-fp8)  # all 27 layers, slotrunner alone, the float8 latent cache against the bf16 one, alternating processes
      for i in 1 2; do
        run_step "deepseek-full-fp8-$i" 150 python3 benchmarks/moe_throughput.py --shape deepseek-v2-lite --peers none --full-warm-up --kv-cache-dtype fp8
        run_step "deepseek-full-bf16-$i" 150 python3 benchmarks/moe_throughput.py --shape deepseek-v2-lite --peers none --full-warm-up
      done ;;
    profile-deepseek) run_step profile-deepseek 150 python3 benchmarks/profile_decode.py --shape deepseek-v2-lite --layers 27 --batch 64 --input-len 512 --rows 40 --prefill-kernels ;;
    latency) run_step latency 120 python3 benchmarks/decode_latency.py --output-len 256 --repeats 2 ;;
    pdl-ab)  # programmatic dependent launch against plain launches: batch-1 latency alternating in one process, then the bench workload (float8) in alternating processes (PDL_AB_PAIRS pairs, default 2)
      run_step pdl-ab-latency 240 python3 benchmarks/decode_latency.py --output-len 256 --repeats 2 --modes graphs,no-pdl,own-kv-write --rounds 2
      for i in $(seq "${PDL_AB_PAIRS:-2}"); do
        run_step "pdl-ab-fp8-$i" 120 python3 benchmarks/throughput.py --peers none --kv-cache-dtype fp8
        run_step "pdl-ab-fp8-no-pdl-$i" 120 python3 benchmarks/throughput.py --peers none --kv-cache-dtype fp8 --no-pdl
      done ;;
    small-batch)  # a decode batch of at most 6 rows (a size between the default graph sizes), both caches
      run_step small-batch 120 python3 benchmarks/throughput.py --peers none --num-requests 32 --max-len 512 --max-num-seqs 6
      run_step small-batch-fp8 120 python3 benchmarks/throughput.py --peers none --num-requests 32 --max-len 512 --max-num-seqs 6 --kv-cache-dtype fp8 ;;
    split-graphs)  # the decode launch by split count at small batches, timed from CUDA graphs
      run_step split-graphs 150 python3 benchmarks/attention_kernel.py --graph-split-rows 1,2,4,6,8,16,32 --min-len 1000 --max-len 1700 ;;
    overhead) run_step overhead 120 python3 benchmarks/step_overhead.py --device cuda --batch-sizes 1,8,64,256,512 ;;
    overhead-long) run_step overhead-long 180 python3 benchmarks/step_overhead.py --device cuda --batch-sizes 1,256 --prompt-len 1000 ;;
    overhead-lines)  # each line of a decode step's host functions timed (line_profiler: a wheel carried in dist/ is installed first)
        ls dist/line_profiler-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps dist/line_profiler-*.whl
        run_step overhead-lines 180 python3 benchmarks/step_overhead.py --device cuda --batch-sizes 1,256 --prompt-len 1000 --pipelined --line-profile ;;
    overhead-pipelined)  # that host time in the engine's own loop (a step's period, its wait on the device apart), then in parts again
        run_step overhead-pipelined 180 python3 benchmarks/step_overhead.py --device cuda --batch-sizes 1,64,256 --prompt-len 1000 --pipelined
        run_step overhead-long 180 python3 benchmarks/step_overhead.py --device cuda --batch-sizes 1,64,256 --prompt-len 1000 ;;
    overhead-probe)  # that host time with the garbage collector off and on, and a cumulative profile with inference_mode's entry broken down
      run_step overhead-probe 180 python3 benchmarks/step_overhead.py --device cuda --batch-sizes 1,256 --prompt-len 1000 --gc-ab \
        --profile 30 --profile-sort cumulative --profile-callees 'grad_mode.*__enter__' ;;
    overhead-lockstep) run_step overhead-lockstep 120 python3 benchmarks/step_overhead.py --device cuda --batch-sizes 1,8,64,256,512 --lockstep ;;
    overhead-spec)
      run_step overhead-spec 120 python3 benchmarks/step_overhead.py --device cuda --batch-sizes 1,16 --ngram 4 --count-ops 5
      run_step overhead-spec-profile 120 python3 benchmarks/step_overhead.py --device cuda --batch-sizes 1 --ngram 4 --profile 45 ;;
    profile)
      run_step profile-bamba 90 python3 benchmarks/profile_decode.py --shape bamba
      run_step profile-llama 90 python3 benchmarks/profile_decode.py --shape llama ;;
    profile-mm)
      run_step profile-llava 120 python3 benchmarks/profile_decode.py --shape llava --batch 128 --input-len 627 --host-profile "$out/llava"
      run_step profile-llava-lm 120 python3 benchmarks/profile_decode.py --shape llava-lm --batch 128 --input-len 627 --host-profile "$out/llava-lm" ;;
    prefix) run_step prefix 200 python3 benchmarks/prefix_caching.py --device cuda ;;
    multimodal-profile) run_step multimodal-profile 240 python3 benchmarks/multimodal_throughput.py --device cuda --skip-hf --profile ;;
    multimodal-tower) run_step multimodal-tower 300 python3 benchmarks/multimodal_throughput.py --device cuda --full-warm-up --skip-hf --pre-read --eager-tower-too --repeats 3 ;;
    multimodal-spy)  # needs py-spy on PATH: the engine thread's samples by phase (benchmarks/spy_phases.py)
      run_step multimodal-spy 180 py-spy record --nonblocking --idle --threads -r 200 -f raw -o "$out/mm_spy.txt" -- \
        python3 benchmarks/multimodal_throughput.py --device cuda --skip-hf --multimodal-only --pre-read --full-warm-up
      run_step multimodal-spy-phases 30 python3 benchmarks/spy_phases.py "$out/mm_spy.txt" ;;
    multimodal-spy-gil)  # the same, sampling the engine's thread only while it holds the GIL
      run_step multimodal-spy-gil 180 py-spy record --nonblocking --gil --threads -r 200 -f raw -o "$out/mm_spy_gil.txt" -- \
        python3 benchmarks/multimodal_throughput.py --device cuda --skip-hf --multimodal-only --pre-read --full-warm-up
      run_step multimodal-spy-gil-phases 30 python3 benchmarks/spy_phases.py "$out/mm_spy_gil.txt" ;;
    attention-fp8-sweep) run_step attention-fp8-sweep 150 python3 benchmarks/attention_kernel.py --fp8-sweep ;;
    attention-split-sweep) run_step attention-split-sweep 150 python3 benchmarks/attention_kernel.py --split-sweep ;;
    attention-halves-ab) run_step attention-halves-ab 90 python3 benchmarks/attention_kernel.py --ab decode_head_halves ;;
    attention-maxnreg-ab) run_step attention-maxnreg-ab 90 python3 benchmarks/attention_kernel.py --ab decode_maxnreg ;;
    multimodal-alternate-8)  # one LLaVA engine: the default 8 intake processes against the text prompts (and the LM as a decoder), 7 repeats
      run_step multimodal-alternate-8 300 python3 benchmarks/multimodal_throughput.py --device cuda --full-warm-up --skip-hf --alternate 8 --repeats 7 ;;
    multimodal-alternate)  # one LLaVA engine: image prompts read by 2, 4 and 8 intake processes, and text prompts, alternating
      run_step multimodal-alternate 300 python3 benchmarks/multimodal_throughput.py --device cuda --full-warm-up --skip-hf --alternate 2,4,8 --repeats 5 ;;
    multimodal-workers)  # the multimodal engine alone with 4 and 8 intake processes
      for w in 4 8; do
        run_step multimodal-workers-$w 200 python3 benchmarks/multimodal_throughput.py --device cuda --full-warm-up --skip-hf --pre-read --multimodal-only --intake-workers $w --repeats 3
      done ;;
    multimodal-processes) run_step multimodal-processes 240 python3 benchmarks/multimodal_throughput.py --device cuda --full-warm-up --skip-hf --pre-read --intake processes --repeats 3 ;;
    multimodal-intake)
      run_step multimodal-processes 240 python3 benchmarks/multimodal_throughput.py --device cuda --full-warm-up --skip-hf --pre-read --intake processes --repeats 3
      run_step multimodal-threads 240 python3 benchmarks/multimodal_throughput.py --device cuda --full-warm-up --skip-hf --pre-read --intake threads --repeats 3 ;;
    skinny) run_step skinny 240 python3 benchmarks/skinny_gemm.py --device cuda --sweep ;;
    profile-b1) run_step profile-b1 90 python3 benchmarks/profile_decode.py --shape qwen3-0.6b --batch 1 --input-len 256 --rows 25 ;;
    prefill-sweep) run_step prefill-sweep 150 python3 benchmarks/attention_kernel.py --prefill-sweep ;;
    row-order-ab) run_step row-order-ab 90 python3 benchmarks/attention_kernel.py --row-order-ab ;;
    longest-first-ab)  # the decode launch alone by row order (256 and 96 rows), then the float8 bench workload with its rows longest first against batch order, alternating, twice
      run_step row-order-ab 90 python3 benchmarks/attention_kernel.py --row-order-ab
      run_step row-order-ab-96 90 python3 benchmarks/attention_kernel.py --row-order-ab --batch 96
      ;&
    longest-first-bench)  # the float8 bench workload alone, rows longest first against batch order, alternating, twice
      for i in 1 2; do
        run_step "fp8-longest-first-$i" 150 python3 benchmarks/throughput.py --peers none --kv-cache-dtype fp8 --tile decode_longest_first=True
        run_step "fp8-batch-order-$i" 150 python3 benchmarks/throughput.py --peers none --kv-cache-dtype fp8 --tile decode_longest_first=False
      done ;;
    prefetch-ab)  # the decode launch with block ids a tile early at 2 and 3 stages (256 and 96 rows), then the float8 bench with it on and off, alternating, twice
      run_step prefetch-ab-256 120 python3 benchmarks/attention_kernel.py --ab decode_prefetch_blocks
      run_step prefetch-ab-96 120 python3 benchmarks/attention_kernel.py --ab decode_prefetch_blocks --batch 96
      for i in 1 2; do
        run_step "fp8-prefetch-3-stages-$i" 150 python3 benchmarks/throughput.py --peers none --kv-cache-dtype fp8 --tile decode_prefetch_blocks=True --tile decode_num_stages=3
        run_step "fp8-default-$i" 150 python3 benchmarks/throughput.py --peers none --kv-cache-dtype fp8
      done ;;
    longest-first-splits)  # the float8 bench workload, rows longest first, with every decode-only launch split in two against the split rule, alternating, twice
      for i in 1 2; do
        run_step "fp8-longest-first-split-2-$i" 150 python3 benchmarks/throughput.py --peers none --kv-cache-dtype fp8 --phases --tile decode_longest_first=True --tile decode_splits=2
        run_step "fp8-longest-first-$i" 150 python3 benchmarks/throughput.py --peers none --kv-cache-dtype fp8 --phases --tile decode_longest_first=True
      done ;;
    rotary-ab) run_step rotary-ab 90 python3 benchmarks/rotary_kernel.py ;;
    rotary-decode)  # the rotary launch at decode sizes (256 and 64 rows), where 16 heads a program halves the programs
      run_step rotary-256 60 python3 benchmarks/rotary_kernel.py --tokens 256 --graph 100 --iters 20
      run_step rotary-64 60 python3 benchmarks/rotary_kernel.py --tokens 64 --graph 100 --iters 20 ;;
    rotary-sizes)  # the rotary launch between decode and prefill sizes: where 16 heads a program starts to pay
      for tokens in 1024 2048 4096; do
        run_step "rotary-$tokens" 60 python3 benchmarks/rotary_kernel.py --tokens $tokens --graph 20 --iters 10
      done ;;
    profile-prefill) run_step profile-prefill 120 python3 benchmarks/profile_decode.py --shape qwen3-0.6b --layers 28 --batch 32 --input-len 512 --prefill-kernels --rows 12 --steps 10 ;;
    spec-phases-steady) run_step spec-phases-steady 240 python3 benchmarks/spec_decode.py --qwen3-shape --device cuda --max-tokens 128 --batch-sizes 1 --steady-prompts 8 --phases ;;
    spec-steady) run_step spec-ngram-steady 240 "${SPEC_STEADY[@]}" ;;
    spec-ngram) run_step spec-ngram 200 python3 benchmarks/spec_decode.py --qwen3-shape --device cuda --max-tokens 128 --repeats 3 ;;
    spec-phases) run_step spec-phases 240 python3 benchmarks/spec_decode.py --qwen3-shape --device cuda --max-tokens 128 --batch-sizes 1,16 --phases ;;
    launch-ab)  # cached Triton launches against Triton's dispatch, alternating processes (the host's speed drifts)
      for i in 1 2 3; do
        run_step "overhead-ngram-cached-$i" 60 python3 benchmarks/step_overhead.py --device cuda --batch-sizes 1,16,256 --ngram 4 --steps 60
        run_step "overhead-ngram-dispatch-$i" 60 python3 benchmarks/step_overhead.py --device cuda --batch-sizes 1,16,256 --ngram 4 --steps 60 --triton-dispatch
      done ;;
    spec-draft-other) run_step spec-draft-other 200 python3 benchmarks/spec_decode.py --qwen3-shape --device cuda --max-tokens 128 --draft-model other --repeats 3 ;;
    spec-draft-steady) run_step spec-draft-steady 200 python3 benchmarks/spec_decode.py --qwen3-shape --device cuda --max-tokens 128 --draft-model other --repeats 3 --keep-gate ;;
    spec-long) run_step spec-ngram-512 150 python3 benchmarks/spec_decode.py --qwen3-shape --device cuda --max-tokens 512 ;;
    spec-draft-long) run_step spec-draft-other-512 150 python3 benchmarks/spec_decode.py --qwen3-shape --device cuda --max-tokens 512 --draft-model other ;;
    spec-draft-phases) run_step spec-draft-phases 240 python3 benchmarks/spec_decode.py --qwen3-shape --device cuda --max-tokens 128 --batch-sizes 1 --draft-model other --always-draft --phases ;;
    spec-draft-small)
      run_step spec-draft-other-7-layers 150 python3 benchmarks/spec_decode.py --qwen3-shape --device cuda --max-tokens 128 --draft-model other --draft-layers 7
      run_step spec-draft-other-7-layers-512 150 python3 benchmarks/spec_decode.py --qwen3-shape --device cuda --max-tokens 512 --draft-model other --draft-layers 7 --batch-sizes 1 ;;
    *) summary+=("$s: unknown step") ;;
  esac
done

echo "--- tables"
grep -v -E '^(\[|WARNING|INFO|  warnings|  /|$)' "$out/bench.log" 2>/dev/null | grep -E '^(===|[A-Za-z0-9 ].*[0-9])' | tail -n 120
echo "--- tests"
grep -E '^(FAILED|ERROR)' "$out/tests.log" 2>/dev/null | head -40
echo "--- summary"
printf '%s\n' "${summary[@]}"
