#!/usr/bin/env bash
# RL on a reward model alone, the RM started from the SFT policy (issue 31). PAIRS picks its training pairs:
#   near      4000 train pairs, the correct sum against it with one digit changed     (600 steps, no KL: run A)
#   mixed     those and 4000 with a uniformly random wrong sum, shuffled             (2000 steps, KL 0.1: run B)
#   onpolicy  the SFT policy's own samples, a right one against a wrong one per prompt (1500 steps, KL 0.1: run C)
#   both      the on-policy pairs and the near ones, shuffled                          (2000 steps, KL 0.1: run D)
# SFT: the main job's warm start (runs/tiny_moe_addition/sft after the README's first command).
# RM_INIT: the folder the reward model starts from (default SFT; run D: a stronger model of the same shape, the
# distillation teacher, which answers 0.919 of the held-out sums).
set -euo pipefail
PAIRS=${PAIRS:-onpolicy}; REPO=${REPO:-$(pwd)}; D=${D:-runs/reward_model_rl_$PAIRS}; SFT=${SFT:-runs/tiny_moe_addition/sft}
RM_INIT=${RM_INIT:-$SFT}
case $PAIRS in near) STEPS=600; KL=0;; mixed) STEPS=2000; KL=0.1;; onpolicy) STEPS=1500; KL=0.1;; both) STEPS=2000; KL=0.1;;
  *) echo "PAIRS must be near, mixed, onpolicy or both" >&2; exit 2;; esac
PY=$REPO/.venv/bin/python; MEGAPO=$REPO/.venv/bin/megapo
cd "$REPO"; mkdir -p $D
if [ $PAIRS = onpolicy ] || [ $PAIRS = both ]; then
  $PY benchmarks/results/reward_model_rl/onpolicy_pairs.py $SFT $D/train.jsonl 3000 0 train
  $PY benchmarks/results/reward_model_rl/onpolicy_pairs.py $SFT $D/held_out.jsonl 300 1 test
fi
if [ $PAIRS = both ]; then  # the near pairs as the trainer's token ids, with the end-of-sequence token the policy's have
  $PY - <<PY
import json, random
from transformers import AutoTokenizer
from megapo.commands.rm_train import addition_pairs
from megapo.trainer.data import encode_prompt
tok = AutoTokenizer.from_pretrained("$SFT")
eos = tok.convert_tokens_to_ids("<|im_end|>")
def ids(rows):
    return [{"prompt": encode_prompt(tok, r["prompt"], False),
             **{k: tok.encode(r[k], add_special_tokens=False) + [eos] for k in ("chosen", "rejected")}} for r in rows]
rows = [json.loads(line) for line in open("$D/train.jsonl")] + ids(addition_pairs("train", 4000, 0, negatives="near"))
random.Random(0).shuffle(rows)
open("$D/train.jsonl", "w").writelines(json.dumps(r) + "\n" for r in rows)
open("$D/held_out_near.jsonl", "w").writelines(json.dumps(r) + "\n" for r in ids(addition_pairs("test", 200, 1, negatives="near")))
PY
elif [ $PAIRS != onpolicy ]; then
  $PY - <<PY
import json, random
from megapo.commands.rm_train import addition_pairs
rows = addition_pairs("train", 4000, 0, negatives="near")
if "$PAIRS" == "mixed":
    rows += addition_pairs("train", 4000, 2, negatives="uniform")
    random.Random(0).shuffle(rows)
open("$D/train.jsonl", "w").writelines(json.dumps(r) + "\n" for r in rows)
open("$D/held_out.jsonl", "w").writelines(json.dumps(r) + "\n" for r in addition_pairs("test", 200, 1, negatives="near"))
PY
fi
OMP_NUM_THREADS=1 $MEGAPO rm-train --model $RM_INIT --pairs $D/train.jsonl --eval-pairs $D/held_out.jsonl --out $D/rm \
  --steps $STEPS --batch-pairs 64 --lr 5e-4 --warmup-steps 20
printf 'def zero(response, answer):\n    return 0.0\n' > $D/zero_reward.py
PYTHONPATH=$D $MEGAPO train megapo/configs/tiny_moe_addition.yaml model.path=$SFT sft.enabled=false \
  train.output_dir=$D/run data.reward=zero_reward:zero data.reward_model.path=$D/rm data.dynamic_sampling=false \
  train.eval_every=25 algorithm.kl_coef=$KL train.log_samples=true "$@"
