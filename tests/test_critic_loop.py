"""PPO with a critic in `megapo train` (algorithm.critic, algorithm.advantage=gae; megapo/trainer/critic_step.py).

- gae_targets: the policy's advantages and the critic's returns from an outcome reward on the last token, written
  out for lambda = 1 (returns = the reward at every token, advantages = reward - V_t) and lambda = 0 (one-step TD).
- A tiny run starting the critic from the policy's own folder: the critic trains every step (critic/* metrics), the
  policy waits during the critic's warm-up, and a copy of the run cut back to its step-2 checkpoint (as a run stopped
  there leaves it) and resumed gives the same critic and policy metrics as the uninterrupted run (the critic and its
  optimizer travel in the checkpoint).
- The same under TP=2 x EP=2 with routing replay r3 (`megapo launch local --nproc 2`, the critic replaying the
  policy's routes): a 3-step run checkpointing every step, and a copy of it cut back to its step-1 checkpoint and
  resumed, log the same steps 2 and 3 (both optimizers hold Adam moments at step 1: no critic warm-up here).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megapo.trainer.critic_step import gae_targets
from train_runs import CONFIG, PARITY, ROOT, train_rows


def flat(rows):
    return [x for row in rows for x in row]


def cfg(**kw):
    base = dict(gamma=1.0, lam_policy=1.0, lam_critic=1.0, adaptive_alpha=0.0)
    return SimpleNamespace(**{**base, **kw})


def test_gae_targets_of_an_outcome_reward():
    values = [torch.tensor([0.1, 0.4, -0.2]), torch.tensor([0.5])]
    rewards = [1.0, 0.0]
    adv, ret = gae_targets(values, rewards, cfg())
    assert ret == [[1.0, 1.0, 1.0], [0.0]]  # lambda 1, gamma 1: every token's return is the outcome
    assert flat(adv) == pytest.approx([0.9, 0.6, 1.2, -0.5])  # R - V_t
    adv, ret = gae_targets(values, rewards, cfg(lam_policy=0.0, lam_critic=0.0, gamma=0.5))
    # one-step TD: delta_t = r_t + gamma V_{t+1} - V_t, the reward only at the last token, V after it 0
    want = [[0.5 * 0.4 - 0.1, 0.5 * -0.2 - 0.4, 1.0 + 0.2], [0.0 - 0.5]]
    assert flat(adv) == pytest.approx(flat(want))
    assert flat(ret) == pytest.approx([a + v for row, vals in zip(want, values) for a, v in zip(row, vals.tolist())])


# a small batch (4 prompts x 4 samples, as the TP=2 x EP=2 run below takes 2 x 4): what is checked (which steps
# train what, and a resume that reproduces them) does not need the main job's 64 x 8 samples per step
CRITIC = ["algorithm.advantage=gae", "algorithm.critic.path=policy", "algorithm.critic.lr=1e-3",
          "algorithm.critic.warmup_steps=1", "algorithm.critic.lam_policy=0.95", "train.seed=3",
          "data.prompts_per_step=4", "rollout.n_samples=4", "rollout.max_new_tokens=6"]


def stopped_after(run: Path, to: Path, step: int) -> None:
    """`run` copied to `to` as a run stopped after its checkpoint of `step` leaves it: the later checkpoints removed
    (the metrics rows after `step` are the resumed run's to drop, megapo.trainer.run_dir)."""
    shutil.copytree(run, to)
    kept = [c for c in sorted((to / "checkpoints").iterdir()) if int(c.name.rsplit("_", 1)[1]) <= step]
    assert kept and int(kept[-1].name.rsplit("_", 1)[1]) == step, kept
    for later in sorted((to / "checkpoints").iterdir())[len(kept):]:
        shutil.rmtree(later)


def test_critic_trains_waits_out_its_warmup_and_resumes_exactly(tmp_path, tiny_moe):
    full = train_rows(tmp_path, "full", f"model.path={tiny_moe}", "train.steps=4", "train.ckpt_every=2", *CRITIC)
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    assert all("critic/loss" in r and "critic/explained_variance" in r for r in full)
    assert full[0].get("critic/warmup") == 1 and "train/loss" not in full[0]  # step 1: only the critic moved
    assert all("train/loss" in r for r in full[1:])
    assert full[0]["critic/values_mean"] == 0.0  # a causal-LM start: the value head begins at zeros
    assert full[1]["critic/values_mean"] != 0.0
    # the same run as if stopped after step 2's checkpoint, then resumed for steps 3-4
    stopped_after(tmp_path / "full", tmp_path / "half", 2)
    rest = train_rows(tmp_path, "half", f"model.path={tiny_moe}", "train.steps=4", "train.ckpt_every=2", *CRITIC,
                      "--resume")
    by_step = {r["step"]: r for r in rest}
    for step in (3, 4):
        for key in ("critic/loss", "critic/values_mean", "train/loss", "train/grad_norm"):
            # the tolerance of tests/test_trainer_resume.py; a critic restarted from its start would be far off
            assert by_step[step][key] == pytest.approx(full[step - 1][key], rel=1e-6, abs=1e-9), (step, key)


def launch_rows(tmp_path: Path, out: Path, model, resume: bool = False) -> dict[int, dict]:
    """`megapo launch local --nproc 2` of the main job at TP=2 x EP=2 (r3, the config's) with a critic: its rows by
    step; the run must exit 0."""
    (tmp_path / "critic_tp_rewards.py").write_text(PARITY)
    cmd = [sys.executable, "-m", "megapo.cli", "launch", "local", *(["--resume"] if resume else []), str(CONFIG),
           "--nproc", "2", f"model.path={model}", "parallel.tp=2",
           "parallel.ep=2", "algorithm.routing_replay=r3", "sft.enabled=false", f"train.output_dir={out}",
           "train.steps=3", "train.ckpt_every=1", "train.keep_last=3", "train.eval_every=0", "train.log=[jsonl]",
           "data.dynamic_sampling=false", "data.reward=critic_tp_rewards:parity", "data.truncated_reward=null",
           "data.prompts_per_step=2", "rollout.n_samples=4", "rollout.max_new_tokens=6", "optim.warmup_steps=0",
           "algorithm.advantage=gae", "algorithm.critic.path=policy", "algorithm.critic.lr=1e-3",
           "algorithm.critic.warmup_steps=0", "algorithm.critic.lam_policy=0.95", "train.seed=3"]
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len({r["step"] for r in rows}) == len(rows), [r["step"] for r in rows]  # each step logged once
    return {r["step"]: r for r in rows}


def test_critic_under_tp2_ep2_r3_resumes_exactly(tmp_path, tiny_moe):
    full = launch_rows(tmp_path, tmp_path / "full", tiny_moe)
    assert sorted(full) == [1, 2, 3] and all("critic/loss" in r and "train/loss" in r for r in full.values())
    saved = json.loads((tmp_path / "full" / "config.json").read_text())["parallel"]
    assert (saved["tp"], saved["ep"]) == (2, 2)
    assert full[3]["critic/values_mean"] != full[1]["critic/values_mean"]  # the critic trained
    cut = tmp_path / "cut"  # the same run as if stopped after its step-1 checkpoint
    stopped_after(tmp_path / "full", cut, 1)
    rest = launch_rows(tmp_path, cut, tiny_moe, resume=True)
    assert sorted(rest) == [1, 2, 3]  # the resumed run dropped the copied rows of steps 2-3 and logged them anew...
    names = [sorted(c.name for c in (run / "checkpoints").iterdir()) for run in (tmp_path / "full", cut)]
    assert names[0] == names[1] and len(names[1]) == 3  # ...having run them: their checkpoints are back
    keys = [k for k in full[3] if k.startswith(("critic/", "train/", "replay/", "reward")) and "time" not in k
            and not k.endswith("tokens_per_s")]
    assert {"critic/loss", "critic/grad_norm", "train/loss", "train/grad_norm"} <= set(keys)
    for step in (2, 3):
        for key in keys:
            assert rest[step][key] == pytest.approx(full[step][key], rel=1e-6, abs=1e-9), (step, key)


@pytest.mark.parametrize("overrides,field,words", [
    (["algorithm.advantage=gae"], "algorithm.advantage", "needs a critic"),
    (["algorithm.critic.path=policy"], "algorithm.critic.path", "algorithm.advantage=gae"),
    (["algorithm.advantage=gae", "algorithm.critic.path=/nonexistent/critic"], "algorithm.critic.path", "config.json"),
    (["algorithm.advantage=gae", "algorithm.critic.path=policy", "algorithm.advantage_options={eps: 0.1}"],
     "algorithm.advantage_options", "algorithm.critic"),
])
def test_critic_config_refusals_name_the_field(tmp_path, tiny_moe, overrides, field, words):
    from megapo.config import ConfigError, load_config
    from megapo.trainer.config import RunConfig

    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, [f"model.path={tiny_moe}", "data.task=addition",
                                      f"train.output_dir={tmp_path / 'run'}", *overrides])
    assert err.value.field == field and words in str(err.value)
