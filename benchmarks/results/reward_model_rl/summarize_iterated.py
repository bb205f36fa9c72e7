#!/usr/bin/env python
"""Summary, curves and the reward models' on-policy pair accuracy of run_iterated.sh (and of the static RM run
beside it): writes OUT/summary.json, OUT/curves.png, OUT/*_metrics.jsonl (held-out rows and per-step means).

    summarize_iterated.py ITERATED_DIR STATIC_RUN_DIR VERIFIER_METRICS.jsonl OUT_DIR [PAIRS_PER_ROUND]

RM_r's on-policy accuracy: on (up to PAIRS_PER_ROUND of) the pairs of round r, drawn from the policy while it was
trained on RM_r's score, the share where RM_r scores the right response above the wrong one (transformers, fp32).
"""
import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification

it, static, verifier, out = (Path(a) for a in sys.argv[1:5])
per_round = int(sys.argv[5]) if len(sys.argv) > 5 else 200
out.mkdir(parents=True, exist_ok=True)


def curve(metrics: Path) -> list:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [[r["step"], r["eval/accuracy"]] for r in rows if "eval/accuracy" in r]


def pair_accuracy(rm_dir: Path, pairs: Path) -> float:
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in pairs.read_text().splitlines()][:per_round]

    def score(ids):
        with torch.no_grad():
            return rm(input_ids=torch.tensor([ids])).logits[0, 0].item()

    return sum(score(r["prompt"] + r["chosen"]) > score(r["prompt"] + r["rejected"]) for r in rows) / len(rows)


rounds = sorted(int(p.stem.split("_")[1]) for p in it.glob("pairs_*.jsonl"))
summary = {
    "verifier": curve(verifier),
    "static_rm": curve(static / "metrics.jsonl"),
    "iterated_rm": curve(it / "run" / "metrics.jsonl"),
    "iterated_rounds": [{"round": r, "pairs": sum(1 for _ in open(it / f"pairs_{r}.jsonl")),
                         "rm_on_policy_pair_accuracy": pair_accuracy(it / f"rm_{r}", it / f"pairs_{r}.jsonl")}
                        for r in rounds],
}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
for name, src in (("iterated", it / "run" / "metrics.jsonl"), ("static", static / "metrics.jsonl")):
    shutil.copy(src, out / f"{name}_metrics.jsonl")

import matplotlib  # noqa: E402
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(7, 4))
for key, label in (("verifier", "verifier reward (main job)"), ("static_rm", "RM alone, trained once"),
                   ("iterated_rm", "RM alone, retrained on the policy's samples every 25 steps")):
    steps, acc = zip(*summary[key])
    ax.plot(steps, acc, marker=".", label=label)
ax.set_xlabel("RL step"); ax.set_ylabel("held-out exact-match (greedy)"); ax.set_ylim(0, 1); ax.grid(alpha=0.3)
ax.legend(fontsize=8)
fig.tight_layout(); fig.savefig(out / "curves.png", dpi=120)
print(json.dumps({k: v[-1] for k, v in summary.items() if k != "iterated_rounds"}),
      [round(r["rm_on_policy_pair_accuracy"], 3) for r in summary["iterated_rounds"]])
