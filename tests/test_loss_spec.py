"""LossSpec (megapo/algorithms/spec.py): one checked value for the run's loss, built from the config once.

- every bad field is refused when the spec is built: LossSpecError (a ValueError) whose `field` is the spec
  field and whose message starts with the argument's name;
- RunConfig.loss_spec maps the spec's fields from the algorithm / train sections (the rules written out here:
  correction from algorithm.mismatch or the async default, the KL term only without the stage future_kl) and a refused
  spec is a ConfigError naming the config field;
- the spec is frozen and keeps copies of its option dicts; policy_loss / LossSpec.of take the flat form, and
  refuse options beside a spec.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import algorithm_configs  # noqa: E402

from megapo.algorithms import policy_loss  # noqa: E402
from megapo.algorithms.spec import LossSpec, LossSpecError  # noqa: E402
from megapo.config import ConfigError, from_dict  # noqa: E402
from megapo.trainer.config import RunConfig  # noqa: E402

config_data = partial(algorithm_configs.config_data, objective=None)  # RunConfig's default objective

BAD_SPECS = [
    (dict(objective="nope"), "objective", "objective"),
    (dict(objective="ppo", loss_agg="mean"), "loss_agg", "loss_agg"),
    (dict(objective="ppo", objective_options={"eps_lowx": 0.1}), "objective_options", "options"),
    (dict(objective="ppo", objective_options={"eps_low": -0.1}), "objective_options", "eps_low"),
    (dict(objective="ppo", objective_options=[("eps_low", 0.1)]), "objective_options", "objective_options"),
    (dict(objective="ppo", correction="zzz"), "correction", "correction"),
    (dict(objective="ppo", correction_options={"cap": 2.0}), "correction_options", "correction_options"),
    (dict(objective="ppo", correction="tis", correction_options={"cup": 2.0}), "correction_options", "options"),
    (dict(objective="ppo", correction="tis", correction_options={"cap": 0}), "correction_options", "cap"),
    (dict(objective="ppo", kl_coef="big"), "kl_coef", "kl_coef"),
    (dict(objective="ppo", kl_coef=math.nan), "kl_coef", "kl_coef"),
    (dict(objective="ppo", entropy_coef=math.inf), "entropy_coef", "entropy_coef"),
    (dict(objective="ppo", kl_estimator="k9"), "kl_estimator", "kl_estimator"),
    (dict(objective="ppo", kl_estimator="entropy"), "kl_estimator", "kl_estimator"),
    (dict(objective="ppo", max_len=0), "max_len", "max_len"),
]


@pytest.mark.parametrize("kwargs, field_name, starts", BAD_SPECS,
                         ids=[f"{i}-{f}" for i, (_, f, _) in enumerate(BAD_SPECS)])
def test_bad_spec_names_its_field(kwargs, field_name, starts):
    with pytest.raises(LossSpecError) as err:
        LossSpec(**kwargs)
    assert err.value.field == field_name
    assert str(err.value).startswith(starts), str(err.value)
    assert isinstance(err.value, ValueError)


def test_spec_is_frozen_and_keeps_its_own_options():
    given = {"eps_high": 0.28}
    spec = LossSpec("ppo", "token-mean", given)
    given["eps_high"] = 5.0
    assert spec.objective_options == {"eps_high": 0.28}
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.kl_coef = 1.0  # type: ignore[misc]


def test_of_splits_flat_options_into_fields():
    spec = LossSpec.of("ppo", "seq-mean-token-mean", eps_high=0.28, correction="tis", correction_options={"cap": 2.0},
                       kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    assert spec == LossSpec("ppo", "seq-mean-token-mean", {"eps_high": 0.28}, "tis", {"cap": 2.0}, 0.1, "k1", 0.01)


def _args():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(2, 4, generator=g, dtype=torch.float64)
    old = logp - 0.05 * torch.rand(2, 4, generator=g, dtype=torch.float64)
    return logp, old, torch.tensor([[1.0] * 4, [-0.5] * 4], dtype=torch.float64), torch.ones(2, 4)


def test_policy_loss_takes_a_spec_and_refuses_options_beside_it():
    logp, old, adv, mask = _args()
    spec = LossSpec("ppo", "token-mean", {"eps_low": 0.01, "eps_high": 0.01})
    loss, _ = policy_loss(spec, logp, old, adv, mask)
    # PPO token-mean written out: mean over tokens of -min(ρA, clip(ρ, 0.99, 1.01)A)
    rho = (logp - old).exp()
    expected = -torch.minimum(rho * adv, rho.clamp(0.99, 1.01) * adv).mean()
    assert float(loss) == pytest.approx(float(expected), rel=1e-12)
    with pytest.raises(ValueError, match=r"^options: \['eps_high'\]"):
        policy_loss(spec, logp, old, adv, mask, eps_high=0.2)
    with pytest.raises(ValueError, match=r"^options: \['loss_agg'\]"):
        policy_loss(spec, logp, old, adv, mask, loss_agg="token-mean")


def _cfg(**algorithm) -> RunConfig:
    return from_dict(RunConfig, config_data(**algorithm))


def test_config_builds_the_spec_field_by_field():
    cfg = _cfg(objective="ppo", objective_options={"eps_high": 0.28}, loss_agg="token-mean", mismatch="tis",
               mismatch_options={"cap": 3.0}, kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    assert cfg.loss_spec() == LossSpec("ppo", "token-mean", {"eps_high": 0.28}, "tis", {"cap": 3.0}, 0.1, "k1", 0.01)
    # stage future_kl: the KL lives in the advantages, no loss term (the kl metric on k3)
    future = _cfg(kl_coef=0.1, kl_estimator="k1", stages=[{"name": "future_kl"}]).loss_spec()
    assert (future.kl_coef, future.kl_estimator) == (0.0, "k3")
    # async with π_old from the learner: stale samples get the TIS correction; sync and engine π_old: none
    data = config_data()
    data["train"].update(mode="async")
    assert from_dict(RunConfig, data).loss_spec().correction is None
    data["algorithm"]["old_policy"] = "learner"
    assert from_dict(RunConfig, data).loss_spec().correction == "tis"
    assert _cfg().loss_spec() == LossSpec("gspo")


@pytest.mark.parametrize("algorithm, field_name", [
    ({"objective": "ppo", "objective_options": {"eps_low": -0.1}}, "algorithm.objective_options"),
    ({"mismatch": "tis", "mismatch_options": {"cup": 1.0}}, "algorithm.mismatch_options"),
    ({"mismatch": "tis", "mismatch_options": {"cap": 0}}, "algorithm.mismatch_options"),
])
def test_config_error_names_the_config_field(algorithm, field_name):
    with pytest.raises(ConfigError) as err:
        _cfg(**algorithm)._validate_algorithm()
    assert err.value.field == field_name, str(err.value)


def test_async_correction_error_names_the_train_field():
    data = config_data()
    data["train"].update(mode="async", async_correction="zzz")
    with pytest.raises(ConfigError) as err:
        from_dict(RunConfig, data).loss_spec()
    assert err.value.field == "train.async_correction"
