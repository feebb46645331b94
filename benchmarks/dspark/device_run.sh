#!/usr/bin/env bash
# Benchmark driver for the GPU machine (no SGLang, no internet, 64 MiB per transfer).
# The target's packed weights travel in two calls that must land on the same (warm) machine:
#   call 1: bash benchmarks/dspark/device_run.sh probe   (carries .dspark_carry/part0.pt)
#   call 2: bash benchmarks/dspark/device_run.sh full    (carries .dspark_carry/part1.pt + prompts)
# Prepare .dspark_carry with: python benchmarks/dspark/target_pack.py .dspark_carry (and the
# prompts file written by kllm_plugins.plugins.dspark.train.prompts_from_sharegpt).
set -u
PHASE=$1
W=/tmp/dsp
B="python3 benchmarks/dspark/bench_drafters.py"
NAMES="dspark dspark_gated dspark_rnn dflash eagle"
mkdir -p /tmp/shim $W/logs
rm -rf /tmp/shim/kllm_plugins
cp -r kllm_plugins /tmp/shim/ && cp -r plugins /tmp/shim/kllm_plugins/plugins && cp -r hardware /tmp/shim/kllm_plugins/hardware
export PYTHONPATH=/tmp/shim PYTHONUNBUFFERED=1
for f in .dspark_carry/*; do cp "$f" $W/; done
nvidia-smi -L
if [ "$PHASE" = probe ]; then
  for n in $NAMES; do $B probe --work $W --name $n --steps 25 > $W/logs/probe_$n.log 2>&1 & done
  wait
  grep -h PROBE $W/logs/probe_*.log
  grep -h -A3 Traceback $W/logs/probe_*.log | head -40
  # dry run of every phase on the GPU (layers not carried yet are random), tiny sizes
  D=/tmp/dspdry; mkdir -p $D; cp $W/part0.pt $W/config.json $W/prompts.pt $D/
  R="--work $D --random-missing"
  $B gen $R --prompts $D/prompts.pt --max-prompts 48 --test-prompts 16 --max-answer 24 > $W/logs/dry.log 2>&1
  for n in dspark dflash eagle; do $B train $R --name $n --steps 4 >> $W/logs/dry_$n.log 2>&1 & done; wait
  mkdir -p $D/out
  $B eval $R --out $D/out --names dspark dflash eagle --test-prompts 16 --bs1-prompts 2 --sample-prompts 16 --max-new 16 --cost-batches 1 4 >> $W/logs/dry.log 2>&1
  grep -h "GEN\|TRAIN\|EVAL" $W/logs/dry*.log | cut -c1-300
  grep -h -B2 -A12 Traceback $W/logs/dry*.log | head -60
  ls $D/out
  exit 0
fi
test -f $W/part0.pt && test -f $W/part1.pt || { echo "part0 missing: a fresh machine"; exit 3; }
$B gen --work $W --prompts $W/prompts.pt --max-prompts ${MAX_PROMPTS:-6000} > $W/logs/gen.log 2>&1
grep -h GEN $W/logs/gen.log || { tail -30 $W/logs/gen.log; exit 4; }
STEPS=$(python3 -c "
import json,glob
t=max(json.load(open(f))['step_s'] for f in glob.glob('$W/probe_*.json'))
print(max(50, int(${TRAIN_BUDGET_S:-200}/t)))")
echo "train steps for every drafter: $STEPS"
for n in $NAMES; do $B train --work $W --name $n --steps $STEPS --time-limit ${TIME_LIMIT_S:-300} > $W/logs/train_$n.log 2>&1 & done
wait
grep -h TRAIN $W/logs/train_*.log
grep -h -A5 Traceback $W/logs/train_*.log | head -40
$B eval --work $W --out $OUT --bs1-prompts ${BS1_PROMPTS:-8} --sample-prompts ${SAMPLE_PROMPTS:-32} > $W/logs/eval.log 2>&1
grep -h EVAL $W/logs/eval.log | cut -c1-600
grep -h -A8 Traceback $W/logs/eval.log | head -40
tar cf $OUT/ckpt_meta.tar -C $W $(cd $W && ls -d ckpt_*/kllm_drafter.json ckpt_*/config.json ckpt_*/dspark_sts.json 2>/dev/null)
cat $W/logs/*.log | grep -v Warning > $OUT/logs.txt
ls -la $OUT
