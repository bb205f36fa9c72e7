"""PPO with a critic in `megapo train` (algorithm.critic, algorithm.advantage=gae; megapo/trainer/critic_step.py).

- gae_targets: the policy's advantages and the critic's returns from an outcome reward on the last token, written
  out for lambda = 1 (returns = the reward at every token, advantages = reward - V_t) and lambda = 0 (one-step TD).
- A tiny run starting the critic from the policy's own folder: the critic trains every step (critic/* metrics), the
  policy waits during the critic's warm-up, and a run stopped after a checkpoint and resumed gives the same critic
  and policy metrics as the uninterrupted run (the critic and its optimizer travel in the checkpoint).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megapo.trainer.critic_step import gae_targets
from train_runs import train_rows


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


CRITIC = ["algorithm.advantage=gae", "algorithm.critic.path=policy", "algorithm.critic.lr=1e-3",
          "algorithm.critic.warmup_steps=1", "algorithm.critic.lam_policy=0.95", "train.seed=3"]


def test_critic_trains_waits_out_its_warmup_and_resumes_exactly(tmp_path, tiny_moe):
    full = train_rows(tmp_path, "full", f"model.path={tiny_moe}", "train.steps=4", *CRITIC)
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    assert all("critic/loss" in r and "critic/explained_variance" in r for r in full)
    assert full[0].get("critic/warmup") == 1 and "train/loss" not in full[0]  # step 1: only the critic moved
    assert all("train/loss" in r for r in full[1:])
    assert full[0]["critic/values_mean"] == 0.0  # a causal-LM start: the value head begins at zeros
    assert full[1]["critic/values_mean"] != 0.0
    # stopped after step 2's checkpoint, then resumed for steps 3-4
    first = train_rows(tmp_path, "half", f"model.path={tiny_moe}", "train.steps=2", "train.ckpt_every=2", *CRITIC)
    assert len(first) == 2
    rest = train_rows(tmp_path, "half", f"model.path={tiny_moe}", "train.steps=4", "train.ckpt_every=2", *CRITIC,
                      "--resume")
    by_step = {r["step"]: r for r in rest}
    for step in (3, 4):
        for key in ("critic/loss", "critic/values_mean", "train/loss", "train/grad_norm"):
            # the tolerance of tests/test_trainer_resume.py; a critic restarted from its start would be far off
            assert by_step[step][key] == pytest.approx(full[step - 1][key], rel=1e-6, abs=1e-9), (step, key)


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
