#!/usr/bin/env bash
# Runs on the GPU machine, in the repository's root: installs what scripts/gpu/pack.sh packed
# (device_setup.sh), then each named suite, writing a small JSON summary per suite (and its log)
# under $OUT (the device tool brings $OUT back; elsewhere it defaults to /tmp/kllm/out):
#   smoke  the platform resolves, `kllm-plugins doctor` finds every target (SGLANG_PLATFORM=kllm_cuda)
#   e2e    tests/gpu/test_sglang_cuda_platform_gpu.py (one server per plugin, all on the GPU at once;
#          KLLM_GPU_E2E_CASES=a,b starts only those cases)
#   gpu    the other GPU tests of tests/gpu (kernels and copiers of our own, outside SGLang); only those
#          matching $GPU_K (pytest -k) when set
#   speed  benchmarks/gpu/serving_speed.py (SGLang on kllm_cuda vs transformers, same GPU)
#   smollm2  the SmolLM2-135M end-to-end test alone (its GGUF joined from parts over several calls)
#   incr_prefix, router, fair_sched, fair_long, affinity, dspark  benchmarks/gpu/<name>_gpu.py (plugin rows,
#          stock vs plugin; router = router_overhead, affinity = router_affinity, fair_long = fair_sched_long (one
#          huge prompt in flight), dspark = dspark_serving: SGLang's DSPARK, no speculation vs stock vs the
#          plugin); extra arguments in $INCR_ARGS, $ROUTER_ARGS, $FAIR_ARGS, $LONG_ARGS, $AFF_ARGS, $DSPARK_ARGS;
#          each benchmark step stopped after $KLLM_STEP_TIMEOUT_<SUITE>_S (e.g. KLLM_STEP_TIMEOUT_ROUTER_S) or else $KLLM_STEP_TIMEOUT_S (default 600)
#   router_bs  benchmarks/bigpd_router/bench_overhead.py --bench-serving: sglang.bench_serving direct vs
#          through kllm-router, the fake backend and the tiny model on the GPU (--bs-gpu); arguments of both
#          in $ROUTER_BS_ARGS, of the GPU one only in $ROUTER_BS_GPU_ARGS (e.g. --bs-pin auto); summary
#          gpu_overhead_bench_serving.json; ROUTER_BS_SKIP_FAKE=1 runs the GPU one only
#   relay_latency  benchmarks/bigpd_router/bench_relay_latency.py (per-token delay and added TPOT of the
#          router, fake backend with stamps; its arguments in $RELAY_ARGS; summary gpu_relay_latency.json)
#   kv_tiers  benchmarks/gpu/kv_tiers_gpu.py (bench_tiers.py on the GPU; its arguments in $KV_ARGS, the
#          wrapper's own (e.g. --mem-fraction 0.6 on an 80 GB card) in $KV_GPU_ARGS;
#          summary under $OUT/benchmarks/results/kv_tiers/)
#   copy_contention  benchmarks/kv_tiers/copy_under_compute_gpu.py (L1->L2 backup bandwidth of the hooked
#          copier on an idle GPU, beside GEMMs, beside a second process; its arguments in $COPY_ARGS;
#          summary copy_under_compute.json)
#   time_to_serve  benchmarks/gpu/time_to_serve_gpu.py (bench_time_to_serve.py on the GPU; its arguments
#          in $TTS_ARGS; summary under $OUT/benchmarks/results/bigpd_router/)
# Each pytest suite also writes one JSON line per finished test as it goes (pytest_progress.py), and
# stops after $KLLM_SUITE_TIMEOUT_S seconds (default 3000) so its summary is still written: set it
# below the device call's limit.
# Usage: KLLM_COMMIT=<sha> KLLM_SUITE_TIMEOUT_S=300 bash scripts/gpu/run_suite.sh smoke e2e
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kllm/out}
mkdir -p "$OUT" /tmp/kllm
bash scripts/gpu/device_setup.sh 2>&1 | tee "$OUT/setup.log" || exit 1
export KLLM_CACHE_DIR=/tmp/kllm/cache PYTHONUNBUFFERED=1 SGLANG_PLATFORM=kllm_cuda
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$(pwd)/scripts/gpu${PYTHONPATH:+:$PYTHONPATH}"
# the benchmark drivers write their servers' logs here (server-<name>.log), kept to their last lines
export KLLM_SERVER_LOG_DIR="$OUT"
PY=python3
# pytest with a deadline (SIGTERM, then SIGKILL 15 s later) and per-test progress lines
pytest_limited() {
  timeout --kill-after=15 "${KLLM_SUITE_TIMEOUT_S:-3000}" $PY -m pytest -p pytest_progress "$@"
}
# the benchmark drivers' SGLang servers run in sessions of their own: a step cut at its limit leaves
# them on the GPU. On the lent machine (every GPU process ours) KLLM_DEVICE_CLEANUP=1 ends them; never elsewhere
device_cleanup() {
  [ "${KLLM_DEVICE_CLEANUP:-0}" = 1 ] && nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9
  return 0
}
# a benchmark step's limit: KLLM_STEP_TIMEOUT_<SUITE>_S, else KLLM_STEP_TIMEOUT_S, else 600
step_limit() {
  local v="KLLM_STEP_TIMEOUT_${1^^}_S"
  echo "${!v:-${KLLM_STEP_TIMEOUT_S:-600}}"
}
rc=0
for suite in "$@"; do
  start=$(date +%s)
  case $suite in
    smoke)
      $PY scripts/gpu/smoke.py --out "$OUT/smoke.json" > "$OUT/smoke.log" 2>&1; r=$? ;;
    e2e)
      KLLM_PROGRESS_JSONL="$OUT/e2e-junit.xml.jsonl" pytest_limited tests/gpu/test_sglang_cuda_platform_gpu.py -v -rA \
        -p no:cacheprovider --timeout 900 --junitxml "$OUT/e2e-junit.xml" > "$OUT/e2e.log" 2>&1; r=$?
      $PY scripts/gpu/summarize_junit.py "$OUT/e2e-junit.xml" e2e "$OUT/e2e.json" ;;
    gpu)
      KLLM_PROGRESS_JSONL="$OUT/gpu-junit.xml.jsonl" pytest_limited tests/gpu -v -rA -p no:cacheprovider --timeout 600 \
        ${GPU_K:+-k "$GPU_K"} --deselect tests/gpu/test_sglang_cuda_platform_gpu.py --junitxml "$OUT/gpu-junit.xml" > "$OUT/gpu.log" 2>&1; r=$?
      $PY scripts/gpu/summarize_junit.py "$OUT/gpu-junit.xml" gpu "$OUT/gpu.json" ;;
    speed)
      timeout --kill-after=20 "$(step_limit $suite)" $PY benchmarks/gpu/serving_speed.py --out "$OUT/speed.json" \
        ${SPEED_ARGS:-} > "$OUT/speed.log" 2>&1; r=$? ;;
    smollm2)
      KLLM_PROGRESS_JSONL="$OUT/smollm2-junit.xml.jsonl" pytest_limited tests/gpu/test_sglang_cuda_platform_gpu.py -v -rA \
        -p no:cacheprovider --timeout 600 -k smollm2 --junitxml "$OUT/smollm2-junit.xml" > "$OUT/smollm2.log" 2>&1; r=$?
      $PY scripts/gpu/summarize_junit.py "$OUT/smollm2-junit.xml" smollm2 "$OUT/smollm2.json" ;;
    incr_prefix|router|fair_sched|fair_long|affinity|dspark)
      case $suite in incr_prefix) extra=${INCR_ARGS:-} ;; router) extra=${ROUTER_ARGS:-} ;; affinity) extra=${AFF_ARGS:-} ;;
        dspark) extra=${DSPARK_ARGS:-} ;; fair_long) extra=${LONG_ARGS:-} ;; *) extra=${FAIR_ARGS:-} ;; esac
      script=$suite; [ "$suite" = router ] && script=router_overhead; [ "$suite" = affinity ] && script=router_affinity
      [ "$suite" = dspark ] && script=dspark_serving; [ "$suite" = fair_long ] && script=fair_sched_long
      timeout --kill-after=20 "$(step_limit $suite)" $PY "benchmarks/gpu/${script}_gpu.py" --out "$OUT/$suite.json" \
        $extra > "$OUT/$suite.log" 2>&1; r=$?
      device_cleanup ;;
    router_bs)
      tiny=$($PY -m kllm_plugins.cli build-model tiny)
      lim=$(step_limit $suite)
      { [ "${ROUTER_BS_SKIP_FAKE:-0}" = 1 ] || timeout --kill-after=20 "$lim" $PY benchmarks/bigpd_router/bench_overhead.py \
          --bench-serving "$tiny" --bs-backend fake --bs-out-root "$OUT" --bs-max-s $((lim / 3)) ${ROUTER_BS_ARGS:-}
        timeout --kill-after=20 "$lim" $PY benchmarks/bigpd_router/bench_overhead.py --bench-serving "$tiny" \
          --bs-backend sglang --bs-gpu --bs-out-root "$OUT" --bs-max-s $((lim / 2)) ${ROUTER_BS_ARGS:-} \
          ${ROUTER_BS_GPU_ARGS:-}; } \
        > "$OUT/router_bs.log" 2>&1; r=$?
      device_cleanup ;;
    kv_tiers)
      timeout --kill-after=20 "$(step_limit $suite)" $PY benchmarks/gpu/kv_tiers_gpu.py --out-root "$OUT" ${KV_GPU_ARGS:-} -- \
        ${KV_ARGS:-} > "$OUT/kv_tiers.log" 2>&1; r=$?
      device_cleanup ;;
    relay_latency)
      timeout --kill-after=20 "$(step_limit $suite)" $PY benchmarks/bigpd_router/bench_relay_latency.py \
        --results-root "$OUT" --out-name gpu_relay_latency --shared "GPU machine's host, nothing else running" \
        ${RELAY_ARGS:-} > "$OUT/relay_latency.log" 2>&1; r=$? ;;
    copy_contention)
      timeout --kill-after=20 "$(step_limit $suite)" $PY benchmarks/kv_tiers/copy_under_compute_gpu.py \
        --out "$OUT/copy_under_compute.json" ${COPY_ARGS:-} > "$OUT/copy_contention.log" 2>&1; r=$? ;;
    time_to_serve)
      timeout --kill-after=20 "$(step_limit $suite)" $PY benchmarks/gpu/time_to_serve_gpu.py --out-root "$OUT" -- \
        ${TTS_ARGS:-} > "$OUT/time_to_serve.log" 2>&1; r=$?
      device_cleanup ;;
    *) echo "unknown suite $suite"; r=2 ;;
  esac
  echo "suite $suite: rc=$r in $(( $(date +%s) - start )) s"
  [ $r -ne 0 ] && rc=$r
  tail -5 "$OUT/$suite.log" 2>/dev/null
done
rm -f "$OUT"/*-junit.xml
# results written under $OUT/benchmarks/results/<plugin>/ come back from the top of $OUT (the device
# tool dropped that folder once as too deep); the L3 stores and scratch beside them stay behind
for f in "$OUT"/benchmarks/results/*/*.json; do [ -f "$f" ] && cp "$f" "$OUT/"; done
rm -rf "$OUT/benchmarks"
for f in "$OUT"/server-*.log; do [ -f "$f" ] && tail -n 4000 "$f" > "$f.t" && mv "$f.t" "$f"; done
# the device tool brings back at most 8 files: the logs and progress lines travel as one archive
(cd "$OUT" && ls *.log *.jsonl >/dev/null 2>&1 && tar -czf logs.tar.gz *.log *.jsonl && rm -f *.log *.jsonl)
exit $rc
