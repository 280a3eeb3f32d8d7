#!/usr/bin/env bash
# GPU validation and measurements, run on the device machine from the project root:
#   source .device/env.sh && bash benchmark/gpu/validate.sh STAGE
# Logs go to $OUT (or ./gpu-logs). Each step has its own time limit and failures do not stop
# the stages that follow.
set -u
out="${OUT:-gpu-logs}"; mkdir -p "$out"
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "=== $name: $*" | tee -a "$out/summary.log"
  local t0=$SECONDS
  timeout "$secs" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$out/summary.log"
  grep -E '^\{|passed|failed|error|identical|matching|Error' "$out/$name.log" | tail -40 | tee -a "$out/summary.log"
}
smollm2="${SMOLLM2_GGUF:-/tmp/smollm2.gguf}"
case "${1:-}" in
  kernels)
    # No -x: one failure must not hide the other kernels' results.
    step kernel_tests 300 python3 -m pytest -q test/test_triton_kernels.py test/test_attention_backends.py \
      test/test_gemv.py test/test_fused_ops.py test/test_deepseek_kernels.py test/test_sampler.py test/test_cuda_graph.py
    step bench_attention 150 python3 benchmark/kernels/bench_attention.py
    step smollm2_agreement 150 python3 benchmark/accuracy/greedy_agreement.py --model-path "$smollm2" \
      --out "$out/smollm2_gpu_bf16.json" --compare benchmark/accuracy/smollm2_cpu_f32.json -- --disable-cuda-graph
    step smollm2_decode 150 python3 benchmark/bench_decode.py --model-path "$smollm2" --batch-sizes 1 32 -- --disable-cuda-graph
    ;;
  tune)  # measured kernel tables for this GPU (layers/tuned/*.json; copies in $OUT)
    # shellcheck disable=SC2086
    step tune_gemv 200 python3 benchmark/kernels/bench_gemv.py --rows 1 4 8 32 --write-table --jsonl "$out/gemv.jsonl" ${GEMV_FLAGS:-}
    step tune_moe 150 python3 benchmark/kernels/bench_moe.py --budget 45 --write-table
    cp python/sglang/srt/layers/tuned/*.json "$out/" 2>/dev/null
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
    step dsv2lite_nextn 150 python3 benchmark/bench_decode.py --config benchmark/configs/deepseek-v2-lite.json \
      --batch-sizes 1 32 -- --cuda-graph-max-bs 32 --speculative-algorithm NEXTN --speculative-num-steps 3 \
      --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
    ;;
  graphs)  # one GPU: CUDA graphs for plain decode and for every speculative sub-forward
    nextn="--speculative-algorithm NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
    step graph_tests 300 python3 -m pytest -q -x test/test_cuda_graph.py test/test_triton_kernels.py test/test_fused_ops.py
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
  *) echo "usage: validate.sh kernels|tune|decode|deepseek|graphs"; exit 2 ;;
esac
