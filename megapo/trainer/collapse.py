"""The collapse rule of the stability study (`megapo bench stability`), over a run's metrics rows.

A run has collapsed at the first step where any of these holds:
- held-out accuracy: `eval/accuracy` below the run's first one (its start) minus `accuracy_drop` (0.1) and still
  below it at the run's last eval; the step reported is the first eval of that final stretch. A dip the run
  recovers from is not a collapse (the study's first grid saw runs fall 0.1 at step 10 and end above their
  start); `accuracy_dip` reports the first dip on its own;
- training reward: `reward` below `reward_floor` (0.05) on `reward_window` (10) consecutive logged steps;
  the step reported is the first of those steps (where the reward fell), found once the window is full;
- loss: a non-finite `train/loss`, or a step whose update the learner skipped for one (`train/skipped_nonfinite`).

    verdict = detect_collapse(read_metrics(run_dir))   # rows as megapo.trainer.metrics writes them
    verdict.collapsed, verdict.step, verdict.reason

During a run the trainer logs the verdict so far every step (`CollapseWatch`): `collapse/collapsed` (1 once the
rule has fired) and, then, `collapse/step` (where; a reward collapse is dated to the first of its low steps).

Rows logged twice for one step (a resumed run logs the steps after its checkpoint again) count once, the
last one written, as in `megapo plot`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

ACCURACY_KEY = "eval/accuracy"
REWARD_KEY = "reward"
LOSS_KEY = "train/loss"
SKIPPED_KEY = "train/skipped_nonfinite"


class Collapse(NamedTuple):
    collapsed: bool
    step: int | None  # where it happened (None when it did not)
    reason: str  # "accuracy", "reward" or "loss"; "" when it did not


NOT_COLLAPSED = Collapse(False, None, "")


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def rows_by_step(rows: list[dict]) -> list[dict]:
    """One row per step (the last one written for a step), in step order."""
    last: dict[int, dict] = {}
    for row in rows:
        last[int(row["step"])] = row
    return [last[s] for s in sorted(last)]


def _evals(rows: list[dict]) -> list[tuple[int, float]]:
    return [(int(row["step"]), acc) for row in rows if (acc := _number(row.get(ACCURACY_KEY))) is not None]


def accuracy_dip(rows: list[dict], drop: float = 0.1) -> int | None:
    """The first step whose held-out accuracy is below the start minus `drop`, recovered from or not."""
    evals = _evals(rows_by_step(rows))
    return next((step for step, acc in evals[1:] if acc < evals[0][1] - drop), None)


def _accuracy_drop(rows: list[dict], drop: float) -> int | None:
    evals = _evals(rows)
    if len(evals) < 2:
        return None
    threshold, first_low = evals[0][1] - drop, None
    for step, acc in evals[1:]:
        first_low = (first_low if first_low is not None else step) if acc < threshold else None
    return first_low


def _reward_floor(rows: list[dict], floor: float, window: int) -> int | None:
    run_start, run_len = None, 0
    for row in rows:
        reward = _number(row.get(REWARD_KEY))
        if reward is None:  # an eval-only row (step 0): not a training step
            continue
        if reward < floor:
            run_start = int(row["step"]) if run_len == 0 else run_start
            run_len += 1
            if run_len >= window:
                return run_start
        else:
            run_len = 0
    return None


def _nonfinite_loss(rows: list[dict]) -> int | None:
    for row in rows:
        loss = _number(row.get(LOSS_KEY))
        skipped = _number(row.get(SKIPPED_KEY))
        if (loss is not None and not math.isfinite(loss)) or (skipped is not None and skipped > 0):
            return int(row["step"])
    return None


def detect_collapse(rows: list[dict], accuracy_drop: float = 0.1, reward_floor: float = 0.05,
                    reward_window: int = 10) -> Collapse:
    """The earliest collapse in `rows` (metrics rows with a "step"), or NOT_COLLAPSED. On a tie the reason
    listed first wins: loss, accuracy, reward."""
    rows = rows_by_step(rows)
    found = [(step, reason) for step, reason in ((_nonfinite_loss(rows), "loss"),
                                                 (_accuracy_drop(rows, accuracy_drop), "accuracy"),
                                                 (_reward_floor(rows, reward_floor, reward_window), "reward"))
             if step is not None]
    if not found:
        return NOT_COLLAPSED
    step, reason = min(found, key=lambda f: f[0])  # min keeps the first listed of equal steps
    return Collapse(True, step, reason)


def run_collapse(run_dir: str | Path, **rule) -> Collapse:
    """detect_collapse over `run_dir`/metrics.jsonl (a cut-off last line, from a run still writing, is skipped)."""
    from megapo.trainer.metrics import read_metrics

    return detect_collapse(read_metrics(run_dir), **rule)


class CollapseWatch:
    """The collapse rule applied as a run goes: `add(step, metrics)` returns the metrics with the verdict so far
    (`collapse/collapsed`, and `collapse/step` once collapsed). Keeps only the keys the rule reads."""

    KEYS = (ACCURACY_KEY, REWARD_KEY, LOSS_KEY, SKIPPED_KEY)

    def __init__(self, rows=(), upto: int | None = None):
        """`rows`: the run's earlier metrics rows (a resumed run), those after step `upto` dropped (the resume
        logs them again)."""
        self.rows = [self._slim(int(r["step"]), r) for r in rows if upto is None or int(r["step"]) <= upto]

    def _slim(self, step: int, metrics: dict) -> dict:
        return {"step": step, **{k: metrics[k] for k in self.KEYS if k in metrics}}

    def add(self, step: int, metrics: dict) -> dict:
        self.rows.append(self._slim(step, metrics))
        verdict = detect_collapse(self.rows)
        flag = {"collapse/collapsed": int(verdict.collapsed)}
        if verdict.collapsed:
            flag["collapse/step"] = verdict.step
        return {**metrics, **flag}
