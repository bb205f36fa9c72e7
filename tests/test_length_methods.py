"""Length rewards and group filters (megapo/algorithms/length.py) vs their formulas written out here as plain
loops, their state across a JSON round trip, and their option checks."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from megapo.algorithms import entries
from megapo.algorithms.length import (
    ScoredGroup, build_group_filter, build_length_reward, check_kept, check_shaped, clamp_correct_advantages,
)
from megapo.algorithms.step_length import one_step_each

BUDGET = 64


def _group(key, difficulty, rewards, correct, lengths, truncated=None):
    return ScoredGroup(key, difficulty, torch.tensor(rewards, dtype=torch.float64), torch.tensor(correct),
                       torch.tensor(lengths, dtype=torch.int64),
                       torch.tensor(truncated if truncated is not None else [False] * len(rewards)))


def _batch():
    """Mixed pass rates (1/2, 1/3, 0, 1), a partial-credit reward, a truncated response, equal lengths."""
    return [
        _group("a", 2, [1.0, 0.0, 1.0, 0.2], [True, False, True, False], [10, 25, 40, 5]),
        _group("b", 4, [0.0, 0.0, 1.0], [False, False, True], [60, 64, 30], [False, True, False]),
        _group("c", 6, [0.0, 0.0, 0.0, 0.0], [False] * 4, [20, 20, 20, 20]),
        _group("d", 3, [1.0] * 5, [True] * 5, [12, 8, 8, 30, 50]),
    ]


def _later_batch(step):
    """Another round: the same prompts with other lengths (so history and windows move)."""
    shift = 3 * step
    return [
        _group("a", 2, [1.0, 1.0, 0.0, 0.0], [True, True, False, False], [6 + shift, 30, 12, 3]),
        _group("d", 3, [1.0, 0.0, 1.0, 1.0, 1.0], [True, False, True, True, True], [20, 9, 7 + step, 44, 15]),
        _group("e", 5, [0.0, 1.0], [False, True], [33, 18 + step]),
    ]


def _rows(g):
    return list(zip(g.rewards.tolist(), g.correct.tolist(), g.lengths.tolist(), g.truncated.tolist()))


def _pass(g):
    c = g.correct.tolist()
    return sum(c) / len(c)


def _shape(name, options, groups, step=1, budget=BUDGET):
    method = build_length_reward(name, options, budget)
    return [r.tolist() for r in check_shaped(groups, method.shape(groups, step), name)]


def _assert_rows(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g == pytest.approx(e, rel=1e-12, abs=1e-12)


# ----------------------------------------------------------------------------- stateless rewards


def test_alp():
    groups = _batch()
    expected = []
    for g in groups:
        p = max(_pass(g), 1 / g.size)
        expected.append([(1.0 if c else 0.0) - 0.3 / 100 * p * n for _, c, n, _ in _rows(g)])
    _assert_rows(_shape("alp", {"beta": 0.3, "norm": 100}, groups), expected)
    # N defaults to the generation budget
    expected = [[(1.0 if c else 0.0) - 0.3 / BUDGET * max(_pass(g), 1 / g.size) * n for _, c, n, _ in _rows(g)]
                for g in groups]
    _assert_rows(_shape("alp", {"beta": 0.3}, groups), expected)


def test_laser():
    groups = _batch()
    expected = [[r + (0.7 if c and n <= 25 else 0.0) for r, c, n, _ in _rows(g)] for g in groups]
    _assert_rows(_shape("laser", {"target_len": 25, "alpha": 0.7}, groups), expected)


def _kimi_reference(g, weight):
    lengths = g.lengths.tolist()
    lo, hi = min(lengths), max(lengths)
    out = []
    for r, c, n, _ in _rows(g):
        lam = 0.5 - (n - lo) / (hi - lo) if hi > lo else 0.0
        out.append(r + weight * (lam if c else min(0.0, lam)))
    return out


def test_kimi():
    groups = _batch()
    _assert_rows(_shape("kimi", {"weight": 0.5}, groups), [_kimi_reference(g, 0.5) for g in groups])
    assert _shape("kimi", {}, groups)[2] == [0.0] * 4  # equal lengths: no length term


@pytest.mark.parametrize("inner,inner_options", [
    ("kimi", {"weight": 2.0}), ("laser", {"target_len": 20, "alpha": 1.0}), ("length_penalty", {"coef": 0.01})])
def test_grpo_lambda_uses_the_length_term_only_in_groups_solved_often(inner, inner_options):
    groups = _batch()  # pass rates 1/2, 1/3, 0, 1
    expected = []
    for g in groups:
        if _pass(g) < 0.5:
            expected.append(g.rewards.tolist())
        elif inner == "kimi":
            expected.append(_kimi_reference(g, 2.0))
        elif inner == "laser":
            expected.append([r + (1.0 if c and n <= 20 else 0.0) for r, c, n, _ in _rows(g)])
        else:
            expected.append([r - 0.01 * n for r, c, n, _ in _rows(g)])
    got = _shape("grpo_lambda", {"inner": inner, "inner_options": inner_options, "min_correct_ratio": 0.5}, groups)
    _assert_rows(got, expected)


def test_curriculum_anneals_the_budget_and_cuts_over_it():
    groups = _batch()
    for step in (1, 3, 5, 11, 40):
        budget = 50 + (10 - 50) * min(1.0, (step - 1) / 10)
        expected = [[-0.5 if (n > budget or t) else r for r, c, n, t in _rows(g)] for g in groups]
        got = _shape("curriculum", {"start": 50, "end": 10, "steps": 10, "over_reward": -0.5}, groups, step)
        _assert_rows(got, expected)
    # start 0: the generation budget, so at step 1 only the truncated response is cut
    got = _shape("curriculum", {"end": 10, "steps": 10}, groups, 1)
    _assert_rows(got, [[0.0 if t else r for r, c, n, t in _rows(g)] for g in groups])


def test_dler_truncates_and_tightens_easy_prompts():
    groups = _batch()
    expected = [[-1.0 if (n > 30 or t) else r for r, c, n, t in _rows(g)] for g in groups]
    _assert_rows(_shape("dler", {"truncate_at": 30, "truncated_reward": -1.0}, groups), expected)
    # L_T = the generation budget: only the response the engine cut (64 tokens, no end) is truncated
    expected = [[-1.0 if t else r for r, c, n, t in _rows(g)] for g in groups]
    _assert_rows(_shape("dler", {"truncated_reward": -1.0}, groups), expected)
    expected = []
    for g in groups:
        limit = 0.5 * 30 if _pass(g) >= 0.5 else 30
        expected.append([0.0 if (n > limit or t) else r for r, c, n, t in _rows(g)])
    _assert_rows(_shape("dler", {"truncate_at": 30, "easy_pass_rate": 0.5, "easy_scale": 0.5}, groups), expected)
    # difficulty: task: the label's ease 1 - (d - 2)/(6 - 2) >= 0.7 for d = 2 and 3 only
    expected = []
    for g in groups:
        limit = 0.4 * 30 if 1 - (g.difficulty - 2) / 4 >= 0.7 else 30
        expected.append([0.0 if (n > limit or t) else r for r, c, n, t in _rows(g)])
    got = _shape("dler", {"truncate_at": 30, "easy_pass_rate": 0.7, "easy_scale": 0.4, "difficulty": "task",
                          "task_range": [2, 6]}, groups)
    _assert_rows(got, expected)


def test_dast_budget_from_pass_rate():
    groups = _batch()
    expected = []
    for g in groups:
        ease = _pass(g)
        correct_lengths = [n for _, c, n, _ in _rows(g) if c]
        mean_correct = sum(correct_lengths) / len(correct_lengths) if correct_lengths else 80
        budget = ease * mean_correct + (1 - ease) * 80
        row = []
        for r, c, n, _ in _rows(g):
            lam = (n - budget) / budget
            score = max(0.5 - 0.5 * lam, 0.1) if c else min(0.9 * lam - 0.1, -0.1)
            row.append(r + 0.5 * score)
        expected.append(row)
    _assert_rows(_shape("dast", {"weight": 0.5, "max_len": 80}, groups), expected)


def test_dast_easy_prompts_get_the_smaller_budget():
    # the same lengths, all correct (easy) vs one correct (hard): the long correct answer earns less when easy
    easy = _group("e", None, [1.0] * 4, [True] * 4, [10, 10, 10, 40])
    hard = _group("h", None, [0.0, 0.0, 0.0, 1.0], [False, False, False, True], [10, 10, 10, 40])
    got = _shape("dast", {}, [easy, hard])
    assert got[0][3] < got[1][3]


def test_clamp_correct_advantages():
    adv = [-1.5, 0.3, -0.2, 2.0, -0.7]
    correct = [True, True, False, False, True]
    expected = [max(a, 0.0) if c else a for a, c in zip(adv, correct)]
    got = clamp_correct_advantages(torch.tensor(adv, dtype=torch.float64), torch.tensor(correct))
    assert got.tolist() == expected
    with pytest.raises(ValueError, match="correct:"):
        clamp_correct_advantages(torch.tensor(adv), torch.tensor(correct[:3]))


# ----------------------------------------------------------------------------- stateful rewards


def _bucket_reference(g, n):
    """Hardness 1 - pass rate in n equal bins, integer arithmetic: min(n-1, floor(wrong*n/G))."""
    wrong = sum(1 for c in g.correct.tolist() if not c)
    return min(n - 1, wrong * n // g.size)


def _coverage_reference(lengths, coverage):
    ranked = sorted(lengths)
    for i, n in enumerate(ranked):
        if (i + 1) / len(ranked) >= coverage:
            return n


CALLS = [(1, _batch()), (2, _later_batch(2)), (3, _later_batch(3)), (3, _batch()), (4, _later_batch(4)),
         (5, _batch()), (6, _later_batch(6)), (7, _later_batch(7)), (8, _batch())]


def _run_calls(method, calls):
    return [[r.tolist() for r in method.shape(groups, step)] for step, groups in calls]


def test_laser_d_against_a_written_out_loop():
    o = {"alpha": 0.5, "buckets": 3, "update_every": 3, "coverage": 0.5, "window": 4, "init_len": 28}
    targets, windows, last = {}, {}, 0
    expected = []
    for step, groups in CALLS:
        if step - last >= 3:
            for b, w in windows.items():
                if w:
                    targets[b] = _coverage_reference(w, 0.5)
            last = step
        out = []
        for g in groups:
            target = targets.get(_bucket_reference(g, 3), 28)
            out.append([r + (0.5 if c and n <= target else 0.0) for r, c, n, _ in _rows(g)])
        for g in groups:
            w = windows.setdefault(_bucket_reference(g, 3), [])
            w.extend(n for _, c, n, _ in _rows(g) if c)
            windows[_bucket_reference(g, 3)] = w[-4:]
        expected.append(out)
    got = _run_calls(build_length_reward("laser_d", o, BUDGET), CALLS)
    for g, e in zip(got, expected):
        _assert_rows(g, e)
    assert targets  # the loop did re-set targets, so the check covered them


def test_laser_d_task_buckets():
    o = {"buckets": 2, "update_every": 1, "coverage": 1.0, "difficulty": "task", "task_range": [2, 6]}
    method = build_length_reward("laser_d", o, BUDGET)
    method.shape(_batch(), 1)
    # labels 2, 3, 4 -> bucket 0 (floor((d-2)*2/4) = 0, 0, 1 -> 4 is bucket 1), 6 -> bucket 1
    buckets = {}
    for g in _batch():
        b = min(1, (g.difficulty - 2) * 2 // 4)
        buckets.setdefault(b, []).extend(n for _, c, n, _ in _rows(g) if c)
    method.shape([], 2)  # the re-set at step 2 takes the largest (coverage 1) correct length per bucket
    assert method.state_dict()["targets"] == {str(b): max(w) for b, w in buckets.items() if w}


def test_laconic_dual_ascent():
    lam, target, expected = 0.2, 30, []
    for step, groups in CALLS:
        expected.append([[r - lam * max(0, n - target) / target for r, c, n, _ in _rows(g)] for g in groups])
        all_lengths = [n for g in groups for n in g.lengths.tolist()]
        lam = max(0.0, lam + 0.05 * (sum(all_lengths) / len(all_lengths) - target) / target)
    method = build_length_reward("laconic", {"target": target, "dual_lr": 0.05, "lambda_init": 0.2}, BUDGET)
    for g, e in zip(_run_calls(method, CALLS), expected):
        _assert_rows(g, e)
    assert method.state_dict()["lambda"] == pytest.approx(lam, rel=1e-12)


def test_hapo_history():
    history, expected = {}, []
    for step, groups in CALLS:
        out = []
        for g in groups:
            h = history.get(g.prompt_key)
            row = []
            for r, c, n, _ in _rows(g):
                if h is None:
                    row.append(r)
                    continue
                f = math.cos(min(math.pi / 2 * n / h, math.pi))
                row.append(r + 0.8 * (f if c else min(f, 0.0)))
            out.append(row)
            correct_lengths = [n for _, c, n, _ in _rows(g) if c]
            if correct_lengths:
                history[g.prompt_key] = min(correct_lengths + ([h] if h is not None else []))
        expected.append(out)
    method = build_length_reward("hapo", {"weight": 0.8}, BUDGET)
    for g, e in zip(_run_calls(method, CALLS), expected):
        _assert_rows(g, e)
    assert method.state_dict() == {"history": history}


def test_hapo_does_not_penalise_short_incorrect_answers():
    method = build_length_reward("hapo", {}, BUDGET)
    method.shape([_group("p", None, [1.0, 0.0], [True, False], [20, 30])], 1)  # history: 20
    got = method.shape([_group("p", None, [1.0, 0.0, 0.0, 1.0], [True, False, False, True], [10, 10, 30, 30])], 2)
    assert got[0][1] == 0.0 and got[0][2] < 0.0  # shorter incorrect: no penalty; longer incorrect: penalised
    assert got[0][0] > 1.0 > got[0][3]  # correct and shorter than history: bonus; longer: less than 1


def test_deepcompress_running_accuracy():
    accuracy, expected = {}, []

    def sigmoid(x):
        return 1 / (1 + math.exp(-x))

    for step, groups in CALLS:
        out = []
        for g in groups:
            p = _pass(g)
            a = accuracy.get(g.prompt_key)
            a = p if a is None else 0.7 * a + 0.3 * p
            accuracy[g.prompt_key] = a
            lengths = g.lengths.tolist()
            mean, std = statistics.mean(lengths), statistics.pstdev(lengths)
            sign = -1.0 if a >= 0.6 else 1.0
            out.append([r + 0.4 * (1.0 if c else 0.0) * sigmoid(sign * ((n - mean) / std if std > 0 else 0.0))
                        for r, c, n, _ in _rows(g)])
        expected.append(out)
    method = build_length_reward("deepcompress", {"alpha": 0.4, "threshold": 0.6, "momentum": 0.3}, BUDGET)
    for g, e in zip(_run_calls(method, CALLS), expected):
        _assert_rows(g, e)
    assert method.state_dict()["accuracy"] == pytest.approx(accuracy, rel=1e-12)


STATEFUL = [
    ("laser_d", {"buckets": 3, "update_every": 2, "coverage": 0.6, "window": 3}),
    ("laser_d", {"buckets": 2, "update_every": 1, "difficulty": "task", "task_range": [2, 6]}),
    ("laconic", {"target": 25, "dual_lr": 0.3}),
    ("hapo", {"weight": 0.5}),
    ("deepcompress", {"momentum": 0.4}),
    ("adlp", {"lambda_init": 0.01, "lr": 0.2}),
]


@pytest.mark.parametrize("name,options", STATEFUL)
def test_state_round_trip_gives_the_uninterrupted_outputs(name, options):
    """Stopped after any call, saved through JSON and restored into a fresh instance: the remaining calls give
    exactly what the unstopped instance gave, and the state ends equal."""
    straight_method = build_length_reward(name, options, BUDGET)
    straight = _run_calls(straight_method, CALLS)
    for k in range(1, len(CALLS)):
        first = build_length_reward(name, options, BUDGET)
        _run_calls(first, CALLS[:k])
        resumed = build_length_reward(name, options, BUDGET)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert _run_calls(resumed, CALLS[k:]) == straight[k:], (name, k)
        assert resumed.state_dict() == straight_method.state_dict()


def test_bad_state_is_refused():
    with pytest.raises(ValueError, match="laconic lambda"):
        build_length_reward("laconic", {}, BUDGET).load_state_dict({"lambda": -1.0})
    with pytest.raises(ValueError, match="hapo expects keys"):
        build_length_reward("hapo", {}, BUDGET).load_state_dict({"lam": 1})
    with pytest.raises(ValueError, match="keeps no state"):
        build_length_reward("kimi", {}, BUDGET).load_state_dict({"x": 1})


# ----------------------------------------------------------------------------- group filter


def _best_first(keys, k):
    """Pick the best remaining index k times (lowest key, lowest index on ties), return them sorted."""
    left, kept = list(range(len(keys))), []
    for _ in range(min(k, len(keys))):
        best = left[0]
        for i in left[1:]:
            if keys[i] < keys[best]:
                best = i
        kept.append(best)
        left.remove(best)
    return sorted(kept)


def test_gfpo_keeps_the_shortest():
    groups = _batch()
    kept = check_kept(groups, build_group_filter("gfpo", {"keep": 3}, BUDGET).select(groups, 1), "gfpo")
    assert [k.tolist() for k in kept] == [_best_first(g.lengths.tolist(), 3) for g in groups]
    assert kept[2].tolist() == [0, 1, 2]  # equal lengths: ties go to the lower index
    assert kept[3].tolist() == [0, 1, 2]  # lengths 12, 8, 8 are the shortest of 12, 8, 8, 30, 50


def test_gfpo_reward_per_token():
    groups = _batch()
    kept = build_group_filter("gfpo", {"keep": 2, "metric": "reward_per_token"}, BUDGET).select(groups, 1)
    expected = [_best_first([-r / n for r, c, n, _ in _rows(g)], 2) for g in groups]
    assert [k.tolist() for k in kept] == expected


def test_gfpo_adaptive_keep_by_bucket():
    groups = _batch()
    ks = [1, 2, 4]
    kept = build_group_filter("gfpo", {"adaptive_keep": ks}, BUDGET).select(groups, 1)
    expected = [_best_first(g.lengths.tolist(), ks[_bucket_reference(g, 3)]) for g in groups]
    assert [k.tolist() for k in kept] == expected
    # pass rates 1/2, 1/3, 0, 1 -> buckets 1, 2, 2, 0; the hard group of 3 keeps min(4, 3)
    assert [len(k) for k in kept] == [2, 3, 4, 1]
    # by the task's label: [2, 6] in 3 bins, floor((d - 2)*3/4): 2 -> 0, 4 -> 1, 6 -> 2, 3 -> 0
    kept = build_group_filter("gfpo", {"adaptive_keep": ks, "difficulty": "task", "task_range": [2, 6]},
                              BUDGET).select(groups, 1)
    assert [k.tolist() for k in kept] == [
        _best_first(g.lengths.tolist(), ks[min(2, (g.difficulty - 2) * 3 // 4)]) for g in groups]


def test_task_difficulty_needs_a_label():
    f = build_group_filter("gfpo", {"adaptive_keep": [1, 2], "difficulty": "task", "task_range": [1, 3]}, BUDGET)
    with pytest.raises(ValueError, match="difficulty: task, but prompt z"):
        f.select([_group("z", None, [1.0], [True], [4])], 1)


# ----------------------------------------------------------------------------- options and registry


MINIMAL = {  # the fewest options each registered method needs; a new method must be added here
    "dapo_overlong": {"cache_len": 16}, "length_penalty": {"coef": 0.01}, "alp": {}, "laser": {"target_len": 20},
    "laser_d": {}, "kimi": {}, "laconic": {}, "grpo_lambda": {}, "hapo": {}, "curriculum": {"end": 20, "steps": 5},
    "dler": {}, "dast": {}, "deepcompress": {}, "hmpo": {}, "lead": {}, "adlp": {},
    "step_pruner": {}, "post_answer": {}, "grsp": {},  # read steps (tests/test_length_steps.py): one step each here
}


def test_every_registered_method_is_documented_and_shapes_the_batch():
    rewards = entries("length_reward")
    assert {e.name for e in rewards} == set(MINIMAL)
    for e in rewards + entries("group_filter"):
        assert e.formula and e.paper, e.name
    for e in rewards:
        method = build_length_reward(e.name, MINIMAL[e.name], BUDGET)
        for step, groups in CALLS[:3]:
            if method.step_delimiter() is not None:
                groups = [one_step_each(g) for g in groups]
            check_shaped(groups, method.shape(groups, step), e.name)
    # decs_curriculum: tests/test_decs_curriculum.py; duet: tests/test_duet.py
    assert {e.name for e in entries("group_filter")} == {"gfpo", "decs_curriculum", "duet"}


@pytest.mark.parametrize("kind,name,options,message", [
    ("length_reward", "alp", {"beta": -1}, "beta: must be a finite number >= 0, got -1"),
    ("length_reward", "alp", {"norm": 2.5}, "norm: must be an int"),
    ("length_reward", "laser", {}, "target_len: must be an int > 0, got 0"),
    ("length_reward", "laser", {"target_len": 10, "alpha": float("nan")}, "alpha:"),
    ("length_reward", "laser_d", {"coverage": 0}, "coverage:"),
    ("length_reward", "laser_d", {"buckets": True}, "buckets:"),
    ("length_reward", "laser_d", {"difficulty": "digits"}, "difficulty: must be one of pass_rate, task"),
    ("length_reward", "laser_d", {"difficulty": "task"}, "task_range:"),
    ("length_reward", "laser_d", {"task_range": [2, 6]}, "task_range: only with difficulty: task"),
    ("length_reward", "kimi", {"weight": -0.1}, "weight:"),
    ("length_reward", "laconic", {"dual_lr": float("inf")}, "dual_lr:"),
    ("length_reward", "grpo_lambda", {"inner": "alp"}, "inner: must be one of kimi, length_penalty, laser"),
    ("length_reward", "grpo_lambda", {"inner": "laser"}, "inner_options: target_len:"),
    ("length_reward", "grpo_lambda", {"inner_options": {"nope": 1}}, "inner_options: options: unknown"),
    ("length_reward", "grpo_lambda", {"min_correct_ratio": 1.5}, "min_correct_ratio:"),
    ("length_reward", "curriculum", {"end": 10}, "steps:"),
    ("length_reward", "curriculum", {"steps": 10}, "end:"),
    ("length_reward", "dler", {"easy_scale": 0}, "easy_scale:"),
    ("length_reward", "dler", {"easy_pass_rate": -0.1}, "easy_pass_rate:"),
    ("length_reward", "deepcompress", {"momentum": 0}, "momentum:"),
    ("length_reward", "hapo", {"window": 3}, "options: unknown option(s) ['window']"),
    ("group_filter", "gfpo", {}, "keep: give keep or adaptive_keep"),
    ("group_filter", "gfpo", {"keep": 2, "adaptive_keep": [1, 2]}, "keep: give keep or adaptive_keep"),
    ("group_filter", "gfpo", {"keep": 0}, "keep: must be an int > 0"),
    ("group_filter", "gfpo", {"adaptive_keep": [2, 0]}, "adaptive_keep:"),
    ("group_filter", "gfpo", {"keep": 2, "metric": "tokens"}, "metric: must be one of length, reward_per_token"),
])
def test_bad_options_name_the_option(kind, name, options, message):
    build = build_length_reward if kind == "length_reward" else build_group_filter
    with pytest.raises(ValueError) as err:
        build(name, options, BUDGET)
    assert str(err.value).startswith(message), str(err.value)


def test_budget_defaults_need_a_budget():
    for name, field in (("alp", "norm"), ("laconic", "target"), ("dler", "truncate_at"), ("dast", "max_len")):
        with pytest.raises(ValueError, match=f"^{field}: 0 means the generation budget"):
            build_length_reward(name, {}, 0)
