"""Routing replay through `megapo logprobs --routes-in / --routes-out` (the learner's RouteReplayHook) on each MoE
family's tiny model: deepseek_v3 (MLA) and glm4_moe (GQA with partial rotary), both the DeepSeekMoE block (dense
first layer, then 3 MoE layers; sigmoid router with an expert bias, 2 routing groups of which a token may use 1,
routed scaling, shared expert), at TP=1, PP=2 (stage 0: the dense layer and the first MoE layer, stage 1: the
other two) and TP=2xEP=2; gpt_oss (2 MoE layers: sliding-window, then full attention; router: a Linear with bias,
top-k of the logits, softmax over those k) at TP=1 and TP=2xEP=2. Routes have one column per MoE layer.

- free: the learner's own routes (recorded, as R2 does) equal transformers' router choice;
- replay: the recorded routes come back exactly when replayed; forced routes (random experts, for the DeepSeekMoE
  block also outside the token's allowed group; partial rows fall back to the router's own choice) come back
  exactly;
- log-probs with routes forced equal the reference: transformers' fp32 forward with each MoE layer's router output
  replaced by the forced experts (tests/family_checks.py hf_forced), their gates recomputed as the family defines
  them (deepseek_gates, gpt_oss_gates here).
(The DeepSeekMoE block's layer kinds: tests/test_deepseek_moe_replay.py.)"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from family_checks import (  # noqa: E402
    check_free_routes_are_transformers_choice, check_log_probs_with_routes_forced,
    check_replayed_routes_come_back_exactly, replay_runs)


def deepseek_gates(gate, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The gates of experts `idx` as DeepSeek-V3 and GLM-4.5 define them: sigmoid(logits) at those experts (no
    bias), / their sum when norm_topk_prob, x routed_scaling_factor."""
    weights = torch.sigmoid(logits.float()).gather(1, idx)
    if gate.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * gate.routed_scaling_factor


def gpt_oss_gates(router, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The gates of experts `idx` as gpt-oss computes them for its own top k: softmax over their router logits
    (bias included)."""
    return torch.softmax(logits.float().gather(1, idx), dim=-1)


@dataclass(frozen=True)
class Replay:
    """A family's tiny model (tiny_model_factory's arguments), its MoE layers, the layouts and its gates."""

    tiny: dict
    moe_layers: int
    layouts: dict[str, list[str]]
    gates: Callable


DEEPSEEK_MOE_LAYOUTS = {"tp1": [], "pp2": ["--pp", "2"],
                        "tp2xep2": ["--tp", "2", "--ep", "2", "--dispatcher", "allgather"]}
REPLAYS = {"deepseek_v3": Replay(dict(layers=4, moe_ffn=32), 3, DEEPSEEK_MOE_LAYOUTS, deepseek_gates),
           "glm4_moe": Replay(dict(layers=4, moe_ffn=32), 3, DEEPSEEK_MOE_LAYOUTS, deepseek_gates),
           "gpt_oss": Replay(dict(moe_ffn=32), 2, {"tp1": [], "tp2xep2": ["--tp", "2", "--ep", "2"]}, gpt_oss_gates)}
LAYOUT_CASES = [(family, layout) for family, replay in REPLAYS.items() for layout in replay.layouts]


@pytest.fixture(scope="module")
def runs_of(tiny_model_factory, tmp_path_factory):
    """runs_of(family) -> replay_runs on its tiny model, run once per family in this module."""
    done = {}

    def get(family: str) -> dict:
        if family not in done:
            replay = REPLAYS[family]
            model_dir = tiny_model_factory(family, **replay.tiny)
            done[family] = replay_runs(model_dir, tmp_path_factory.mktemp(f"{family}_replay"), replay.layouts,
                                       replay.moe_layers, replay.gates)
        return done[family]

    return get


@pytest.mark.parametrize("family", list(REPLAYS))
def test_free_routes_are_transformers_choice_and_log_probs_match(runs_of, family):
    check_free_routes_are_transformers_choice(runs_of(family))


@pytest.mark.parametrize("family, layout", LAYOUT_CASES)
def test_replayed_routes_come_back_exactly(runs_of, family, layout):
    check_replayed_routes_come_back_exactly(runs_of(family), layout)


@pytest.mark.parametrize("family, layout", LAYOUT_CASES)
def test_log_probs_with_routes_forced_equal_transformers_forced(runs_of, family, layout):
    check_log_probs_with_routes_forced(runs_of(family), layout)
