#!/usr/bin/env bash
# The whole GPU evaluation, detached (setsid) by scripts/gpu/dspark_device_run.sh so that it runs on across the
# device calls that keep the machine: gen -> train (drafters side by side, one feature cache per GPU) -> accept
# (side by side) -> timing (alone per GPU) + float32 losslessness -> merge. $W/stage says where it is.
# Sizes come from the environment (defaults: the recorded evaluation). Restartable on a fresh
# machine: carried answers_*.xz skip generation (restore), trainers continue from $W/state_<name>
# (--resume; a state marked done is only exported).
set -u
W=${W:-/tmp/dsp}; C=$W/code; L=$W/logs; O=$W/out
mkdir -p $L $O
export PYTHONUNBUFFERED=1
B="python3 $C/bench_drafters.py"; E="python3 $C/drafter_eval.py"
G0=${G0:-"dspark dflash dspark_gated"}; G1=${G1:-"eagle dspark_rnn dflash_seed1"}
# timed alone per GPU after the accept runs (GPU0 also times the target alone and the step costs)
T0_NAMES=${T0_NAMES:-"dspark dflash"}; T1_NAMES=${T1_NAMES:-"eagle dspark_gated dspark_rnn"}
FP32_NAMES=${FP32_NAMES:-"dspark dflash eagle"}
# one feature cache per GPU shared by its trainers (CUDA IPC); without IPC (the stage call's check
# failed) each trainer builds its own on a capped share of the data
SHARE_ARGS="--resume"; [ -f $W/ipc_failed ] && SHARE_ARGS="--resume --no-share --max-train-seqs ${NOSHARE_SEQS:-15000}"
stage() { echo "$1 $(date +%s)" >> $W/stage; }
stage start
if ls $W/answers_0.xz $W/answers_1.xz >/dev/null 2>&1 && ! ls $W/answers_*.pt >/dev/null 2>&1; then
  for s in 0 1; do $B restore --work $W --prompts $W/prompts.pt --shard $s --shards 2 ${GEN_ARGS:-} > $L/gen_$s.log 2>&1 & done
  wait
  # carried answers of another temperature are refused: regenerate both shards (and return them)
  if ! ls $W/answers_0.pt $W/answers_1.pt >/dev/null 2>&1; then rm -f $W/answers_*.pt $W/answers_carried; fi
fi
if ! ls $W/answers_*.pt >/dev/null 2>&1; then
  for s in 0 1; do CUDA_VISIBLE_DEVICES=$s $B gen --work $W --prompts $W/prompts.pt --shard $s --shards 2 ${GEN_ARGS:-} > $L/gen_$s.log 2>&1 & done
  wait
fi
stage gen
CUDA_VISIBLE_DEVICES=0 $B train-group --work $W --names $G0 $SHARE_ARGS ${TRAIN_ARGS:-} > $L/train_g0.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 $B train-group --work $W --names $G1 $SHARE_ARGS ${TRAIN_ARGS:-} > $L/train_g1.log 2>&1 &
wait
stage train
for n in $G0; do CUDA_VISIBLE_DEVICES=0 $E accept --work $W --out $O --name $n ${ACCEPT_ARGS:-} > $L/accept_$n.log 2>&1 & done
for n in $G1; do CUDA_VISIBLE_DEVICES=1 $E accept --work $W --out $O --name $n ${ACCEPT_ARGS:-} > $L/accept_$n.log 2>&1 & done
wait
stage accept
CUDA_VISIBLE_DEVICES=0 $E timing --work $W --out $O --names $T0_NAMES --with-target --costs --tag 0 ${TIMING_ARGS:-} > $L/timing_0.log 2>&1 &
( CUDA_VISIBLE_DEVICES=1 $E fp32 --work $W --out $O --names $FP32_NAMES ${FP32_ARGS:-} > $L/fp32.log 2>&1
  CUDA_VISIBLE_DEVICES=1 $E timing --work $W --out $O --names $T1_NAMES --tag 1 ${TIMING_ARGS:-} > $L/timing_1.log 2>&1 ) &
wait
$E merge --work $W --out $O > $L/merge.log 2>&1
stage done
