#!/usr/bin/env bash
# RL on a reward model alone with the reward model retrained on the policy's own samples every K steps (iterated
# reward-model training, as InstructGPT / Llama 2 refresh theirs on the current policy's outputs): round r trains
# the policy K steps on RM_r's score only (no verifier reward), then RM_{r+1} = RM_r trained further on pairs of
# those K steps' right vs wrong responses (exact match labels the pairs, as a human labeller would; the policy
# never sees it). Held-out exact-match every 25 steps (the run's eval, on the test split).
#   RM0: the first reward model (e.g. run_policy_rm.sh's D/rm); SFT: the policy's warm start.
#   RM0=runs/reward_model_rl_onpolicy/rm SFT=runs/tiny_moe_addition/sft benchmarks/results/reward_model_rl/run_iterated.sh
set -euo pipefail
REPO=${REPO:-$(pwd)}; D=${D:-runs/reward_model_rl_iterated}; SFT=${SFT:-runs/tiny_moe_addition/sft}; RM0=${RM0:?RM0}
K=${K:-25}; ROUNDS=${ROUNDS:-14}; RM_STEPS=${RM_STEPS:-300}; KL=${KL:-0.1}
START=${START:-0}  # the first round to run (the earlier ones done: run/ holds their checkpoint, rm_START their RM)
PY=$REPO/.venv/bin/python; MEGAPO=$REPO/.venv/bin/megapo; HERE=$REPO/benchmarks/results/reward_model_rl
cd "$REPO"; mkdir -p $D; [ $START -gt 0 ] || { rm -rf $D/rm_0; cp -r $RM0 $D/rm_0; }
printf 'def zero(response, answer):\n    return 0.0\n' > $D/zero_reward.py
for r in $(seq $START $((ROUNDS - 1))); do
  resume=(); [ $r -gt 0 ] && resume=(--resume)
  PYTHONPATH=$D $MEGAPO train "${resume[@]}" megapo/configs/tiny_moe_addition.yaml model.path=$SFT sft.enabled=false \
    train.output_dir=$D/run train.steps=$(((r + 1) * K)) train.ckpt_every=$K data.reward=zero_reward:zero \
    data.reward_model.path=$D/rm_$r data.dynamic_sampling=false train.eval_every=25 algorithm.kl_coef=$KL \
    train.log_samples=true "$@" > $D/run_$r.log 2>&1
  $PY $HERE/iterated_pairs.py $D/run/samples.jsonl $((r * K + 1)) $(((r + 1) * K)) $D/pairs_$r.jsonl $r
  OMP_NUM_THREADS=1 $MEGAPO rm-train --model $D/rm_$r --pairs $D/pairs_$r.jsonl --out $D/rm_$((r + 1)) \
    --steps $RM_STEPS --batch-pairs 64 --lr 5e-4 --seed $r > $D/rm_$((r + 1)).log 2>&1
  grep -h '"eval/' $D/run/metrics.jsonl | tail -1 | cut -c1-200 || true
done
