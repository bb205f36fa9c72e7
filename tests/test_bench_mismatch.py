"""megapo bench mismatch: its metric functions against references written here (hand-made routes, log-probs and
router logits), and a --quick run: the files and their keys, R3 leaves no disagreement, an fp32 learner agrees with
an fp32 engine."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tools.bench.mismatch import PUBLISHED, disagreement, logp_gap, router_stats

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- metric functions


def test_logp_gap_against_a_hand_computation():
    engine = [-1.0, -2.0, -0.5, -3.0]
    learner = [-1.5, -1.0, -0.5, -3.25]
    d = [l - e for l, e in zip(learner, engine)]  # learner - engine: -0.5, 1.0, 0.0, -0.25
    g = logp_gap(engine, learner)
    assert g["tokens"] == 4
    assert g["mean_abs"] == pytest.approx((0.5 + 1.0 + 0.0 + 0.25) / 4)
    assert g["max_abs"] == pytest.approx(1.0)
    assert g["rms"] == pytest.approx(math.sqrt((0.25 + 1.0 + 0.0 + 0.0625) / 4))
    assert g["mean_signed"] == pytest.approx(0.25 / 4)
    k3 = sum(math.exp(x) - 1 - x for x in d) / 4
    assert g["k3"] == pytest.approx(k3, rel=1e-12)
    # the direction: exp(d) - 1 - d with d = learner - engine is not symmetric in the two
    assert g["k3"] != pytest.approx(sum(math.exp(-x) - 1 + x for x in d) / 4)
    assert logp_gap(engine, engine)["k3"] == 0.0 and logp_gap(engine, engine)["max_abs"] == 0.0
    with pytest.raises(ValueError, match="3 log-probs for 4"):
        logp_gap(engine, learner[:3])


def test_logp_gap_k3_is_megapos_own_mismatch_k3():
    from megapo.replay.modes import engine_mismatch

    rng = np.random.default_rng(0)
    samples = [dict(rollout_logp=list(rng.normal(-3, 1, n))) for n in (5, 3)]
    learner = [np.asarray(s["rollout_logp"]) + rng.normal(0, 0.2, len(s["rollout_logp"])) for s in samples]
    ours = logp_gap(np.concatenate([s["rollout_logp"] for s in samples]), np.concatenate(learner))
    theirs = engine_mismatch(samples, learner)
    assert ours["k3"] == pytest.approx(theirs["k3"], rel=1e-6)
    assert ours["max_abs"] == pytest.approx(theirs["max_abs_dlogp"], rel=1e-6)


def test_disagreement_on_hand_made_routes():
    # 2 sequences, [positions, 2 MoE layers, top-2]
    engine = [np.array([[[0, 1], [2, 3]],
                        [[4, 5], [6, 7]],
                        [[1, 2], [3, 4]]]),
              np.array([[[0, 7], [1, 2]],
                        [[3, 5], [0, 6]]])]
    learner = [np.array([[[1, 0], [2, 3]],    # same sets, other order: agree, agree
                         [[4, 6], [6, 7]],    # layer 0 differs
                         [[1, 2], [4, 5]]]),  # layer 1 differs
               np.array([[[0, 7], [2, 1]],    # agree, agree
                         [[3, 4], [0, 1]]])]  # both differ
    # reference: 10 decisions, 4 differ (seq0 pos1 l0, seq0 pos2 l1, seq1 pos1 l0, seq1 pos1 l1);
    # 5 positions, 3 with a differing layer; layer 0: 2 of 5, layer 1: 2 of 5
    d = disagreement(engine, learner, prompt_lens=[2, 2])
    assert d["disagree"] == pytest.approx(4 / 10)
    assert d["disagree_any"] == pytest.approx(3 / 5)
    assert d["per_layer"] == pytest.approx([2 / 5, 2 / 5])
    assert d["decisions"] == 10 and d["positions"] == 5
    # response positions (prompt_len - 1 onwards): seq0 positions 1, 2; seq1 position 1 -> 6 decisions, 4 differ
    assert d["response"]["disagree"] == pytest.approx(4 / 6)
    assert d["response"]["disagree_any"] == pytest.approx(3 / 3)
    same = disagreement(engine, [e.copy() for e in engine])
    assert same["disagree"] == 0.0 and same["disagree_any"] == 0.0 and "response" not in same


def test_router_stats_uniform_and_hand_made_logits():
    u = router_stats(np.zeros((6, 8)), topk=2)
    assert u["topk_mass"] == pytest.approx(2 / 8) and u["topk_mass_uniform"] == 2 / 8
    x = np.array([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 1.0, 3.0]])
    s = router_stats(x, topk=2)
    std = x.std(-1)  # per row, over the experts
    p = np.exp(x) / np.exp(x).sum(-1, keepdims=True)
    assert s["topk_mass"] == pytest.approx(np.mean([p[0, 0] + p[0, 1], p[1, 3] + p[1, 1]]))
    # gap between the 2nd and 3rd largest logits: 1.0 in row 0, 0.0 (a tie) in row 1
    assert s["gap_k_over_std_median"] == pytest.approx(np.median([1.0 / std[0], 0.0 / std[1]]))
    assert s["near_tie_share"] == pytest.approx(0.5)


# ----------------------------------------------------------------------------- the --quick run


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("mismatch") / "out"
    done = subprocess.run([sys.executable, "-m", "megapo.cli", "bench", "mismatch", "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_quick_run_writes_summary_and_table(quick):
    report = json.loads((quick / "summary.json").read_text())
    for key in ("benchmark", "command", "argv", "git", "machine", "threads", "load_avg_start", "load_avg_end",
                "wall_s", "settings", "definitions", "published", "models", "target", "pairs"):
        assert key in report, key
    assert report["benchmark"] == "mismatch" and report["quick"] is True
    assert report["command"].startswith("megapo bench mismatch")
    assert list(report["models"]) == ["e8k2-l2"]
    model = report["models"]["e8k2-l2"]
    assert len(model["pairs"]) == 9  # fp32, bf16, fp16 on each side
    for pair, r in model["pairs"].items():
        for key in ("disagree", "disagree_any", "disagree_per_layer", "r3_disagree_after_replay"):
            assert key in r, (pair, key)
        for side in ("off", "r3"):
            assert set(r[side]) >= {"mean_abs", "max_abs", "rms", "k3", "tokens"}, (pair, side)
        assert 0.0 <= r["disagree"] <= r["disagree_any"] <= 1.0
        assert len(r["disagree_per_layer"]) == 2
    assert "topk_mass" in model["router"]
    table = (quick / "table.md").read_text()
    assert "| model | learner | engine | disagree | disagree_any |" in table
    rows = re.findall(r"^\| e8k2-l2 \| (fp32|bf16|fp16) \| (fp32|bf16|fp16) \|", table, re.M)
    assert len(set(rows)) == len(rows) == 9
    # the published rows, marked as such
    assert table.count("published, not measured here") == len(PUBLISHED)
    for source in ("Megatron-LM issue 4168", "miles issue 2722", "Fast-LLM PR 525", "prime-rl PR 2808"):
        assert source in table


def test_quick_run_r3_replays_the_engine_routes(quick):
    pairs = json.loads((quick / "summary.json").read_text())["models"]["e8k2-l2"]["pairs"]
    for pair, r in pairs.items():
        assert r["r3_disagree_after_replay"] == 0.0, pair
        assert r["r3_disagree_any_after_replay"] == 0.0, pair
        assert r["r3_hook_disagree_post"] == 0.0, pair
        # megapo's own k3 on the same log-probs (replay.modes.engine_mismatch) is the bench's k3
        assert r["off"]["k3"] == pytest.approx(r["k3_off_megapo_engine_mismatch"], rel=1e-5, abs=1e-12)


def test_quick_run_fp32_learner_agrees_with_fp32_engine(quick):
    r = json.loads((quick / "summary.json").read_text())["models"]["e8k2-l2"]["pairs"]["fp32/fp32"]
    assert r["off"]["mean_abs"] < 1e-4 and r["r3"]["mean_abs"] < 1e-4
    assert r["disagree"] == 0.0
