"""DUET's prompt-feature surrogate (Hu, Zhao, Xu and Jacoby 2026, DUET: Optimize Token-Budget Allocation for
Reinforcement Learning with Verifiable Rewards, arXiv:2605.08441; data.group_filter_options.surrogate: features):
the features against a loop written out here, the fit against its gradient rule written out in float64, the
combination with a prompt's tracker, predictions for unseen prompts on a synthetic stream against the trackers',
a checkpoint round trip and the trainer's plumbing of the prompt ids (the options' refusals: tests/test_duet.py)."""

from __future__ import annotations

import hashlib
import json
import math
import random

import pytest
import torch

from megapo.algorithms.duet_surrogate import FeatureSurrogate, prompt_features
from megapo.algorithms.length import ScoredGroup, build_group_filter
from megapo.engines.base import Sample, SamplingParams
from megapo.tasks.base import Example
from megapo.trainer.length_stage import LengthStage
from test_duet import _cfg  # the duet run config, defined once

FEATURES = {"surrogate": "features"}


def _features_loop(ids, buckets):
    """x written out: bias 1, log(1 + L)/8, then every unigram adds 1/√L and every bigram 1/√(L − 1) at 2 + its
    blake2b bucket (8 bytes little-endian of the ids joined by ",", mod buckets)."""
    x = [0.0] * (2 + buckets)
    x[0] = 1.0
    x[1] = math.log(1 + len(ids)) / 8
    for n in (1, 2):
        count = len(ids) - n + 1
        for i in range(max(count, 0)):
            text = ",".join(str(t) for t in ids[i:i + n])
            h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
            x[2 + h % buckets] += 1 / math.sqrt(count)
    return x


def _dense(x: dict, width: int) -> list[float]:
    out = [0.0] * width
    for j, v in x.items():
        out[j] = v
    return out


@pytest.mark.parametrize("ids, buckets", [
    ([], 5), ([7], 5), ([3, 3, 3, 3], 4), ([11, 2, 9, 2, 11, 40], 3), (list(range(100, 160)), 64),
])
def test_the_features_equal_the_loop(ids, buckets):
    assert _dense(prompt_features(ids, buckets), 2 + buckets) == pytest.approx(_features_loop(ids, buckets),
                                                                               rel=1e-15, abs=0)


def _fit_loop(w, xs, ys, ns, lr, steps, l2):
    """The fit written out in float64, dense: w ← w − lr·(Σ_i n_i(σ(w·x_i) − y_i)x_i / Σ_i n_i + l2·w, bias 0)."""
    w = list(w)
    total = sum(ns)
    for _ in range(steps):
        grad = [0.0] * len(w)
        for x, y, n in zip(xs, ys, ns):
            z = sum(a * b for a, b in zip(w, x))
            p = 1 / (1 + math.exp(-z))
            for j in range(len(w)):
                grad[j] += n * (p - y) * x[j] / total
        for j in range(1, len(w)):
            grad[j] += l2 * w[j]
        w = [a - lr * g for a, g in zip(w, grad)]
    return w


def test_the_fit_equals_the_gradient_rule_written_out():
    buckets = 6
    model = FeatureSurrogate(buckets, prior=0.3, lr=0.7, steps=3, l2=0.05)
    assert model.w[0] == pytest.approx(math.log(0.3 / 0.7)) and model.w[1:] == [0.0] * (1 + buckets)
    assert model.predict(model.features([1, 2, 3])) == pytest.approx(0.3)  # an unfitted model predicts the prior
    rng = random.Random(4)
    model.w = [rng.uniform(-1, 1) for _ in model.w]
    prompts = [[rng.randrange(50) for _ in range(rng.randint(1, 12))] for _ in range(4)]
    ys, ns = [0.25, 1.0, 0.0, 0.6], [4, 2, 3, 5]
    expected = _fit_loop(model.w, [_features_loop(p, buckets) for p in prompts], ys, ns, 0.7, 3, 0.05)
    model.fit([model.features(p) for p in prompts], ys, ns)
    assert model.w == pytest.approx(expected, rel=1e-12, abs=1e-14) and model.fitted == 1


def _group(key, correct):
    c = torch.tensor(correct, dtype=torch.bool)
    n = len(correct)
    return ScoredGroup(key, None, c.to(torch.float64), c, torch.full((n,), 3), torch.zeros(n, dtype=torch.bool))


def test_the_filter_allocates_from_p_hat_combines_with_the_tracker_and_fits_once_a_round():
    from test_duet import _allocation_loop

    f = build_group_filter("duet", {**FEATURES, "feature_buckets": 8, "feature_count": 3.0, "feature_steps": 2}, 16)
    ids = {"a": [5, 6, 7], "b": [9, 9, 1, 2, 3, 4, 5], "c": [2]}
    f.allocate(["a", "b"], 4, None, [ids["a"], ids["b"]])
    w0 = list(f.features.w)
    f.select([_group("a", [1, 0, 1, 1]), _group("b", [0, 0, 0, 1])], 1)
    xs = [_features_loop(ids[k], 8) for k in ("a", "b")]
    assert f.features.w == pytest.approx(_fit_loop(w0, xs, [0.75, 0.25], [4, 4], 1.0, 2, 1e-4), rel=1e-12)
    # the next round: a has a tracker (α = 1 + 3, β = 1 + 1), c none: c's v̂ is p̂ alone
    p = {k: 1 / (1 + math.exp(-sum(a * b for a, b in zip(f.features.w, _features_loop(ids[k], 8))))) for k in ids}
    counts = f.allocate(["a", "c"], 4, None, [ids["a"], ids["c"]])
    v = [(4 + 3 * p["a"]) / (4 + 2 + 3), p["c"]]
    assert counts == _allocation_loop([u * (1 - u) + 0.01 for u in v], 8, 2)
    assert [f.pending[k][1] for k in ("a", "c")] == pytest.approx([p["a"], p["c"]], rel=1e-12)
    with pytest.raises(ValueError, match="^surrogate: features"):
        f.allocate(["a"], 4)  # no token ids


def _truth(n_tokens: int) -> float:
    """The synthetic stream's pass rate: falls with the prompt's length (0.86 at 10 tokens, 0.41 at 200)."""
    return 1 / (1 + math.exp(-6 * (0.6 - math.log1p(n_tokens) / 8)))


def test_on_a_stream_of_new_prompts_the_features_predict_unseen_ones_better_than_the_trackers():
    """40 rounds of 16 never-repeated prompts, 8 rollouts each, the pass rate a function of the prompt's length;
    then 200 unseen prompts: the feature model's mean squared error against the true pass rate is below half of
    what the trackers give an unseen prompt (the run's pooled pass rate) and of the prior 0.5's (seed 0)."""
    rng = random.Random(0)

    def prompt():
        return [rng.randrange(3, 500) for _ in range(rng.randint(10, 200))]

    features, tracker = build_group_filter("duet", FEATURES, 64), build_group_filter("duet", {}, 64)
    for step in range(1, 41):
        prompts, keys = [prompt() for _ in range(16)], [f"{step}/{i}" for i in range(16)]
        features.allocate(keys, 8, None, prompts)
        groups = [_group(k, [rng.random() < _truth(len(p)) for _ in range(8)]) for k, p in zip(keys, prompts)]
        features.select(groups, step)
        tracker.select(groups, step)
    unseen = [prompt() for _ in range(200)]
    truth = [_truth(len(p)) for p in unseen]
    mse_features = sum((features.features.predict(features.features.features(p)) - t) ** 2
                       for p, t in zip(unseen, truth)) / len(unseen)
    mse_tracker = sum((tracker.value("unseen", None) - t) ** 2 for t in truth) / len(unseen)
    mse_prior = sum((0.5 - t) ** 2 for t in truth) / len(unseen)
    assert mse_features < 0.5 * mse_tracker and mse_features < 0.5 * mse_prior, (mse_features, mse_tracker)
    m = features.metrics()
    assert set(m) >= {"duet_feature_brier", "duet_tracker_brier"} and "duet_feature_brier" not in tracker.metrics()


def _rounds(step):
    """Two rounds a step of three prompts (some repeated across steps, some new) with verdicts from the step."""
    out = []
    for r in range(2):
        keys = [f"p{(step + i + r) % 7}" for i in range(3)]
        ids = [[int(k[1:]) + 3] * (2 + int(k[1:])) + [r + 1] for k in keys]
        verdicts = [[(step * 5 + i * 3 + j + r) % 4 == 0 for j in range(8)] for i in range(3)]
        out.append((keys, ids, verdicts))
    return out


def _drive(f, steps):
    record = []
    for step in steps:
        for keys, ids, verdicts in _rounds(step):
            counts = f.allocate(keys, 4, None, ids)
            record.append(counts)
            kept = f.select([_group(k, v[:c]) for k, v, c in zip(keys, verdicts, counts)], step)
            record.append([k.tolist() for k in kept])
    return record


def test_a_resumed_filter_allocates_as_the_unstopped_one():
    options = {**FEATURES, "feature_buckets": 16, "marker": "}", "horizon": 2, "keep_prob": 0.5}
    whole, first, resumed = (build_group_filter("duet", options, 16) for _ in range(3))
    for f in (whole, first, resumed):
        f.seed = 2
    record = _drive(whole, range(1, 9))
    head = _drive(first, range(1, 5))
    state = json.loads(json.dumps(first.state_dict()))
    assert set(state) == {"tracker", "step", "round", "features"} and state["features"]["fitted"] == 8
    resumed.load_state_dict(state)
    assert head + _drive(resumed, range(5, 9)) == record
    assert resumed.state_dict() == whole.state_dict()
    assert len({tuple(c) for c in record[::2]}) > 1  # the allocation moves
    blank = build_group_filter("duet", options, 16)  # the trackers restored but not the model: it allocates otherwise
    blank.seed = 2
    blank.load_state_dict({**state, "features": build_group_filter("duet", options, 16).features.state_dict()})
    assert _drive(blank, range(5, 9)) != record[len(head):]
    with pytest.raises(ValueError, match="^length state: duet"):
        resumed.load_state_dict({k: v for k, v in state.items() if k != "features"})
    with pytest.raises(ValueError, match="^length state: duet's feature surrogate"):
        resumed.load_state_dict({**state, "features": {"weights": [0.0] * 3, "fitted": 0}})
    tracker_only = build_group_filter("duet", {}, 16)
    with pytest.raises(ValueError, match="^length state: duet"):
        tracker_only.load_state_dict(state)


def test_the_trainer_hands_the_prompt_ids_to_the_allocation():
    from megapo.trainer.rollout import collect_rollouts

    cfg = _cfg("data.group_filter_options={surrogate: features}", "data.prompts_per_step=2", "train.mini_batches=1")
    stage = LengthStage(cfg)
    pool = [(Example("1+1=", "2"), [4, 5, 6]), (Example("2+2=", "4"), [7, 8])]

    class Source:
        def next_batch(self, n):
            return list(range(n))

    class Engine:
        def generate(self, prompts, params):
            self.prompts = prompts
            return [[Sample(p, [1, 2], [0.0, 0.0], "stop", 0)] for p in prompts]

    engine = Engine()
    w0 = list(stage.filter.features.w)
    _, metrics, _ = collect_rollouts(engine, SamplingParams(n=8), pool, Source(),
                                     lambda pairs: [1.0 if ex.answer == "2" else 0.0 for ex, _ in pairs], cfg,
                                     length=stage)
    assert sorted(map(tuple, engine.prompts)) == sorted([(4, 5, 6)] * 8 + [(7, 8)] * 8)  # the prior: 8 each
    assert stage.filter.features.fitted == 1 and "length/duet_feature_brier" in metrics
    # the fit read the pool's token ids: the rule written out on their features, pass rates 1 and 0 over 8 each
    xs = [_features_loop([4, 5, 6], 1024), _features_loop([7, 8], 1024)]
    assert stage.filter.features.w == pytest.approx(_fit_loop(w0, xs, [1.0, 0.0], [8, 8], 1.0, 4, 1e-4), rel=1e-12)
    assert stage.filter.tracker.values  # the trackers still run beside the model


def test_the_default_is_the_tracker_and_the_formula_says_assumption():
    from megapo.algorithms.registry import entries

    f = build_group_filter("duet", {}, 16)
    assert f.o.surrogate == "tracker" and f.features is None and set(f.state_dict()) == {"tracker", "step", "round"}
    [e] = [e for e in entries("group_filter") if e.name == "duet"]
    assert "surrogate features" in e.formula and "Assumption:" in e.formula
