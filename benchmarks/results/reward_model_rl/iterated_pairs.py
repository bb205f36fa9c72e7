#!/usr/bin/env python
"""Preference pairs from a run's own samples (train.log_samples=true): for each prompt of steps FIRST..LAST whose
group holds a right and a wrong response (exact match to the sum decides; a response cut by the length limit is
wrong), up to two pairs of a right one against a wrong one, as the token ids the trainer used (EOS included).
The reward model of the next round learns the policy's current mistakes (iterated reward-model training).

    iterated_pairs.py RUN_DIR/samples.jsonl FIRST LAST OUT.jsonl SEED
"""
import json
import random
import sys
from collections import defaultdict

samples, first, last, out, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
groups = defaultdict(list)
with open(samples) as f:
    for line in f:
        s = json.loads(line)
        if first <= s["step"] <= last:
            groups[(s["step"], s["prompt_id"])].append(s)
rng, rows, mixed = random.Random(seed), [], 0
for group in groups.values():
    a, b = group[0]["prompt"].rstrip("=").split("+")
    answer = f"{int(a) + int(b):04d}"
    right = [s["response_ids"] for s in group if s["finish_reason"] == "stop" and s["response"].strip() == answer]
    wrong = [s["response_ids"] for s in group if s["response_ids"] not in right]
    if right and wrong:
        mixed += 1
        rows += [{"prompt": group[0]["prompt_ids"], "chosen": rng.choice(right), "rejected": w} for w in wrong[:2]]
rng.shuffle(rows)
with open(out, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
print(f"steps {first}..{last}: {len(rows)} pairs from {mixed} of {len(groups)} groups with a right and a wrong response")
