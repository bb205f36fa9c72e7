"""Shared fixtures: tiny models are built once per session into a temp folder (nothing is downloaded)."""

import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Two workers share two cores: one OpenMP thread per process (subprocesses inherit it; a test that needs more sets
# its own). A second thread mostly spins between a tiny model's ops: two concurrent tiny `megapo train` runs took
# 21-23 s of CPU each with two threads, 11-12 s with one, and 38 s against 28 s of wall time.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The README runs the suite on two workers, a module each (`-n 2 --dist loadfile`), handed out in collection
# order: the slowest modules go first so that the last one to start is short (longest-first scheduling). From
# `--durations` on the 2-core machine, slowest first; the other modules keep their order after them.
SLOW_MODULES = ("test_vllm_server.py", "test_slurm_real.py", "test_rm_train.py",
                "test_learner_layouts.py", "test_trainer_vllm.py", "test_family_replay.py", "test_gpu_check.py",
                "test_critic_loop.py", "test_worker_errors.py", "test_deepseek_v3.py", "test_trainer_resume.py",
                "test_convert.py", "test_deepseek_moe_convert.py", "test_replay_layouts.py", "test_precision.py",
                "test_learner.py", "test_trainer_distributed.py", "test_shared_prefix.py", "test_compat.py",
                "test_bench_scaling.py", "test_critic.py", "test_reward_model_http.py",
                "test_reference.py", "test_trainer_robust.py", "test_gpt_oss.py", "test_family_engines.py")


def pytest_configure(config):
    # xdist would otherwise reorder the modules by their number of tests, which puts the few slow ones last
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    first = {name: i for i, name in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: a module's tests stay in order


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
def user_module(tmp_path, monkeypatch):
    """user_module(name, source) -> name: a Python module (a user reward function, ...) importable for this
    test only: written to tmp_path, on sys.path, and forgotten by sys.modules afterwards."""
    written = []

    def make(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        written.append(name)
        return name

    yield make
    for name in written:
        sys.modules.pop(name, None)


@pytest.fixture()
def reward_module(user_module):
    """`data.reward` of a user reward function (`module:function`) importable for this test only."""
    return f"{user_module('parity_test_reward', PARITY_REWARD)}:parity"


@pytest.fixture
def no_launch(monkeypatch):
    """Fails the test if `megapo logprobs` would start a process or build a learner."""
    import megapo.launch.local
    from megapo.commands import logprobs as logprobs_cmd

    def refuse(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(megapo.launch.local, "run_torchrun", refuse)
    monkeypatch.setattr(megapo.launch.local, "run_workers", refuse)
    monkeypatch.setattr(logprobs_cmd, "_work", refuse)
