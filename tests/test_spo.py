"""SPO (Xu & Ding 2025, Single-stream Policy Optimization, arXiv:2509.13232): megapo/algorithms/value_tracker.py's
persistent KL-adaptive value tracker and the batch-normalised advantages against the formulas written out here as
float64 loops; a tracker saved and loaded (JSON) gives the advantages of an uninterrupted sequence of steps; the
trainer's path (update.group_advantages, new_prompt_stats / stage_state); ragged groups (group-free); config
refusals naming the field; the listing; a tiny training run that checkpoints the tracker."""

from __future__ import annotations

import json
import math
import random
import sys
from types import SimpleNamespace

import pytest
import torch

from megapo.algorithms import compute_advantages, entries
from megapo.algorithms.value_tracker import STATE_KEY, SPOOptions, ValueTracker, spo_advantages
from megapo.cli import main

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from algorithm_configs import make_cfg  # noqa: E402

OPTS = dict(prior=0.3, prior_count=3.0, kl_per_step=0.02, d_half=0.1, rho_min=0.5, rho_max=0.95, eps=1e-6)


# ----------------------------------------------------------------------------- the formulas as loops


class LoopTracker:
    def __init__(self, prior, prior_count, kl_per_step, d_half, rho_min, rho_max, eps):
        self.o = dict(prior=prior, n0=prior_count, k=kl_per_step, h=d_half, lo=rho_min, hi=rho_max, eps=eps)
        self.ab = {}

    def step(self, rewards, keys, step):
        o = self.o
        base = [self.ab[k][0] / (self.ab[k][0] + self.ab[k][1]) if k in self.ab else o["prior"] for k in keys]
        adv = [r - b for g, b in zip(rewards, base) for r in g]
        mean = sum(adv) / len(adv)
        std = math.sqrt(sum((a - mean) ** 2 for a in adv) / len(adv))
        adv = [(a - mean) / (std + o["eps"]) for a in adv]
        for k, g in zip(keys, rewards):
            if k in self.ab:
                a, b, last = self.ab[k]
                rho = min(max(2 ** (-(o["k"] * (step - last)) / o["h"]), o["lo"]), o["hi"])
                a, b = rho * a, rho * b
            else:
                a, b = o["prior"] * o["n0"], (1 - o["prior"]) * o["n0"]
            self.ab[k] = (a + sum(g), b + sum(1 - r for r in g), step)
        out, i = [], 0
        for g in rewards:
            out.append(adv[i: i + len(g)])
            i += len(g)
        return out


def steps_data(seed=0, n_steps=6, prompts=5):
    """Per step: the keys drawn (a prompt may come back after a few steps) and ragged groups of 0/1 rewards."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_steps):
        keys = rng.sample([f"p{i}" for i in range(prompts)], 3)
        out.append((keys, [[float(rng.random() < 0.4) for _ in range(rng.randint(1, 3))] for _ in keys]))
    return out


# ----------------------------------------------------------------------------- tests


def test_tracker_steps_match_the_loop():
    loop, tracker = LoopTracker(**OPTS), ValueTracker()
    for step, (keys, rewards) in enumerate(steps_data(), start=1):
        want = loop.step(rewards, keys, step)
        got = spo_advantages(rewards, keys, tracker, step, **OPTS)
        for w, g in zip(want, got):
            assert g.tolist() == pytest.approx(w, rel=1e-12, abs=1e-12)
    for key, (a, b, last) in loop.ab.items():
        assert tracker.values[key] == pytest.approx([a, b, last], rel=1e-12)


def test_the_adaptive_rho_forgets_more_after_a_longer_absence():
    o = SPOOptions(**OPTS)
    t = ValueTracker({"x": [2.0, 1.0, 1.0]})
    assert t.rho("x", 2, o) == pytest.approx(min(max(2 ** -0.2, 0.5), 0.95))
    assert t.rho("x", 4, o) < t.rho("x", 2, o)
    assert t.rho("x", 100, o) == 0.5  # clipped at ρ_min


def test_resume_equals_an_uninterrupted_run():
    data = steps_data(seed=3, n_steps=8)
    straight = ValueTracker()
    want = [spo_advantages(r, k, straight, s, **OPTS) for s, (k, r) in enumerate(data, start=1)]
    first = ValueTracker()
    got = [spo_advantages(r, k, first, s, **OPTS) for s, (k, r) in enumerate(data[:4], start=1)]
    saved = json.loads(json.dumps({STATE_KEY: first.state_dict()}))
    resumed = ValueTracker(saved[STATE_KEY])
    got += [spo_advantages(r, k, resumed, s, **OPTS) for s, (k, r) in enumerate(data[4:], start=5)]
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            assert torch.equal(a, b)
    assert resumed.state_dict() == straight.state_dict()


def test_trainer_path_keeps_and_restores_the_tracker():
    from megapo.trainer.update import group_advantages, new_prompt_stats, stage_state

    cfg = make_cfg(advantage="spo", advantage_options=dict(OPTS), n_samples=1)
    data = steps_data(seed=4, n_steps=5)

    def groups_of(keys, rewards):
        return [SimpleNamespace(rewards=r, samples=[None] * len(r), example=SimpleNamespace(prompt=k), privileged=False)
                for k, r in zip(keys, rewards)]

    straight = new_prompt_stats(cfg)
    assert isinstance(straight, ValueTracker)
    want = [group_advantages(groups_of(*d), cfg, s, straight) for s, d in enumerate(data, start=1)]
    first = new_prompt_stats(cfg)
    got = [group_advantages(groups_of(*d), cfg, s, first) for s, d in enumerate(data[:2], start=1)]
    extra = json.loads(json.dumps(stage_state(first)))
    assert set(extra) == {STATE_KEY}
    resumed = new_prompt_stats(cfg, extra)
    got += [group_advantages(groups_of(*d), cfg, s, resumed) for s, d in enumerate(data[2:], start=3)]
    for w, g in zip(want, got):
        assert [x.tolist() for x in w] == [x.tolist() for x in g]
    # and the loop agrees (prompt text hashed to its key by the trainer: same values)
    loop = LoopTracker(**OPTS)
    for s, (keys, rewards) in enumerate(data, start=1):
        assert [x.tolist() for x in want[s - 1]] == [pytest.approx(v, rel=1e-12, abs=1e-12)
                                                       for v in loop.step(rewards, keys, s)]


def test_stateless_registry_call_is_the_first_visit():
    rewards = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    got = compute_advantages("spo", rewards, prior=0.3)
    want = LoopTracker(**{**OPTS, "prior": 0.3}).step(rewards.tolist(), ["a", "b"], 1)
    assert got.tolist() == [pytest.approx(w, rel=1e-12) for w in want]
    one = compute_advantages("spo", torch.tensor([[1.0], [0.0]], dtype=torch.float64))  # group-free: n = 1
    assert one.shape == (2, 1)


def test_priorities_favour_uncertain_prompts():
    o = SPOOptions()
    t = ValueTracker({"easy": [9.0, 0.1, 1.0], "mid": [1.0, 1.0, 1.0], "hard": [0.1, 9.0, 1.0]})
    p = t.priorities(["easy", "mid", "hard", "new"], o)
    assert float(p.sum()) == pytest.approx(1.0)
    assert p[1] > p[0] and p[1] > p[2] and p[3] == pytest.approx(p[1])  # unseen: the prior 0.5


def test_bad_inputs_refused():
    with pytest.raises(ValueError, match=r"^rewards: spo"):
        spo_advantages([[1.5]], ["a"], ValueTracker(), 1)
    with pytest.raises(ValueError, match=r"^keys:"):
        spo_advantages([[1.0]], ["a", "b"], ValueTracker(), 1)
    with pytest.raises(ValueError, match=r"^value_tracker\['a'\]"):
        ValueTracker({"a": [1.0, 2.0]})


# ----------------------------------------------------------------------------- config and listing


def test_config_loads_group_free():
    make_cfg(advantage="spo", n_samples=1)
    make_cfg(advantage="spo", advantage_options={"kl_per_step": 0.0})


@pytest.mark.parametrize("options, start", [
    ({"prior": 1.5}, "prior:"), ({"prior_count": 0}, "prior_count:"), ({"kl_per_step": -1}, "kl_per_step:"),
    ({"d_half": 0}, "d_half:"), ({"rho_min": 0.9, "rho_max": 0.8}, "rho_max:"), ({"eps": 0}, "eps:"),
    ({"tau": 1}, "unknown option"),
])
def test_config_refusals_name_the_field(options, start):
    from megapo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        make_cfg(advantage="spo", advantage_options=options)
    assert err.value.field == "algorithm.advantage_options", str(err.value)
    assert str(err.value.message).startswith(start), str(err.value)


def test_listed_with_paper_formula_and_assumptions(capsys):
    assert main(["objectives", "--formulas"]) == 0
    out = capsys.readouterr().out
    e = next(e for e in entries("advantage") if e.name == "spo")
    assert "arXiv:2509.13232" in e.paper and e.paper in out
    assert e.formula.splitlines()[0].strip() in out and "assumption:" in e.formula
    for option in e.option_names():
        assert option in out


def test_training_run_checkpoints_the_tracker(tmp_path, tiny_moe):
    from train_runs import train_rows

    rows = train_rows(tmp_path, "spo", f"model.path={tiny_moe}", "train.steps=2", "algorithm.advantage=spo",
                      "rollout.n_samples=1", "train.ckpt_every=1")
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["train/loss"]) for r in rows)
    saved = [p for p in (tmp_path / "spo").rglob("*.json") if STATE_KEY in p.read_text()]
    assert saved, "no checkpoint file holds the value tracker"
