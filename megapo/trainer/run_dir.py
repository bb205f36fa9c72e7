"""What `megapo train` may find in `train.output_dir`, and what it removes there (docs/CONTRACTS.md, "Error contract").

A folder holds a *previous run* when it has a complete checkpoint under checkpoints/ or a row in metrics.jsonl.

- no flag:      a new run; refused when the folder holds a previous run (pass --resume or --overwrite), so
                two runs never mix checkpoints or metrics.
- --resume:     continue from the newest complete checkpoint. Refused when train.steps is below its step, or
                when the saved config.json names another model (model.path, model.tiny when the model is
                still to be written, sft.enabled) or another expert-parallel kind (parallel.ep 1 vs > 1: the
                optimizer state differs). Metrics rows after the checkpoint's step (steps whose state was
                lost) are dropped, as the resumed run logs them again. With no checkpoint and no step logged
                yet (a requeued job stopped before its first save: the Slurm templates pass --resume on every
                requeue) it starts at step 0 with a warning; with steps logged but no checkpoint the state is
                lost, and it is refused.
- --overwrite:  start over: removes the previous run's artifacts (RUN_ARTIFACTS) and nothing else (logs/, files
                megapo did not write), except a model folder the config points at (model.path inside the
                run folder) and sft/ when the previous config.json made it from the same inputs.

`plan_start` only reads. After every check passed, `begin` (rank 0) removes what --overwrite clears; once the
run has started (a resume has loaded its checkpoint), `started` (rank 0) drops the metrics rows the run logs again
and writes config.json, so a refused or failed start leaves the folder's record as it was.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from megapo.config import ConfigError
from megapo.trainer import checkpoint as ckpt

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"  # train.log_samples: one row per trained response, with its step
CHECKPOINTS = "checkpoints"
SFT_DIR = "sft"
# Everything a run writes into its folder (logs/ is the Slurm templates', written before the trainer starts).
RUN_ARTIFACTS = (CHECKPOINTS, METRICS_FILE, SAMPLES_FILE, "tensorboard", "wandb", CONFIG_FILE, "weights_sync",
                 "vllm-server.log", SFT_DIR)


@dataclass
class RunStart:
    out_dir: Path
    checkpoint: Path | None = None  # resume from it
    step: int = 0  # the checkpoint's step; 0 for a new run
    remove: tuple[Path, ...] = ()  # --overwrite: the previous run's artifacts
    metrics_upto: int | None = None  # rows of later steps are dropped from metrics.jsonl (-1: all); None: untouched


def plan_start(cfg, resume: bool = False, overwrite: bool = False) -> RunStart:
    """Decide how this run starts in `cfg.train.output_dir`, reading only; ConfigError naming the flag or field."""
    out = Path(cfg.train.output_dir)
    if resume and overwrite:
        raise ConfigError("--overwrite", "contradicts --resume: continue the run in the folder, or start over")
    if overwrite:
        return RunStart(out, remove=tuple(_overwritten(out, cfg)))
    checkpoint = ckpt.latest_checkpoint(out / CHECKPOINTS)
    last_logged = _last_logged_step(out / METRICS_FILE)
    if not resume:
        if checkpoint is not None or last_logged is not None:
            held = [f"checkpoint {checkpoint.name}"] if checkpoint is not None else []
            held += [f"{METRICS_FILE} up to step {last_logged}"] if last_logged is not None else []
            raise ConfigError("train.output_dir", f"{out} holds a previous run ({', '.join(held)}); pass --resume to "
                              "continue it or --overwrite to start over")
        return RunStart(out)
    if checkpoint is None:
        if last_logged:
            raise ConfigError("--resume", f"{out} has no complete checkpoint under {CHECKPOINTS}/, but {METRICS_FILE} "
                              f"logs steps up to {last_logged}: that state is lost; pass --overwrite to start over")
        log.warning("--resume: no checkpoint in %s yet; starting at step 0", out / CHECKPOINTS)
        return RunStart(out, metrics_upto=-1 if last_logged is not None else None)
    step = ckpt.step_of(checkpoint)  # a listed checkpoint's name always carries its step
    if cfg.train.steps < step:
        raise ConfigError("train.steps", f"{cfg.train.steps} is below step {step} of the checkpoint to resume "
                          f"({checkpoint}); raise train.steps to continue the run, or pass --overwrite to start over")
    _check_same_run(out, cfg)
    return RunStart(out, checkpoint, step, metrics_upto=step)


def begin(start: RunStart) -> None:
    """Rank 0, after every check: remove what --overwrite clears."""
    for path in start.remove:
        log.info("--overwrite: removing %s", path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def started(start: RunStart, cfg) -> None:
    """Rank 0, once the run has started: drop the metrics and sample rows it logs again, write its config.json."""
    if start.metrics_upto is not None:
        for name in (METRICS_FILE, SAMPLES_FILE):
            trim_metrics(start.out_dir / name, start.metrics_upto)
    start.out_dir.mkdir(parents=True, exist_ok=True)
    tmp = start.out_dir / (CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps(asdict(cfg), indent=1))
    os.replace(tmp, start.out_dir / CONFIG_FILE)


def is_launch_rank0() -> bool:
    """Rank 0 of the launch (torchrun's RANK), also before torch.distributed is initialised."""
    return int(os.environ.get("RANK", "0")) == 0


# ----------------------------------------------------------------------------- helpers


def _rows(path: Path) -> tuple[list[tuple[int, str]], int]:
    """(step, line) of each readable row of metrics.jsonl, and how many lines were unreadable (a cut-off last
    line after a crash)."""
    rows, bad = [], 0
    if not path.is_file():
        return rows, bad
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rows.append((int(json.loads(line)["step"]), line))
        except (ValueError, KeyError, TypeError):
            bad += 1
    return rows, bad


def _last_logged_step(path: Path) -> int | None:
    rows, _ = _rows(path)
    return max((step for step, _ in rows), default=None)


def trim_metrics(path: Path, upto: int) -> None:
    """Keep the rows of steps <= `upto` (none for -1), atomically."""
    rows, bad = _rows(path)
    kept = [line for step, line in rows if step <= upto]
    if len(kept) == len(rows) and not bad:
        return
    log.info("%s: dropping %d row(s) %s%s", path, len(rows) - len(kept), f"after step {upto}" if upto >= 0 else "",
             f" and {bad} unreadable line(s)" if bad else "")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


def _saved_config(out: Path) -> dict | None:
    try:
        return json.loads((out / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _same_path(a: str, b: str) -> bool:
    return a == b or Path(a).resolve() == Path(b).resolve()


def _check_same_run(out: Path, cfg) -> None:
    """The checkpoint must come from this model: compare with the config.json the run saved."""
    saved = _saved_config(out)
    if saved is None:
        log.warning("--resume: %s is missing or unreadable; cannot check that the checkpoint is of this model",
                    out / CONFIG_FILE)
        return
    model, was = cfg.model, saved.get("model") or {}
    differences = []
    if not _same_path(str(was.get("path", "")), model.path):
        differences.append(("model.path", was.get("path"), model.path))
    elif not (Path(model.path) / "config.json").is_file() and model.tiny is not None:  # it will be written again
        if was.get("tiny") != asdict(model.tiny):
            differences.append(("model.tiny", was.get("tiny"), asdict(model.tiny)))
    saved_sft = (saved.get("sft") or {}).get("enabled", False)
    if saved_sft != cfg.sft.enabled:
        differences.append(("sft.enabled", saved_sft, cfg.sft.enabled))
    saved_ep = (saved.get("parallel") or {}).get("ep", 1)
    if (saved_ep > 1) != (cfg.parallel.ep > 1):  # Learner.load: EP=1 and EP>1 chain different optimizers
        differences.append(("parallel.ep", saved_ep, cfg.parallel.ep))
    if differences:
        name, then, now = differences[0]
        raise ConfigError(name, f"--resume: the checkpoints in {out} were made with {name}={then!r}, this config "
                          f"has {now!r}; resume with the same setting, or pass --overwrite to start over")


def _overwritten(out: Path, cfg) -> list[Path]:
    """The previous run's artifacts --overwrite removes: RUN_ARTIFACTS present in `out`, except a folder holding
    model.path and an sft/ warm start the previous run made from the inputs this run would give it."""
    model = Path(cfg.model.path).resolve()
    doomed = []
    for name in RUN_ARTIFACTS:
        path = out / name
        if not (path.exists() or path.is_symlink()):
            continue
        if path.resolve() == model or path.resolve() in model.parents:
            continue
        if name == SFT_DIR and _same_warm_start(_saved_config(out), cfg):
            continue
        doomed.append(path)
    return doomed


def _warm_start_inputs(c: dict) -> dict:
    """What megapo.trainer.sft.train_sft makes sft/ from (run.prepare_model)."""
    data, rollout = c.get("data") or {}, c.get("rollout") or {}
    return {"model": c.get("model"), "sft": c.get("sft"), "task": data.get("task"),
            "task_options": data.get("task_options") or {}, "chat_template": data.get("chat_template"), "max_new_tokens": rollout.get("max_new_tokens")}


def _same_warm_start(saved: dict | None, cfg) -> bool:
    return saved is not None and _warm_start_inputs(saved) == _warm_start_inputs(asdict(cfg))
