#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md, in three phases that each fit one 10-minute run.
#
#   bash benchmark/gpu_figures.sh train  OUT   # trains both models; OUT/deepseek.tar, OUT/eagle.tar, OUT/heldout_prompts.jsonl
#   bash benchmark/gpu_figures.sh nextn  OUT   # trained DeepSeek: no spec vs NEXTN 3/1/4 at concurrency 1 and 32
#   bash benchmark/gpu_figures.sh eagle  OUT   # SmolLM2: MMLU-format set and serving, no spec vs EAGLE 3/1/4
#
# nextn and eagle read the trained models from bench_models/ (unpack the tars there first:
# mkdir -p bench_models && tar -xf deepseek.tar -C bench_models && tar -xf eagle.tar -C bench_models,
# and copy heldout_prompts.jsonl there). Every result is a JSON line in OUT/*.jsonl.
set -euo pipefail
phase=$1
out=$2
models=bench_models
minutes=${MINUTES:-3}
port=${PORT:-30000}
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out"
(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true) | tee "$out/machine.txt"
date -u +%Y-%m-%dT%H:%MZ | tee -a "$out/machine.txt"

serve() {  # serve MODEL [server flags...]: start a server in the background and wait for /health
  python -m sglang.launch_server --model-path "$@" --port "$port" >"$out/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 600); do
    python -c "import requests, sys; sys.exit(requests.get('http://127.0.0.1:$port/health', timeout=5).status_code != 200)" \
      2>/dev/null && return 0
    kill -0 "$server_pid" 2>/dev/null || { tail -50 "$out/server.log"; return 1; }
    sleep 1
  done
  tail -50 "$out/server.log"
  return 1
}

stop() {
  kill "$server_pid"
  wait "$server_pid" || true
}

serving() {  # serving LABEL PROMPTS OUTPUT_LEN: held-out prompts at concurrency 1 and 32
  for c in 1 32; do
    python -m sglang.bench_serving --backend sglang --port "$port" --dataset-name file --dataset-path "$2" \
      --num-prompts 64 --random-output-len "$3" --max-concurrency "$c" --flush-cache \
      --output-file "$out/serving_$1.jsonl"
  done
}

case $phase in
  train)
    python -m sglang.tools.train_tiny_models --out "$out/models" --device cuda --minutes "$minutes"
    tar -cf "$out/deepseek.tar" -C "$out/models" deepseek-v3-mtp
    tar -cf "$out/eagle.tar" -C "$out/models" eagle-smollm2-135m-instruct
    cp "$out/models/heldout_prompts.jsonl" "$out/"
    rm -rf "$out/models"
    ;;
  nextn)
    serve "$models/deepseek-v3-mtp"
    serving deepseek_nospec "$models/heldout_prompts.jsonl" 256
    stop
    serve "$models/deepseek-v3-mtp" --speculative-algorithm NEXTN --speculative-num-steps 3 \
      --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
    serving deepseek_nextn_3_1_4 "$models/heldout_prompts.jsonl" 256
    stop
    ;;
  eagle)
    data=${MMLU_DIR:-/tmp/mmlu_synthetic}
    [ -d "$data" ] || python benchmark/mmlu/make_synthetic.py --out "$data" --num-test 100
    serve SmolLM2-135M-Instruct
    python benchmark/mmlu/bench_sglang.py --data_dir "$data" --nsub 60 --parallel 64 --port "$port" \
      --result-file "$out/mmlu_smollm2_nospec.jsonl"
    serving smollm2_nospec "$models/heldout_prompts.jsonl" 256
    stop
    serve SmolLM2-135M-Instruct --speculative-algorithm EAGLE \
      --speculative-draft-model-path "$models/eagle-smollm2-135m-instruct" \
      --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
    python benchmark/mmlu/bench_sglang.py --data_dir "$data" --nsub 60 --parallel 64 --port "$port" \
      --result-file "$out/mmlu_smollm2_eagle_3_1_4.jsonl"
    serving smollm2_eagle_3_1_4 "$models/heldout_prompts.jsonl" 256
    stop
    ;;
  *)
    echo "unknown phase $phase (train, nextn, eagle)" >&2
    exit 2
    ;;
esac
