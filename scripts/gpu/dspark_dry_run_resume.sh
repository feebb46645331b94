#!/usr/bin/env bash
# CPU dry run of the resumable GPU pipeline with the tiny Llama (minutes; run it through the
# machine's CPU wrapper): call "full" on machine 1 until LIMIT, machine 1 then lost; a FRESH
# machine (empty work dir) gets config/target/prompts + the returned answers_*.xz and
# state_*/ carried in and runs "resume" to the end. Checks: generation skipped (restore),
# trainers resumed at their returned step, the pipeline finished (merge), states returned.
#   bash scripts/gpu/dspark_dry_run_resume.sh /tmp/dsp_dry
set -eu
D=${1:-/tmp/dsp_dry}
TINY=$(python -m kllm_plugins.models.tiny_llama)
rm -rf $D && mkdir -p $D/carry1 $D/out1 $D/out2
cp $TINY/config.json $TINY/model.safetensors $D/carry1/
# DRY_PROMPTS=prompts_turns.pt: the every-turn prompt file (it has the validation split the curves need)
cp .dspark_carry/${DRY_PROMPTS:-prompts.pt} $D/carry1/prompts.pt 2>/dev/null || { echo "need .dspark_carry/${DRY_PROMPTS:-prompts.pt}"; exit 2; }
# DRY_G0/DRY_G1/DRY_T0/DRY_T1/DRY_FP32 try another run's drafter names (e.g. next_run6.env's)
export G0=${DRY_G0:-dspark} G1=${DRY_G1:-eagle} SKIP_IPC=1 SHIM=$D/shim T0_NAMES=${DRY_T0:-dspark} T1_NAMES=${DRY_T1:-eagle}
export FP32_NAMES=${DRY_FP32:-"dspark eagle"}
# DRY_GEN_EXTRA/DRY_TRAIN_EXTRA/DRY_ACCEPT_EXTRA add a run's own flags (run 7: sampled answers,
# the distribution loss, temperature-1 evaluation: see next_run7.env's header)
export GEN_ARGS="--max-prompts 48 --test-prompts 8 --val-prompts 8 --max-answer 24 --gen-batch 64 ${DRY_GEN_EXTRA:-}"
export TRAIN_ARGS="--steps 100000 --time-limit 40 --batch-size 4 --eagle-batch-size 4 --anchors 4 --val-max-new 16 --log-every 20 ${DRY_TRAIN_EXTRA:-}"
export ACCEPT_ARGS="--test-prompts 4 --sample-prompts 2 --max-new 16 ${DRY_ACCEPT_EXTRA:-}"
export TIMING_ARGS="--bs16-prompts 4 --bs1-prompts 2 --max-new 8 --cost-batches 1 4"
export FP32_ARGS="--test-prompts 2 --max-new 8"
echo "== machine 1: full, cut after LIMIT"
CARRY=$D/carry1 W=$D/w1 OUT=$D/out1 LIMIT=${LIMIT1:-240} bash scripts/gpu/dspark_device_run.sh full | grep -v "^-\|^d" || true
kill -- -"$(cat $D/w1/pipeline.pid)" 2>/dev/null || true   # machine 1 is gone
sleep 1
ls -R $D/out1 | tr '\n' ' '; echo
mkdir -p $D/carry2a $D/carry2b $D/empty
cp $D/carry1/config.json $D/carry1/model.safetensors $D/out1/answers_*.xz $D/carry2a/
cp $D/carry1/prompts.pt $D/carry2b/ && cp -r $D/out1/state_* $D/carry2b/
echo "== machine 2 (fresh): follow finds nothing"
W=$D/w2 OUT=$D/out2 bash scripts/gpu/dspark_device_run.sh follow || echo "exit $?"
echo "== machine 2: stage (target + answers), put (prompts + states), resume (no carry)"
CARRY=$D/carry2a W=$D/w2 OUT=$D/out2 bash scripts/gpu/dspark_device_run.sh stage 2>&1 | grep MANIFEST || true
CARRY=$D/carry2b W=$D/w2 OUT=$D/out2 bash scripts/gpu/dspark_device_run.sh put
CARRY=$D/empty W=$D/w2 OUT=$D/out2 LIMIT=${LIMIT2:-400} bash scripts/gpu/dspark_device_run.sh resume | grep -v "^-\|^d" || true
echo "== checks"
grep -h "GEN restored" $D/w2/logs/gen_*.log | head -2
grep -h "^RESUME" $D/w2/logs/train_g*.log
grep -q "^done" $D/w2/stage && echo "pipeline done on the fresh machine"
ls $D/w2/out; ls -R $D/out2 | tr '\n' ' '; echo
