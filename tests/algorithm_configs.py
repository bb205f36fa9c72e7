"""The small run config the algorithm tests check options against (tests/test_*_methods.py, test_*stages.py,
test_fipo.py, test_objectives_*.py, ...): an addition task on an embedded engine with the given algorithm fields;
make_cfg validates its algorithm section, so a bad option raises ConfigError naming the dotted field."""

from __future__ import annotations


def config_data(*, n_samples: int = 4, seed: int | None = None, objective: str | None = "ppo", **algorithm) -> dict:
    """The config as a dict: `objective` (None: RunConfig's default), grpo unless `algorithm` says otherwise, the
    other algorithm fields; rollout.n_samples and train.seed as given."""
    train = {"steps": 3, "output_dir": "/tmp/unused", **({} if seed is None else {"seed": seed})}
    return {
        "model": {"path": "/nonexistent"},
        "algorithm": {**({} if objective is None else {"objective": objective}), "advantage": "grpo", **algorithm},
        "rollout": {"engine": "embedded", "n_samples": n_samples, "max_new_tokens": 8},
        "data": {"task": "addition", "max_prompt_tokens": 16, "prompts_per_step": 8},
        "train": train,
    }


def make_cfg(**fields):
    """config_data(**fields) as a RunConfig, its algorithm section validated."""
    from megapo.config import from_dict
    from megapo.trainer.config import RunConfig

    cfg = from_dict(RunConfig, config_data(**fields))
    cfg._validate_algorithm()
    return cfg


def refusal(data: dict):
    """The ConfigError the run config `data` raises, built and its algorithm and train sections validated (it must
    raise one)."""
    import pytest

    from megapo.config import ConfigError, from_dict
    from megapo.trainer.config import RunConfig

    with pytest.raises(ConfigError) as err:
        cfg = from_dict(RunConfig, data)
        cfg._validate_algorithm()
        cfg._validate_train()
    return err.value
