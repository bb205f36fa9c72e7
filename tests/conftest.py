"""Shared fixtures: tiny models are built once per session into a temp folder (nothing is downloaded)."""

import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """tiny_model_factory(family="qwen3_moe", **kwargs) -> folder; identical requests share one folder."""
    from megapo.models.tiny import write_tiny_model

    cache = {}

    def make(family: str = "qwen3_moe", **kwargs):
        key = (family, tuple(sorted(kwargs.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny_{family}")
            cache[key] = write_tiny_model(out, family, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_moe(tiny_model_factory):
    return tiny_model_factory("qwen3_moe")


@pytest.fixture(scope="session")
def tiny_dense(tiny_model_factory):
    return tiny_model_factory("qwen2")


# Reward of the trainer tests: parity of the response's characters. About half the samples score, so
# advantages are non-zero even on a random model (exact match would give all-zero rewards and no update).
PARITY_REWARD = "def parity(response, answer):\n    return float(sum(map(ord, response)) % 2)\n"


@pytest.fixture()
def reward_module(tmp_path, monkeypatch):
    """`data.reward` of a user reward function (`module:function`) importable for this test only."""
    (tmp_path / "parity_test_reward.py").write_text(PARITY_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "parity_test_reward:parity"
    sys.modules.pop("parity_test_reward", None)


@pytest.fixture
def no_launch(monkeypatch):
    """Fails the test if `megapo logprobs` would start a process or build a learner."""
    import launch.local
    from megapo.learner import logprobs_cmd

    def refuse(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(launch.local, "run_torchrun", refuse)
    monkeypatch.setattr(logprobs_cmd, "_work", refuse)
