"""Shared fixtures: tiny models are built once per session into a temp folder (nothing is downloaded)."""

import os

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
