"""Run metrics: one JSON line per step always (`metrics.jsonl`), TensorBoard when installed, W&B optional.

    logger = MetricsLogger(run_dir, backends=["jsonl", "tensorboard"], config=cfg_dict)
    timer = StepTimer()
    with timer("generate"): ...
    logger.log(step, {"reward": 0.5, "kl": 0.01, **timer.pop()}, tokens=n_tokens)

A requested backend that is not installed is reported once (logging.WARNING), never silently dropped.
Key names the plotter reads: reward, response_len, kl, eval/accuracy.
"""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from megapo.progress import Progress

log = logging.getLogger(__name__)


def _plain(value: Any) -> Any:
    """Python scalars for JSON (0-d tensors and numpy scalars become floats)."""
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (ValueError, RuntimeError):
            return value
    return value


class StepTimer:
    """Wall-clock seconds per named phase of a step: `with timer("generate"): ...`."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.times.items()}
        out["time/step"] = sum(self.times.values())
        self.times = {}
        return out


class MetricsLogger:
    def __init__(self, run_dir: str | Path, backends: list[str] | tuple[str, ...] = ("jsonl",),
                 config: dict | None = None, total_steps: int | None = None, print_fn=print):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.print_fn = print_fn
        # the step lines as they are; on a terminal (print to stdout) a bar with the ETA below them
        self.progress = Progress(total_steps, "train") if print_fn is print else None
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self._tb = None
        self._wandb = None
        if "tensorboard" in backends:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:
                log.warning("metrics: tensorboard requested but not installed; logging to metrics.jsonl only")
        if "wandb" in backends:
            try:
                import wandb  # type: ignore

                self._wandb = wandb.init(project="megapo", dir=str(self.run_dir), config=config or {})
            except ImportError:
                log.warning("metrics: wandb requested but not installed; logging to metrics.jsonl only")
        self.active = ["jsonl"] + (["tensorboard"] if self._tb else []) + (["wandb"] if self._wandb else [])

    def log(self, step: int, metrics: dict[str, Any], tokens: int | None = None, progress: bool = True) -> dict:
        row = {k: _plain(v) for k, v in metrics.items()}
        if tokens is not None and row.get("time/step"):
            row["tokens_per_s"] = tokens / row["time/step"]
        row = {"step": step, "time": time.time(), **row}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if progress and self.progress is not None:
            self.progress.line(progress_line(step, row, self.total_steps), done=step)
        elif progress:
            self.print_fn(progress_line(step, row, self.total_steps))
        return row

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _fmt(value: float) -> str:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)
    if abs(value) >= 1000:
        return f"{value / 1000:.1f}k"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def progress_line(step: int, row: dict, total: int | None = None) -> str:
    """`step 12/300 | reward 0.531 | kl 0.0012 | 5.2k tok/s | gen 0.10s train 0.12s ...`"""
    parts = [f"step {step}/{total}" if total else f"step {step}"]
    for key, label in (("reward", "reward"), ("kl", "kl"), ("response_len", "len"), ("eval/accuracy", "eval acc")):
        if key in row and isinstance(row[key], (int, float)):
            parts.append(f"{label} {_fmt(row[key])}")
    if "tokens_per_s" in row:
        parts.append(f"{_fmt(row['tokens_per_s'])} tok/s")
    times = [f"{k[5:]} {v:.2f}s" for k, v in row.items() if k.startswith("time/") and k != "time/step"]
    if times:
        parts.append(" ".join(times))
    return " | ".join(parts)


def length_metrics(lengths: list[int], difficulties: list[int | None]) -> dict[str, float]:
    """Response lengths in tokens: len/mean and len/p90 over all, and len/d{k} / len/d{k}_p90 over the responses
    of difficulty bucket k (examples without a bucket count only in the totals). p90: linear interpolation
    between the closest ranks (numpy's default percentile)."""
    import numpy as np

    if not lengths:
        return {}
    out = {"len/mean": float(np.mean(lengths)), "len/p90": float(np.percentile(lengths, 90))}
    for k in sorted({d for d in difficulties if d is not None}):
        bucket = [n for n, d in zip(lengths, difficulties) if d == k]
        out[f"len/d{k}"] = float(np.mean(bucket))
        out[f"len/d{k}_p90"] = float(np.percentile(bucket, 90))
    return out


class SampleLogger:
    """train.log_samples: appends one JSON row per trained response to run_dir/samples.jsonl, each step's rows
    written and flushed together (a resumed run first drops the rows after its checkpoint: run_dir.started)."""

    def __init__(self, run_dir: str | Path, tokenizer):
        self.tokenizer = tokenizer
        self._file = open(Path(run_dir) / "samples.jsonl", "a", encoding="utf-8")

    def log(self, step: int, groups: list) -> None:
        lines = [json.dumps(self.row(step, g, i)) + "\n" for g in groups for i in range(len(g.samples))]
        self._file.write("".join(lines))
        self._file.flush()

    def row(self, step: int, g, i: int) -> dict:
        s = g.samples[i]
        return {"step": step, "prompt_id": g.prompt_index, "sample": g.sample_ids[i] if g.sample_ids else i,
                "prompt_ids": list(s.prompt_ids), "response_ids": list(s.output_ids),
                "prompt": g.example.prompt, "response": self.tokenizer.decode(s.output_ids, skip_special_tokens=True),
                "reward": g.scores[i] if g.scores is not None else g.rewards[i], "shaped_reward": g.rewards[i],
                "weight_version": s.weight_version, "finish_reason": s.finish_reason, **self.turns(s),
                **({"token_versions": list(s.token_versions)} if getattr(s, "token_versions", None) else {}),
                # hdpo's privileged rollouts: drawn with the reference answer in the prompt, trained behind this one
                **({"privileged": True} if g.privileged else {}),
                # stage anytime's summaries: drawn after the thinking cut at a budget and the trigger (prompt_ids)
                **({"summary": True} if getattr(g.anytime, "slots", None) is not None else {})}

    def turns(self, s) -> dict:
        """A multi-turn trajectory's turns in order (role policy | env, text), why it ended, its tool calls."""
        if not hasattr(s, "segments"):
            return {}
        return {"turns": [{"role": "policy" if policy else "env", "text": self.tokenizer.decode(ids)}
                          for policy, ids in s.segments()], "finish": s.finish, "tool_calls": s.tool_calls}

    def close(self) -> None:
        self._file.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of a run's metrics.jsonl. A cut-off last line (a run still writing) is skipped with a
    warning; a damaged line elsewhere raises ConfigError naming the file and line."""
    from megapo.trainer.data import read_jsonl

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    return [row for _, row in read_jsonl(path, "run_dir", skip_cut_tail=True)]
