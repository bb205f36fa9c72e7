"""The engine registry: each engine class declares what it can do, the declarations agree with the methods the
class has (the calls the trainer makes on them, docs/CONTRACTS.md), a Router can do what all its engines can,
and config validation follows the declarations (changing one changes what validation accepts)."""

from __future__ import annotations

import dataclasses

import pytest

from megapo.config import ConfigError, load_config
from megapo.engines.base import EngineCapabilities
from megapo.engines.registry import capabilities, engine_class, engine_names, needs_servers
from megapo.trainer.config import RunConfig

# capability -> the members an engine declaring it must have (what the trainer calls when it is declared)
MEMBERS = {
    "rng_state": ("rng_state", "set_rng_state"),
    "api_key": ("check_access",),
    "sessions": ("end_sessions",),
    "partial": ("preempt", "max_versions"),
}
BROADCAST_MEMBERS = ("join_weight_groups", "receive_weights", "workers")


@pytest.mark.parametrize("name", engine_names())
def test_declared_capabilities_match_the_class(name):
    cls, caps = engine_class(name), capabilities(name)
    assert isinstance(caps, EngineCapabilities) and caps is cls.capabilities
    for flag, members in MEMBERS.items():
        for member in members:
            assert hasattr(cls, member) == getattr(caps, flag), f"{name}: {flag}={getattr(caps, flag)} but {member}"
    for member in BROADCAST_MEMBERS:
        assert hasattr(cls, member) == ("broadcast" in caps.weight_syncs), f"{name}: broadcast vs {member}"
    assert caps.default_dtype in ("float32", "bfloat16", "float16")


def test_the_table():
    assert engine_names() == ("embedded", "vllm", "sglang")
    assert capabilities("embedded").in_process and capabilities("embedded").rng_state
    assert not needs_servers("embedded") and not needs_servers("vllm") and needs_servers("sglang")
    with pytest.raises(ValueError, match="unknown engine 'tgi'; choose from embedded, vllm, sglang"):
        engine_class("tgi")
    with pytest.raises(ValueError, match="routes must be one of"):
        EngineCapabilities(routes="sometimes")


def test_routes_on_cuda_only(monkeypatch):
    import torch

    caps = EngineCapabilities(routes="cuda", routes_note="needs a GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert caps.returns_routes() == (False, "needs a GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert caps.returns_routes() == (True, "")
    assert EngineCapabilities(routes="no", routes_note="never").returns_routes() == (False, "never")


def test_router_can_do_what_all_its_engines_can():
    from megapo.engines.router import Router
    from megapo.engines.sglang import SGLangEngine
    from megapo.engines.vllm import VLLMEngine

    both = Router([VLLMEngine("http://127.0.0.1:1"), SGLangEngine("http://127.0.0.1:2")]).capabilities
    assert both.weight_syncs == ("disk",)  # vllm: disk, broadcast; sglang: tensor, disk
    assert both.routes == "cuda" and "Triton" in both.routes_note  # sglang: yes, vllm: on CUDA only
    assert both.sessions and both.api_key and not both.in_process and not both.rng_state
    two_vllm = Router([VLLMEngine("http://127.0.0.1:1"), VLLMEngine("http://127.0.0.1:3")]).capabilities
    assert two_vllm.weight_syncs == ("disk", "broadcast")


def _config(tiny_moe, tmp_path, **rollout):
    items = {"model.path": str(tiny_moe), "algorithm.routing_replay": "r3", "rollout.n_samples": 4,
             "rollout.max_new_tokens": 8, "data.task": "addition", "data.max_prompt_tokens": 16,
             "data.prompts_per_step": 8, "train.steps": 3, "train.output_dir": str(tmp_path / "run")}
    items.update({f"rollout.{k}": v for k, v in rollout.items()})
    return load_config(RunConfig, None, [f"{k}={v}" for k, v in items.items()])


def test_validation_follows_the_declarations(tiny_moe, tmp_path, monkeypatch):
    from megapo.engines.embedded import EmbeddedEngine

    assert _config(tiny_moe, tmp_path).rollout.compute_dtype() == "float32"
    with pytest.raises(ConfigError) as err:
        _config(tiny_moe, tmp_path, weight_sync="broadcast")
    assert err.value.field == "rollout.weight_sync" and "supports tensor, disk" in str(err.value)

    declared = EmbeddedEngine.capabilities
    monkeypatch.setattr(EmbeddedEngine, "capabilities", dataclasses.replace(
        declared, weight_syncs=("disk",), routes="no", routes_note="it forgot", default_dtype="bfloat16"))
    with pytest.raises(ConfigError) as err:
        _config(tiny_moe, tmp_path)  # rollout.weight_sync=tensor, the default
    assert err.value.field == "rollout.weight_sync" and "supports disk, not 'tensor'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        _config(tiny_moe, tmp_path, weight_sync="disk")  # r3 with an engine that returns no routes
    assert err.value.field == "algorithm.routing_replay" and "it forgot" in str(err.value)
    monkeypatch.setattr(EmbeddedEngine, "capabilities", dataclasses.replace(declared, default_dtype="bfloat16"))
    assert _config(tiny_moe, tmp_path).rollout.compute_dtype() == "bfloat16"
