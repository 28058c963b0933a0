#!/usr/bin/env bash
# One GPU-machine pass: GEMV tests first (the model uses the GEMV at decode batches <= 8; if it
# fails, the rest runs with TINYVLLM_GEMV=0 so their results still mean something), then every
# other GPU test, then the benchmarks. Logs go to $OUT (or ./gpu-pass-logs).
#   usage: benchmarks/gpu_pass.sh [tests] [gemv-bench] [attn-bench] [profile] [bench] [bench-hf] [server-load]
# (server-load needs the server extra: fastapi, uvicorn, pydantic)
set -u
OUT=${OUT:-gpu-pass-logs}; mkdir -p "$OUT"
steps=${*:-tests gemv-bench profile}
log() { echo "== $*" | tee -a "$OUT/summary.log"; }
for step in $steps; do
  case $step in
    tests)
      timeout 200 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_gpu_gemv.py > "$OUT/gemv-tests.log" 2>&1
      rc=$?; log "gemv tests rc=$rc: $(tail -1 "$OUT/gemv-tests.log")"
      [ $rc -eq 0 ] || export TINYVLLM_GEMV=0
      timeout 330 python3 -m pytest -m gpu -q -s -rfE -p no:cacheprovider --deselect tests/test_gpu_gemv.py \
        tests > "$OUT/gpu-tests.log" 2>&1
      log "gpu tests rc=$? (TINYVLLM_GEMV=${TINYVLLM_GEMV:-1}): $(tail -1 "$OUT/gpu-tests.log")"
      grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -20 | tee -a "$OUT/summary.log"
      grep -hE "per-step|near-tie|mismatches" "$OUT/gpu-tests.log" | tee -a "$OUT/summary.log" ;;
    gemv-bench)
      timeout 120 python3 benchmarks/gemv_bench.py > "$OUT/gemv-bench.log" 2>&1
      log "gemv bench rc=$?"; tail -12 "$OUT/gemv-bench.log" | tee -a "$OUT/summary.log" ;;
    attn-bench)
      timeout 200 python3 benchmarks/decode_attention_bench.py > "$OUT/attn-bench.log" 2>&1
      log "decode attention bench rc=$?"; tail -25 "$OUT/attn-bench.log" | tee -a "$OUT/summary.log" ;;
    profile)
      timeout 200 python3 benchmarks/decode_profile.py > "$OUT/profile.log" 2>&1
      log "decode profile rc=$?"; sed -n '/^llama/,/^$/p' "$OUT/profile.log" | tee -a "$OUT/summary.log" ;;
    bench)
      timeout 300 python3 -m tinyvllm bench --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
      log "bench rc=$?"; tail -20 "$OUT/bench.log" | tee -a "$OUT/summary.log" ;;
    bench-hf)
      timeout 400 python3 -m tinyvllm bench --compare-hf --hf-max-seconds 120 --json "$OUT/bench-hf.json" > "$OUT/bench-hf.log" 2>&1
      log "bench --compare-hf rc=$?"; tail -20 "$OUT/bench-hf.log" | tee -a "$OUT/summary.log" ;;
    server-load)
      model=/tmp/tinyvllm-models/llama-3.2-1b
      [ -f $model/config.json ] || python3 -m tinyvllm make-model $model --preset llama-3.2-1b > /dev/null
      python3 -m tinyvllm serve --model $model --served-model-name llama --kv-cache-gb 8 --port 8123 \
        > "$OUT/serve.log" 2>&1 &
      pid=$!
      python3 -c "
import time, urllib.request
for _ in range(180):
    try:
        urllib.request.urlopen('http://127.0.0.1:8123/health', timeout=1); break
    except Exception:
        time.sleep(1)"
      timeout 160 python3 benchmarks/load_server.py --url http://127.0.0.1:8123 --num-requests 256 \
        --concurrency 64 --max-tokens 128 --timeout 150 --out "$OUT/load.json" > "$OUT/load.log" 2>&1
      log "server load rc=$?"; tail -15 "$OUT/load.log" | tee -a "$OUT/summary.log"
      kill -INT $pid; wait $pid ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
