"""The probe's shared inputs in its temp folder (Ctx): the reward module, the tiny models, a tiny run config,
`megapo` run with the probe's environment, and a finished two-step run with checkpoints, each built on
first use and shared by the cases (in threads) that need it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from pathlib import Path

from tools.probe.outcomes import CONFIG_TIMEOUT_S, MEGAPO, PYTHON, ROOT, RUN_TIMEOUT_S, Outcome, run


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
