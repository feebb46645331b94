#!/usr/bin/env bash
# Driver for the GPU machine (no SGLang, no internet, 64 MiB per transfer). Three chained calls
# that must land on the same warm machine (issue each within seconds of the last):
#   1. bash benchmarks/dspark/device_run.sh stage   carry .dspark_carry/part0.pt, config.json (and
#                                                   answers_0.xz/answers_1.xz of an earlier run, if any)
#   2. bash benchmarks/dspark/device_run.sh full    carry .dspark_carry/part1.pt, config.json, prompts.pt:
#                                                   starts device_pipeline.sh detached, follows it
#   3. bash benchmarks/dspark/device_run.sh follow  (no carry) follows it to the end
# Every call returns what exists so far under $OUT (a cut call loses no figure).
# Prepare .dspark_carry with: python benchmarks/dspark/target_pack.py .dspark_carry (and the
# prompts file written by benchmarks/dspark/make_prompts.py; PROMPTS=<file in .dspark_carry> picks it).
set -u
PHASE=$1
LIMIT=${LIMIT:-565}
W=/tmp/dsp
T0=$(date +%s)
mkdir -p $W/logs $W/out
collect() {
  grep -h "GEN\|TRAIN \|CACHE\|ACCEPT\|TIMING\|FP32\|MERGE\|eval at" $W/logs/*.log 2>/dev/null | cut -c1-700
  grep -h -B2 -A10 Traceback $W/logs/*.log 2>/dev/null | head -60
  cat $W/stage 2>/dev/null
  nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader
  cp $W/out/dspark_records.pt $W/answers_*.xz $OUT/ 2>/dev/null
  (cd $W/out && tar cf $OUT/results.tar *.json 2>/dev/null)
  (cd $W && tar cf $OUT/ckpt_meta.tar $(ls -d ckpt_*/kllm_drafter.json ckpt_*/config.json ckpt_*/dspark_sts.json 2>/dev/null) 2>/dev/null)
  (cd $W/logs && tar cf $OUT/logs.tar *.log 2>/dev/null)
  ls -la $OUT
}
follow() {
  while ! grep -q "^done" $W/stage 2>/dev/null; do
    [ $(( $(date +%s) - T0 )) -ge $LIMIT ] && break
    sleep 5
  done
  collect
}
case $PHASE in
  stage)
    cp .dspark_carry/part0.pt .dspark_carry/config.json $W/
    cp .dspark_carry/answers_*.xz $W/ 2>/dev/null  # an earlier run's answers (same prompt file): no generation
    nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.device_count())"; df -h /tmp | tail -1
    python3 benchmarks/dspark/ipc_check.py || touch $W/ipc_failed
    ;;
  full)
    test -f $W/part0.pt || { echo "part0 missing: a fresh machine"; exit 3; }
    cp .dspark_carry/part1.pt .dspark_carry/config.json $W/ && cp .dspark_carry/${PROMPTS:-prompts.pt} $W/prompts.pt
    rm -rf /tmp/shim $W/code && mkdir -p /tmp/shim $W/code
    cp -r kllm_plugins /tmp/shim/ && cp -r plugins /tmp/shim/kllm_plugins/plugins && cp -r hardware /tmp/shim/kllm_plugins/hardware
    cp benchmarks/dspark/*.py benchmarks/dspark/device_pipeline.sh $W/code/
    PYTHONPATH=/tmp/shim setsid bash $W/code/device_pipeline.sh > $W/logs/pipeline.log 2>&1 < /dev/null &
    sleep 2
    follow
    ;;
  follow)
    follow
    ;;
esac
