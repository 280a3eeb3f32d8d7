#!/usr/bin/env bash
# GPU validation and measurements, run on the device machine from the project root:
#   source .device/env.sh && BUDGET_S=570 bash benchmark/gpu/validate.sh STAGE [STAGE...]
# Logs go to $OUT (or ./gpu-logs). Each step has its own time limit, cut to what is left of
# BUDGET_S (seconds for the whole command; a step with under 20 s left is skipped), and
# failures do not stop the steps and stages that follow.
set -u
out="${OUT:-gpu-logs}"; mkdir -p "$out"
budget="${BUDGET_S:-100000}"
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local left=$((budget - SECONDS))
  if ((left < 20)); then echo "=== $name: skipped, ${left} s left" | tee -a "$out/summary.log"; return; fi
  ((secs > left)) && secs=$left
  echo "=== $name (limit ${secs} s): $*" | tee -a "$out/summary.log"
  local t0=$SECONDS
  timeout "$secs" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$out/summary.log"
  grep -E '^\{|passed|failed|error|identical|matching|Error' "$out/$name.log" | tail -40 | tee -a "$out/summary.log"
}
smollm2="${SMOLLM2_GGUF:-/tmp/smollm2.gguf}"
nextn_3_1_4="--speculative-algorithm NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
nextn_1_1_2="--speculative-algorithm NEXTN --speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 2"
# The dense EAGLE 3/1/4 cycle's flags: a draft head over a 32k-token map (token_map_32k writes it).
eagle_3_1_4="${nextn_3_1_4/NEXTN/EAGLE} --speculative-token-map /tmp/map32k.pt"
token_map_32k() { python3 -c "import torch; torch.save(torch.arange(32768), '/tmp/map32k.pt')"; }
models="${MODELS:-/tmp/bench_models}"
# The held-out prompts at concurrency 32: the bench flags, then `--` and every server's flags.
# 1,024 prompts: a pass of 256 lasted 1.5-2.8 s on an H100, and one stall moved it by 20%.
# --enable-piecewise-cuda-graph: engines before prefill graphs were the default need it.
heldout_c32=(--dataset-name file --dataset-path "$models/heldout_prompts.jsonl" --num-prompts 1024 --random-output-len 256
  --max-concurrency 32 -- --cuda-graph-max-bs 32 --enable-piecewise-cuda-graph)
# A trained small DeepSeek travels as parts of one tar (deepseek-v3-mtp/ and heldout_prompts.jsonl),
# each under the 16 MB a file that $OUT sends back: stage pack-deepseek writes them to $OUT/model,
# MODEL_PARTS=DIR (those parts, carried to a later call) unpacks them instead of training.
trained_deepseek() {  # trained_deepseek MINUTES: train the small DeepSeek into $models unless it is there ($MINUTES wins)
  if [ ! -d "$models/deepseek-v3-mtp" ] && [ -n "${MODEL_PARTS:-}" ]; then
    mkdir -p "$models" && cat "$MODEL_PARTS"/part* | tar -x -C "$models"
  fi
  [ -d "$models/deepseek-v3-mtp" ] || step train_deepseek 200 python3 -m sglang.tools.train_tiny_models --out "$models" \
    --device cuda --minutes "${MINUTES:-$1}" --models deepseek
}
dummy_dir() {  # dummy_dir CONFIG: a directory with CONFIG and a tokenizer, for --load-format dummy
  python3 -c "import sys; sys.path.insert(0, 'benchmark'); from bench_decode import dummy_model_dir; print(dummy_model_dir(sys.argv[1]))" "$1"
}
[ $# -gt 0 ] || set -- usage
for stage in "$@"; do
case "$stage" in
  kernels)
    # No -x: one failure must not hide the other kernels' results.
    step kernel_tests 300 python3 -m pytest -q test/test_triton_kernels.py test/test_attention_backends.py \
      test/test_gemv.py test/test_fused_ops.py test/test_deepseek_kernels.py test/test_sampler.py test/test_cuda_graph_keys.py \
      test/test_cuda_graph_replay.py test/test_cuda_graph_spec.py
    step bench_attention 150 python3 benchmark/kernels/bench_attention.py
    step smollm2_agreement 150 python3 benchmark/accuracy/greedy_agreement.py --model-path "$smollm2" \
      --out "$out/smollm2_gpu_bf16.json" --compare benchmark/accuracy/smollm2_cpu_f32.json -- --disable-cuda-graph
    step smollm2_decode 150 python3 benchmark/bench_decode.py --model-path "$smollm2" --batch-sizes 1 32 -- --disable-cuda-graph
    ;;
  pack-deepseek)  # the small DeepSeek (trained for $MINUTES, default 2) as parts under $OUT/model (for MODEL_PARTS)
    trained_deepseek 2
    mkdir -p "$out/model" && (cd "$models" && tar -c deepseek-v3-mtp heldout_prompts.jsonl) | split -b 15000000 -d -a 1 - "$out/model/part"
    ls -l "$out/model" | tee -a "$out/summary.log"
    ;;
  kernel-tests)  # the DeepSeek, fused-op, graph and tree tests alone (the kernels stage runs more)
    step kernel_tests 150 python3 -m pytest -q test/test_deepseek_kernels.py test/test_fused_ops.py test/test_cuda_graph_keys.py \
      test/test_cuda_graph_replay.py test/test_cuda_graph_spec.py test/test_spec_tree.py
    ;;
  launch)  # host cost of eager launches, and an eager decode step of the small DeepSeek (issue 9: prefills are eager)
    step bench_launch 60 python3 benchmark/kernels/bench_launch.py
    step small_deepseek_eager 120 python3 benchmark/bench_decode.py --config benchmark/configs/deepseek-v3-small-mtp.json \
      --batch-sizes 1 --repeats 3 -- --disable-cuda-graph
    small_dir=$(dummy_dir benchmark/configs/deepseek-v3-small-mtp.json)
    step small_deepseek_prefill 90 python3 -m sglang.bench_one_batch --model-path "$small_dir" --load-format dummy \
      --batch-size 1 32 --input-len 276 --output-len 8
    ;;
  tune)  # measured kernel tables for this GPU (kernels/tuned/*.json; copies in $OUT)
    # shellcheck disable=SC2086
    step tune_gemv 240 python3 benchmark/kernels/bench_gemv.py --rows 1 4 8 32 64 --write-table --jsonl "$out/gemv.jsonl" ${GEMV_FLAGS:-}
    step tune_moe 150 python3 benchmark/kernels/bench_moe.py --budget 45 --write-table
    cp python/sglang/srt/kernels/tuned/*.json "$out/" 2>/dev/null
    ;;
  tune-ab)  # Llama-8B's plain step (batch 1, 4, 32) and dense EAGLE 3/1/4 cycle with this GPU's stored GEMV table,
    # then the table measured again for Llama and its EAGLE head (merged into the stored one; a copy in $OUT), then both again
    token_map_32k
    llama=(--config benchmark/configs/llama-3.1-8b.json --repeats 5)
    for when in stored tuned; do
      if [ "$when" = tuned ]; then
        step tune_gemv_llama 200 python3 benchmark/kernels/bench_gemv.py --models llama8b llama8b_eagle --rows 1 4 8 32 \
          --write-table --jsonl "$out/gemv_llama.jsonl"
        cp python/sglang/srt/kernels/tuned/gemv-*.json "$out/" 2>/dev/null
      fi
      step "llama8b_plain_$when" 100 python3 benchmark/bench_decode.py "${llama[@]}" --batch-sizes 1 4 32 -- --cuda-graph-max-bs 32
      # shellcheck disable=SC2086
      step "llama8b_eagle_$when" 100 python3 benchmark/bench_decode.py "${llama[@]}" --batch-sizes 1 \
        --draft-config benchmark/configs/llama-3.1-8b-eagle.json -- --cuda-graph-max-bs 8 $eagle_3_1_4
    done
    ;;
  decode)  # decode step with CUDA graphs, and Hugging Face transformers on the same machine
    step llama8b_decode 150 python3 benchmark/bench_decode.py --config benchmark/configs/llama-3.1-8b.json \
      --batch-sizes 1 32 -- --cuda-graph-max-bs 32
    step smollm2_decode 100 python3 benchmark/bench_decode.py --config benchmark/configs/smollm2-135m.json \
      --batch-sizes 1 32 -- --cuda-graph-max-bs 32
    step llama8b_hf 240 python3 benchmark/bench_hf_decode.py --config benchmark/configs/llama-3.1-8b.json --batch-sizes 1 32
    ;;
  deepseek)  # DeepSeek-V2-Lite shape: plain decode and one NEXTN 3/1/4 cycle, with CUDA graphs
    step dsv2lite_decode 120 python3 benchmark/bench_decode.py --config benchmark/configs/deepseek-v2-lite.json \
      --batch-sizes 1 32 -- --cuda-graph-max-bs 32
    # shellcheck disable=SC2086
    step dsv2lite_nextn 150 python3 benchmark/bench_decode.py --config benchmark/configs/deepseek-v2-lite.json \
      --batch-sizes 1 32 -- --cuda-graph-max-bs 32 $nextn_3_1_4
    ;;
  v2lite-step)  # V2-Lite's plain decode step alone; a repeated stage logs to dsv2lite_step_2.log, ...
    runs=$(find "$out" -maxdepth 1 -name 'dsv2lite_step*.log' | wc -l)
    name=dsv2lite_step$( ((runs)) && echo "_$((runs + 1))")
    step "$name" 120 python3 benchmark/bench_decode.py --config benchmark/configs/deepseek-v2-lite.json \
      --batch-sizes 1 32 -- --cuda-graph-max-bs 32
    grep -h "warmed up" "$out/$name.log" | tail -1 | tee -a "$out/summary.log"
    ;;
  gemv-pdl)  # V2-Lite's GEMV table measured with PDL tiles allowed (into this machine's copy of kernels/tuned/)
    step tune_gemv_v2lite 200 python3 benchmark/kernels/bench_gemv.py --models v2lite --rows 1 4 8 32 --write-table \
      --jsonl "$out/gemv_v2lite.jsonl"
    cp python/sglang/srt/kernels/tuned/gemv-*.json "$out/" 2>/dev/null
    ;;
  profile-deepseek)  # V2-Lite's batch-1 decode step: op tables and timeline summary
    step dsv2lite_profile 150 python3 benchmark/profile_engine.py --config benchmark/configs/deepseek-v2-lite.json \
      --batch-size 1 --num-steps 30 --output-dir /tmp/profile_v2lite -- --cuda-graph-max-bs 8
    ;;
  small-deepseek)  # the trained 12-layer DeepSeek's shape (random weights): plain step, NEXTN 3/1/4 and 1/1/2 cycles
    for spec in plain nextn_3_1_4 nextn_1_1_2; do
      flags=${!spec:-}  # the variable of that name (none for plain)
      # shellcheck disable=SC2086
      step "small_deepseek_$spec" 120 python3 benchmark/bench_decode.py --config benchmark/configs/deepseek-v3-small-mtp.json \
        --batch-sizes 1 32 --repeats 3 -- --cuda-graph-max-bs 32 $flags
    done
    ;;
  nextn-serving)  # the trained DeepSeek (trained here when $MODELS lacks it): prefill cost, then
    # the speculative sweep at concurrency 1 and 32 ($SWEEP_FLAGS go to every server too)
    trained_deepseek 1.8
    [ -f "$out/prefill_cost.log" ] || step prefill_cost 90 python3 -m sglang.bench_one_batch --model-path "$models/deepseek-v3-mtp" --batch-size 1 32 \
      --input-len 276 --output-len 8
    # shellcheck disable=SC2086
    step "nextn_sweep${SWEEP_LABEL:-}" 450 python3 benchmark/spec_sweep.py --model-path "$models/deepseek-v3-mtp" \
      --speculative-algorithm NEXTN --configs ${SWEEP_CONFIGS:-1,1,2 3,1,4} --baseline --concurrencies 1 32 \
      --dataset-name file --dataset-path "$models/heldout_prompts.jsonl" --num-prompts 64 --random-output-len 256 \
      -- --cuda-graph-max-bs 32 ${SWEEP_FLAGS:-}
    grep -A12 '^| steps' "$out/nextn_sweep${SWEEP_LABEL:-}.log" | tee -a "$out/summary.log"
    ;;
  serving-profile)  # the trained DeepSeek served at concurrency 32, plain and NEXTN 3/1/4, under the
    # profiler: device busy time and idle gaps per iteration while serving (issue 26)
    trained_deepseek 0.6
    for variant in plain nextn; do
      spec=""; [ "$variant" = nextn ] && spec=$nextn_3_1_4
      # shellcheck disable=SC2086
      step "serving_profile_$variant" 200 python3 benchmark/profile_serving.py --model-path "$models/deepseek-v3-mtp" \
        --delay 1.0 --num-steps 200 --output-dir "$out/serving_profile_$variant" "${heldout_c32[@]}" $spec
    done
    ;;
  serving-phases)  # the trained DeepSeek served at concurrency 32, plain and NEXTN 3/1/4, without the
    # profiler: each server's host phases per iteration (the decode log line's `host us/iter`)
    trained_deepseek 0.6
    rm -f /tmp/sglang-server-*.log
    # shellcheck disable=SC2086
    step serving_phases 300 python3 benchmark/spec_sweep.py --model-path "$models/deepseek-v3-mtp" \
      --speculative-algorithm NEXTN --configs 3,1,4 --baseline --concurrencies 32 --recorded-passes 2 \
      --dataset-name file --dataset-path "$models/heldout_prompts.jsonl" --num-prompts 256 --random-output-len 256 \
      -- --cuda-graph-max-bs 32 --enable-piecewise-cuda-graph ${SWEEP_FLAGS:-}
    grep -A4 '^| steps' "$out/serving_phases.log" | tee -a "$out/summary.log"
    for log in $(ls -tr /tmp/sglang-server-*.log); do  # the servers in launch order: plain first
      grep -E 'running-req: (3[0-2]|2[89]),.*host us/iter' "$log" | tail -4 | tee -a "$out/summary.log"
    done
    ;;
  greedy-decode)  # plain greedy decode as one program (forward + argmax in one graph): tokens with graphs equal
    # eager's, then the trained DeepSeek served at concurrency 32 against the engine whose python/ is $BEFORE_PYTHON
    step graphs_equal_eager 200 python3 benchmark/bench_cuda_graph.py --skip-timing
    trained_deepseek 0.6
    if [ -n "${BEFORE_PYTHON:-}" ]; then
      step greedy_decode_ab 400 python3 benchmark/flag_ab.py --model-path "$models/deepseek-v3-mtp" --variant before= \
        --engine "before=$BEFORE_PYTHON" --variant after= --rounds 2 "${heldout_c32[@]}"
      grep -A4 '^| variant' "$out/greedy_decode_ab.log" | tee -a "$out/summary.log"
    fi
    ;;
  spec-mixed)  # the trained DeepSeek at concurrency 32: plain, NEXTN 3/1/4, and NEXTN 3/1/4 whose cycles run
    # beside prefills (--enable-mixed-chunk)
    trained_deepseek 0.6
    step spec_mixed 500 python3 benchmark/flag_ab.py --model-path "$models/deepseek-v3-mtp" --variant plain= \
      --variant nextn="$nextn_3_1_4" --variant nextn_mixed="$nextn_3_1_4 --enable-mixed-chunk" --rounds 2 "${heldout_c32[@]}"
    grep -A5 '^| variant' "$out/spec_mixed.log" | tee -a "$out/summary.log"
    ;;
  serving-spy)  # where each server process spends its CPU at concurrency 32 (py-spy, from stage_wheels.sh):
    # the small DeepSeek's shape with random weights, plain and NEXTN 3/1/4
    dir=$(dummy_dir benchmark/configs/deepseek-v3-small-mtp.json)
    spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)  # env.sh installs the wheels into /tmp/site
    for spec in plain nextn_3_1_4; do
      flags=${!spec:-}  # the variable of that name (none for plain)
      # shellcheck disable=SC2086
      step "serving_spy_$spec" 200 python3 benchmark/spy_serving.py --py-spy "$spy" --model-path "$dir" --duration 8 --rows 30 \
        --dataset-name random --random-input-len 256 --random-output-len 256 --random-range-ratio 1 --num-prompts 768 \
        --max-concurrency 32 -- --load-format dummy --cuda-graph-max-bs 32 --enable-piecewise-cuda-graph $flags
    done
    ;;
  spec-kernels)  # the speculative cycle's Triton bookkeeping (kernels/spec_ops.py): its tests and the graph tests on
    # the GPU, the NEXTN 3/1/4 cycle on the device, then plain, NEXTN 3/1/4 and 1/1/2 served at concurrency 32; the
    # cycle and NEXTN served also by the engine whose python/ is $BEFORE_PYTHON
    step spec_kernel_tests 240 python3 -m pytest -q test/test_spec_ops.py test/test_cycle_state_ops.py test/test_cuda_graph_spec.py \
      test/test_spec_tree.py
    trained_deepseek 0.6
    # shellcheck disable=SC2086
    step cycle_now 120 python3 benchmark/bench_decode.py --model-path "$models/deepseek-v3-mtp" --batch-sizes 1 32 --repeats 5 \
      -- --cuda-graph-max-bs 32 $nextn_3_1_4
    if [ -n "${BEFORE_PYTHON:-}" ]; then
      # shellcheck disable=SC2086
      step cycle_before 120 env PYTHONPATH="$BEFORE_PYTHON:$PYTHONPATH" python3 benchmark/bench_decode.py \
        --model-path "$models/deepseek-v3-mtp" --batch-sizes 1 32 --repeats 5 -- --cuda-graph-max-bs 32 $nextn_3_1_4
      step spec_kernels_ab 560 python3 benchmark/flag_ab.py --model-path "$models/deepseek-v3-mtp" --variant plain= \
        --variant n3_before="$nextn_3_1_4" --engine "n3_before=$BEFORE_PYTHON" --variant n3="$nextn_3_1_4" \
        --variant n1_before="$nextn_1_1_2" --engine "n1_before=$BEFORE_PYTHON" --variant n1="$nextn_1_1_2" --rounds 2 \
        "${heldout_c32[@]}"
      grep -A7 '^| variant' "$out/spec_kernels_ab.log" | tee -a "$out/summary.log"
    fi
    ;;
  short-queries)  # split-KV short queries (verify trees, draft extends): the kernel tests, the kernel alone (one program
    # per tile against split), then the cycles they enter, each beside the engine whose python/ is $BEFORE_PYTHON: the
    # dense EAGLE 3/1/4 cycle (Llama-3.1-8B shape, 32k-token map) with the plain step, and the trained DeepSeek's
    # NEXTN 3/1/4 cycle
    step short_query_tests 150 python3 -m pytest -q test/test_triton_kernels.py
    step bench_attention 90 python3 benchmark/kernels/bench_attention.py
    token_map_32k
    llama=(--config benchmark/configs/llama-3.1-8b.json --batch-sizes 1 --repeats 5)
    step llama8b_plain 90 python3 benchmark/bench_decode.py "${llama[@]}" -- --cuda-graph-max-bs 8
    trained_deepseek 2
    for engine in now before; do
      [ "$engine" = before ] && [ -z "${BEFORE_PYTHON:-}" ] && continue
      pythonpath=${PYTHONPATH:-}; [ "$engine" = before ] && pythonpath=$BEFORE_PYTHON:${PYTHONPATH:-}
      # shellcheck disable=SC2086
      step "llama8b_eagle_$engine" 120 env PYTHONPATH="$pythonpath" python3 benchmark/bench_decode.py "${llama[@]}" \
        --draft-config benchmark/configs/llama-3.1-8b-eagle.json -- --cuda-graph-max-bs 8 $eagle_3_1_4
      # shellcheck disable=SC2086
      step "nextn_cycle_$engine" 90 env PYTHONPATH="$pythonpath" python3 benchmark/bench_decode.py \
        --model-path "$models/deepseek-v3-mtp" --batch-sizes 1 --repeats 5 -- --cuda-graph-max-bs 8 $nextn_3_1_4
    done
    ;;
  smollm2-c64)  # SmolLM2-135M shape, random 256 in / 128 out at concurrency 64, against the engine
    # whose python/ is $BEFORE_PYTHON (e.g. `git archive COMMIT python | tar -x -C DIR`, carried along)
    if [ -z "${BEFORE_PYTHON:-}" ]; then
      echo "=== smollm2_c64: skipped, BEFORE_PYTHON (the previous engine's python/) unset" | tee -a "$out/summary.log"
    else
      dir=$(dummy_dir benchmark/configs/smollm2-135m.json)
      step smollm2_c64 400 python3 benchmark/flag_ab.py --model-path "$dir" --variant before= --engine "before=$BEFORE_PYTHON" \
        --variant after= --rounds 2 --dataset-name random --random-input-len 256 --random-output-len 128 --random-range-ratio 1 \
        --num-prompts 256 --max-concurrency 64 --output-file "$out/smollm2_c64.json" -- --load-format dummy --cuda-graph-max-bs 64
      grep -A4 '^| variant' "$out/smollm2_c64.log" | tee -a "$out/summary.log"
    fi
    ;;
  graphs)  # one GPU: CUDA graphs for plain decode and for every speculative sub-forward
    nextn=$nextn_3_1_4
    step graph_tests 300 python3 -m pytest -q -x test/test_cuda_graph_keys.py test/test_cuda_graph_replay.py \
      test/test_cuda_graph_spec.py test/test_triton_kernels.py test/test_fused_ops.py
    step spec_graphs_equal 400 python3 benchmark/gpu/validate_parallel_spec.py --gpus 1 --out "$out"
    step dsv2lite_plain 200 python3 benchmark/bench_decode.py --config benchmark/configs/deepseek-v2-lite.json \
      --batch-sizes 1 32 -- --cuda-graph-max-bs 32
    # shellcheck disable=SC2086
    step dsv2lite_nextn_graphs 300 python3 benchmark/bench_decode.py --config benchmark/configs/deepseek-v2-lite.json \
      --batch-sizes 1 32 -- --cuda-graph-max-bs 32 $nextn
    step smollm2_graphs 150 python3 benchmark/bench_decode.py --model-path "$smollm2" --batch-sizes 1 32 -- --cuda-graph-max-bs 32
    step llama8b_profile 200 python3 benchmark/profile_engine.py --config benchmark/configs/llama-3.1-8b.json \
      --output-dir "$out/profile" -- --cuda-graph-max-bs 8
    ;;
  prefill-graphs)  # prefill CUDA graphs (--enable-piecewise-cuda-graph): tests, equality with eager, prefill time with and without
    step prefill_graph_tests 300 python3 -m pytest -q -x test/test_prefill_cuda_graph.py
    step prefill_graphs 450 python3 benchmark/gpu/validate_prefill_graphs.py --models small-deepseek llama8b
    # DP attention with NEXTN, ranks sharing the GPU: prefill graphs replayed by every rank, tokens exact
    step prefill_graphs_dp 450 python3 benchmark/gpu/validate_shared_gpu.py --out "$out" --parallel tp2dp2 --checks exact \
      --specs chain --modes prefill-graphs
    small_dir=$(dummy_dir benchmark/configs/deepseek-v3-small-mtp.json)
    for flags in "" "--enable-piecewise-cuda-graph"; do
      # shellcheck disable=SC2086
      step "small_deepseek_prefill${flags:+_graphs}" 90 python3 -m sglang.bench_one_batch --model-path "$small_dir" \
        --load-format dummy --batch-size 1 --input-len 276 1024 --output-len 8 $flags
    done
    ;;
  shared-gpu)  # several ranks on one GPU (--gpu-id-step 0): the IPC collectives, then the seed's configuration
    # ($SHARED_PARALLEL: tp2dp2 tp4dp4 tp4dp2; $SHARED_CHECKS: exact perfect idle trained load)
    step collectives_2ranks 120 python3 benchmark/kernels/bench_collectives.py --world 2 --gpu-id-step 0 --jsonl "$out/collectives.jsonl"
    step collectives_4ranks 120 python3 benchmark/kernels/bench_collectives.py --world 4 --gpu-id-step 0 --jsonl "$out/collectives.jsonl"
    # shellcheck disable=SC2086
    step shared_gpu_spec 900 python3 benchmark/gpu/validate_shared_gpu.py --out "$out" --parallel ${SHARED_PARALLEL:-tp2dp2} \
      --checks ${SHARED_CHECKS:-exact perfect idle}
    ;;
  collectives)  # the IPC collectives against NCCL, ranks on separate GPUs (a machine of several GPUs)
    step collectives_nccl 150 python3 benchmark/kernels/bench_collectives.py --world "${WORLD:-2}" --gpu-id-step 1 \
      --jsonl "$out/collectives.jsonl"
    ;;
  *) echo "usage: validate.sh STAGE...: kernels|pack-deepseek|kernel-tests|launch|tune|tune-ab|gemv-pdl|decode|deepseek|v2lite-step|profile-deepseek|small-deepseek|nextn-serving|serving-profile|serving-phases|greedy-decode|spec-mixed|serving-spy|spec-kernels|short-queries|smollm2-c64|graphs|prefill-graphs|shared-gpu|collectives"; exit 2 ;;
esac
done
