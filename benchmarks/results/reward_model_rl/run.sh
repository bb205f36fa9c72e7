#!/usr/bin/env bash
# RL on a Bradley-Terry reward model alone (issue 31): the main job's recipe with a zero verifier reward.
set -euo pipefail
REPO=${REPO:-$(pwd)}; D=${D:-runs/reward_model_rl}; MEGAPO=$REPO/.venv/bin/megapo
cd "$REPO"
$MEGAPO tiny-model --out $D/rm_base --family qwen3_moe --layers 2 --experts 8 --topk 2 --hidden 64 --heads 4 \
  --kv-heads 2 --head-dim 32 --ffn 128 --moe-ffn 128 --vocab 512 --seed 1 --head score
$REPO/.venv/bin/python - <<PY
import json
from megapo.commands.rm_train import addition_pairs
for name, split, n, seed in (("train", "train", 4000, 0), ("held_out", "test", 200, 1)):
    with open("$D/" + name + ".jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in addition_pairs(split, n, seed))
PY
OMP_NUM_THREADS=1 $MEGAPO rm-train --model $D/rm_base --pairs $D/train.jsonl --eval-pairs $D/held_out.jsonl --out $D/rm \
  --steps 600 --batch-pairs 64 --lr 1e-3 --warmup-steps 20
printf 'def zero(response, answer):\n    return 0.0\n' > $D/zero_reward.py
PYTHONPATH=$D $MEGAPO train megapo/configs/tiny_moe_addition.yaml train.output_dir=$D/run \
  data.reward=zero_reward:zero data.reward_model.path=$D/rm data.dynamic_sampling=false
