#!/usr/bin/env bash
# Driver for the GPU machine (no SGLang, no internet; a call carries 64 MiB and returns 8 files of
# <= 16 MiB). Every call is safe to land on a FRESH machine: it copies what it carried into $W,
# says what is missing, and returns what a later call needs to continue elsewhere.
#   stage    carry .dspark_carry/part0.pt, config.json (+ answers_0.xz/answers_1.xz if they fit):
#            put + GPU/IPC checks
#   put      carry any further files/dirs under .dspark_carry (part1.pt, the prompt file,
#            answers_*.xz, state_<drafter>/ dirs): copied into $W, nothing started
#   full     (= resume) carry the last files (e.g. part1.pt + prompts): when the pipeline is not
#            running and every input is on the machine, start dspark_device_pipeline.sh detached
#            (trainers resume from $W/state_* where present; answers_*.xz skip generation), then follow
#   resume   the same; on a warm machine with the pipeline running it only follows
#   follow   follow the running pipeline (no carry)
# Each call follows until LIMIT seconds, then returns under $OUT: bundle.tar (logs, results,
# checkpoint metadata), answers_*.xz once (unless carried in), dspark_records.pt at the end, and
# as many drafters' training states (state_<name>/part_*.pt, 2 files each) as the 8 files allow,
# those not yet returned first. Bring them back in .dspark_carry/ (returned_states.json says what).
# PROMPTS=<file in .dspark_carry> names the prompt file (copied to $W/prompts.pt).
set -u
PHASE=$1
[ -n "${RUN_ENV:-}" ] && . "$RUN_ENV"   # e.g. benchmarks/dspark/next_run.env
LIMIT=${LIMIT:-565}
W=${W:-/tmp/dsp}
T0=$(date +%s)
mkdir -p $W/logs $W/out
CARRY=${CARRY:-.dspark_carry}
SHIM=${SHIM:-/tmp/shim}
shim() {  # the package as kllm_plugins.* (plugins/ and hardware/ mapped in) and the bench scripts
  rm -rf $SHIM $W/code && mkdir -p $SHIM $W/code
  cp -r kllm_plugins $SHIM/ && cp -r plugins $SHIM/kllm_plugins/plugins && cp -r hardware $SHIM/kllm_plugins/hardware
  cp benchmarks/dspark/*.py scripts/gpu/dspark_device_pipeline.sh $W/code/
}
put() {
  [ -d $CARRY ] || return 0
  for f in $CARRY/*; do
    [ -e "$f" ] || continue
    b=$(basename "$f")
    case $b in
      prompts*.pt) [ "$b" = "${PROMPTS:-prompts.pt}" ] && cp "$f" $W/prompts.pt ;;
      answers_*.xz) cp "$f" $W/ && touch $W/answers_carried ;;
      state_*) rm -rf "$W/$b" && cp -r "$f" $W/ ;;
      *) cp -r "$f" $W/ ;;
    esac
  done
  echo "MANIFEST $(cd $W && ls -d part*.pt config.json prompts.pt answers_* state_* 2>/dev/null | tr '\n' ' ')"
}
missing() {
  local m=""
  for f in config.json prompts.pt; do [ -f $W/$f ] || m="$m $f"; done
  [ -f $W/model.safetensors ] || for f in part0.pt part1.pt; do [ -f $W/$f ] || m="$m $f"; done  # safetensors: the CPU dry run
  echo "$m"
}
running() { [ -f $W/pipeline.pid ] && kill -0 "$(cat $W/pipeline.pid)" 2>/dev/null; }
collect() {
  grep -h "GEN\|TRAIN \|CACHE\|ACCEPT\|TIMING\|FP32\|MERGE\|eval at\|RESUME\|STATE " $W/logs/*.log 2>/dev/null | cut -c1-700
  grep -h -B2 -A10 Traceback $W/logs/*.log 2>/dev/null | head -60
  cat $W/stage 2>/dev/null
  nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
  local slots=7
  (cd $W && tar cf $OUT/bundle.tar $(ls out/*.json logs/*.log ckpt_*/kllm_drafter.json ckpt_*/config.json \
    ckpt_*/dspark_sts.json returned_states.json stage 2>/dev/null) 2>/dev/null)
  if [ ! -f $W/answers_carried ] && [ ! -f $W/answers_returned ] && ls $W/answers_*.xz >/dev/null 2>&1 \
     && grep -q "^gen" $W/stage 2>/dev/null; then
    cp $W/answers_*.xz $OUT/ && touch $W/answers_returned
    slots=$((slots - $(ls $W/answers_*.xz | wc -l)))
  fi
  for f in $W/out/dspark_records*.pt; do [ -f "$f" ] && cp "$f" $OUT/ && slots=$((slots - 1)); done
  [ -d $SHIM ] && PYTHONPATH=$SHIM python3 $W/code/collect_states.py --work $W --out $OUT --slots $slots
  ls -laR $OUT | grep -v "^total"
}
follow() {
  while running && ! grep -q "^done" $W/stage 2>/dev/null; do
    [ $(( $(date +%s) - T0 )) -ge $LIMIT ] && break
    sleep 5
  done
  collect
}
start() {
  if running; then echo "pipeline running (pid $(cat $W/pipeline.pid)): following"; follow; return; fi
  if grep -q "^done" $W/stage 2>/dev/null; then echo "pipeline already done"; collect; return; fi
  local m; m=$(missing)
  if [ -n "$m" ]; then echo "MISSING:$m (a fresh machine: stage/put them first)"; collect; exit 3; fi
  shim
  rm -f $W/stage
  PYTHONPATH=$SHIM setsid bash $W/code/dspark_device_pipeline.sh >> $W/logs/pipeline.log 2>&1 < /dev/null &
  echo $! > $W/pipeline.pid
  sleep 2
  follow
}
case $PHASE in
  stage)
    put
    nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.device_count())"; df -h /tmp | tail -1
    [ -n "${SKIP_IPC:-}" ] || python3 benchmarks/dspark/ipc_check.py || touch $W/ipc_failed
    ;;
  put)
    put
    ;;
  full|resume)
    running || put   # never overwrite a running pipeline's files with (possibly stale) carried ones
    start
    ;;
  follow)
    if running || grep -q "^done" $W/stage 2>/dev/null; then follow; else echo "no pipeline here (a fresh machine?): MANIFEST $(ls $W)"; exit 3; fi
    ;;
  *)
    echo "unknown phase $PHASE"; exit 2 ;;
esac
