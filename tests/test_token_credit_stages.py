"""Token credit from group statistics (megapo/algorithms/token_credit.py, GROUP_TOKEN_STAGES): TEMPO's prefix-tree TD
correction, GTPO's conflict tokens and entropy filter (Group-relative Trajectory-based PO), KTAE's key-token
scores, TW-GRPO's intra-group variance weights. Each against its formula written out here as a plain float64
loop; the result for a sample depends on its own group only (the batch's group order, the order inside a group,
a partition of the batch into groups); bad options refused at config time naming algorithm.stages[i]; the
pipeline runs them on the train batch reading only their declared inputs. None has a gradient path (they
reshape advantages or give detached weights), so no finite-difference check."""

from __future__ import annotations

import math
import random
import sys
from functools import partial

import pytest

from megapo.algorithms.token_credit import group_token_stage

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import algorithm_configs  # noqa: E402

config_data = partial(algorithm_configs.config_data, n_samples=4)
make_cfg = partial(algorithm_configs.make_cfg, n_samples=4)


def rand_groups(seed, n_groups, group_size, vocab=4, max_len=7, shared_prefix=2):
    """Responses with shared prefixes (so trees branch and tokens collide), advantages, π_old log-probs and
    entropies, groups contiguous."""
    rng = random.Random(seed)
    responses, adv, logp, ent = [], [], [], []
    for _ in range(n_groups):
        stem = [rng.randrange(vocab) for _ in range(shared_prefix)]
        rewards = [float(rng.random() < 0.5) for _ in range(group_size)]
        if len(set(rewards)) == 1:
            rewards[0] = 1.0 - rewards[0]
        mean = sum(rewards) / group_size
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / group_size)
        for r in rewards:
            n = rng.randrange(0, max_len + 1)
            responses.append((stem + [rng.randrange(vocab) for _ in range(n)])[: max(n, 1)])
            adv.append((r - mean) / std)
        for resp in responses[-group_size:]:
            logp.append([-rng.random() * 3 for _ in resp])
            ent.append([rng.random() * 2 + 0.01 for _ in resp])
    return responses, adv, logp, ent


def run(name, responses, adv, logp, ent, group_size, **options):
    out = group_token_stage(name, responses, group_size=group_size, advantages=adv, old_logp=logp, entropy=ent,
                            **options)
    return [o.tolist() for o in out]


def close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=1e-12, abs=1e-14)


# ----------------------------------------------------------------------------- the formulas, as loops


def tempo_loop(responses, adv, n, coef):
    out = []
    for i, resp in enumerate(responses):
        group = range(i // n * n, i // n * n + n)

        def value(prefix):
            below = [k for k in group if responses[k][: len(prefix)] == prefix]
            return sum(adv[k] for k in below) / len(below), len(below)

        row = []
        for t in range(len(resp)):
            (v_parent, d_parent), (v_child, d_child) = value(resp[:t]), value(resp[: t + 1])
            row.append(adv[i] + coef * ((v_child - v_parent) if d_child < d_parent else 0.0))
        out.append(row)
    return out


def gtpo_trajectory_loop(responses, adv, ent, n, amplify, entropy_max):
    out = []
    for i, resp in enumerate(responses):
        group = range(i // n * n, i // n * n + n)
        if entropy_max is not None and resp and sum(ent[i]) / len(ent[i]) > entropy_max:
            out.append([0.0] * len(resp))
            continue
        row = []
        for t, v in enumerate(resp):
            pos = any(adv[k] > 0 and len(responses[k]) > t and responses[k][t] == v for k in group)
            neg = any(adv[k] < 0 and len(responses[k]) > t and responses[k][t] == v for k in group)
            if pos and neg:
                row.append(amplify * adv[i] if adv[i] > 0 else 0.0)
            else:
                row.append(adv[i])
        out.append(row)
    return out


def fisher_loop(a, b, c, d):
    """Two-sided Fisher exact p-value, exact in fractions."""
    from fractions import Fraction

    n, row, col = a + b + c + d, a + b, a + c

    def prob(k):
        return Fraction(math.comb(col, k) * math.comb(n - col, row - k), math.comb(n, row))

    observed = prob(a)
    return float(sum(prob(k) for k in range(max(0, row + col - n), min(row, col) + 1) if prob(k) <= observed))


def ig_loop(a, b, c, d):
    def ent(*counts):
        total = sum(counts)
        return -sum(x / total * math.log2(x / total) for x in counts if x)

    n = a + b + c + d
    return ent(a + c, b + d) - sum((x + y) / n * ent(x, y) for x, y in ((a, b), (c, d)) if x + y)


def bm25_loop(count, total, other):
    f = count / total
    return f * 3 / (f + 2 * (0.5 + 0.5 * total / ((total + other) / 2)))


def ktae_loop(responses, adv, n, coef=1.0, fisher=1.0, info_gain=1.0, term_frequency=True):
    out = []
    for i, resp in enumerate(responses):
        group = list(range(i // n * n, i // n * n + n))
        pos = [k for k in group if adv[k] > 0]
        neg = [k for k in group if adv[k] <= 0]
        row = []
        for v in resp:
            score = 0.0
            if pos and neg:
                a = sum(1 for k in pos if v in responses[k])
                b = sum(1 for k in neg if v in responses[k])
                table = (a, b, len(pos) - a, len(neg) - b)
                p = fisher_loop(*table)
                sig = 0.0 if p == 1.0 else math.exp(-2 * p)
                x = math.asin(math.sqrt(a / len(pos))) - math.asin(math.sqrt(b / len(neg)))
                if term_frequency:
                    n_pos = sum(len(responses[k]) for k in pos)
                    n_neg = sum(len(responses[k]) for k in neg)
                    tf_p = bm25_loop(sum(responses[k].count(v) for k in pos), n_pos, n_neg)
                    tf_n = bm25_loop(sum(responses[k].count(v) for k in neg), n_neg, n_pos)
                    x += tf_p / (tf_n + 1e-5) - tf_n / (tf_p + 1e-5)
                z = (fisher * sig + info_gain * ig_loop(*table)) * x / (fisher + info_gain)
                score = coef * (2 / (1 + math.exp(-z)) - 1) if z > -700 else -coef
            row.append(adv[i] + score)
        out.append(row)
    return out


def tw_grpo_loop(responses, logp, n, max_weight):
    out = []
    for i, resp in enumerate(responses):
        group = range(i // n * n, i // n * n + n)

        def var(t):
            p = [math.exp(logp[k][t]) for k in group if len(responses[k]) > t]
            m = sum(p) / len(p)
            return sum((x - m) ** 2 for x in p) / len(p)

        width = max(len(responses[k]) for k in group)
        lo, hi = min(var(t) for t in range(width)), max(var(t) for t in range(width))
        out.append([1 + (max_weight - 1) * (var(t) - lo) / (hi - lo + 1e-8) for t in range(len(resp))])
    return out


# ----------------------------------------------------------------------------- (a) values against the loops


def test_tempo_against_a_loop():
    responses, adv, logp, ent = rand_groups(0, 3, 5)
    got = run("tempo", responses, adv, None, None, 5, coef=0.7)
    close(got, tempo_loop(responses, adv, 5, 0.7))
    assert any(g != pytest.approx([a] * len(g)) for g, a in zip(got, adv))  # some token is at a branch


def test_tempo_by_hand_and_telescoping():
    """Two responses share a first token then branch: the TD term is 0 on the shared token, ±(A_i − V(root))
    at the branch; a response identical to another shares its leaf value."""
    responses = [[7, 1, 5], [7, 2], [7, 1, 5], [3]]
    adv = [1.0, -1.0, 0.5, -0.5]
    got = run("tempo", responses, adv, None, None, 4)
    # V(root) = 0, V([7]) = 1/6, V([7,1]) = V([7,1,5]) = 0.75, V([7,2]) = -1, V([3]) = -0.5
    assert got[0] == pytest.approx([1.0 + 1 / 6, 1.0 + 0.75 - 1 / 6, 1.0])
    assert got[1] == pytest.approx([-1.0 + 1 / 6, -1.0 - 1 - 1 / 6])
    assert got[3] == pytest.approx([-0.5 - 0.5])
    for g, a, resp in zip(got, adv, responses):  # Σ_t (Ã − A) = V(y_i) − mean A
        leaf = [adv[k] for k, r in enumerate(responses) if r == resp]
        assert sum(g) - a * len(g) == pytest.approx(sum(leaf) / len(leaf) - sum(adv) / 4)


@pytest.mark.parametrize("amplify, entropy_max", [(2.0, None), (1.5, 0.9)])
def test_gtpo_trajectory_against_a_loop(amplify, entropy_max):
    responses, adv, logp, ent = rand_groups(1, 3, 6, vocab=3)
    got = run("gtpo_trajectory", responses, adv, None, ent, 6, amplify=amplify, entropy_max=entropy_max)
    close(got, gtpo_trajectory_loop(responses, adv, ent, 6, amplify, entropy_max))
    flat = [x for g in got for x in g]
    assert any(x == 0.0 for x in flat)  # some negative conflict token skipped (or a response filtered)
    if entropy_max is not None:
        assert any(sum(e) / len(e) > entropy_max for e in ent) and any(sum(e) / len(e) <= entropy_max for e in ent)


@pytest.mark.parametrize("options", [{"coef": 0.4}, {"fisher": 0.0, "term_frequency": False},
                                     {"info_gain": 0.0, "coef": 2.0}])
def test_ktae_against_a_loop(options):
    responses, adv, logp, ent = rand_groups(2, 3, 6, vocab=6, max_len=5)
    got = run("ktae", responses, adv, None, None, 6, **options)
    close(got, ktae_loop(responses, adv, 6, **options))
    assert any(g != pytest.approx([a] * len(g)) for g, a in zip(got, adv))


def test_ktae_by_hand():
    """Without the term-frequency term: token 9 in both correct responses and one of the two wrong ones; a
    token in every response has x = 0 (no score); a group of equal outcomes keeps its advantages."""
    responses = [[1, 9, 5], [1, 9, 4, 5], [2, 9, 5], [2, 5]] + [[1], [2], [3], [4]]
    adv = [1.0, 1.0, -1.0, -1.0] + [0.0] * 4
    got = run("ktae", responses, adv, None, None, 4, term_frequency=False, fisher=0.0)
    # table (2, 1 | 0, 1): IG = 1 − (3/4)·h(1/3) bits, h(x) = asin√1 − asin√(1/2) = π/4
    ig = 1 - 0.75 * (-(1 / 3) * math.log2(1 / 3) - (2 / 3) * math.log2(2 / 3))
    s9 = 2 / (1 + math.exp(-ig * math.pi / 4)) - 1
    s1 = 2 / (1 + math.exp(-1.0 * math.pi / 2)) - 1  # token 1: (2, 0 | 0, 2), IG = 1 bit, h = π/2
    assert got[0] == pytest.approx([1 + s1, 1 + s9, 1.0])
    assert got[3] == pytest.approx([-1 - s1, -1.0])  # token 2 mirrors token 1
    assert got[4:] == [[0.0], [0.0], [0.0], [0.0]]
    assert fisher_loop(2, 0, 0, 2) == pytest.approx(1 / 3)  # the loop's Fisher test against a known value


def test_tw_grpo_against_a_loop():
    responses, adv, logp, ent = rand_groups(3, 3, 5)
    got = run("tw_grpo", responses, None, logp, None, 5, max_weight=1.6)
    close(got, tw_grpo_loop(responses, logp, 5, 1.6))
    for lo in range(0, 15, 5):  # per group the weights span [1, max_weight] (the last position has one sample)
        flat = [x for g in got[lo: lo + 5] for x in g]
        assert min(flat) == pytest.approx(1.0) and max(flat) == pytest.approx(1.6, rel=1e-6)


def test_tw_grpo_agreeing_group_weighs_one():
    got = run("tw_grpo", [[1, 2], [1, 2]], None, [[-0.5, -0.1], [-0.5, -0.1]], None, 2)
    assert got == [[1.0, 1.0], [1.0, 1.0]]


# ----------------------------------------------------------------------------- (b) group statistics only


ALL = [("tempo", {"coef": 0.7}), ("gtpo_trajectory", {"amplify": 1.5, "entropy_max": 0.9}), ("ktae", {"coef": 0.4}),
       ("tw_grpo", {"max_weight": 1.6})]


@pytest.mark.parametrize("name, options", ALL)
def test_a_sample_depends_on_its_group_only(name, options):
    """Shuffling the groups, shuffling inside each group, and running each group alone give every sample the
    same values (exactly: the per-group arithmetic is order-free up to float sums, 1e-12)."""
    n, groups = 5, 4
    responses, adv, logp, ent = rand_groups(4, groups, n, vocab=3)
    base = run(name, responses, adv, logp, ent, n, **options)
    rng = random.Random(9)
    order = list(range(groups))
    rng.shuffle(order)
    perm = []
    for gi in order:
        inside = list(range(gi * n, gi * n + n))
        rng.shuffle(inside)
        perm += inside
    shuffled = run(name, [responses[i] for i in perm], [adv[i] for i in perm], [logp[i] for i in perm],
                   [ent[i] for i in perm], n, **options)
    for j, i in enumerate(perm):
        assert shuffled[j] == pytest.approx(base[i], rel=1e-12, abs=1e-14)
    for gi in range(groups):  # a partition: each group as its own batch
        part = slice(gi * n, gi * n + n)
        alone = run(name, responses[part], adv[part], logp[part], ent[part], n, **options)
        close(alone, base[part])


# ----------------------------------------------------------------------------- (c) refusals at config time


@pytest.mark.parametrize("stages, field, words", [
    ([{"name": "tempo", "coef": -0.1}], "algorithm.stages[0]", "coef"),
    ([{"name": "tempo", "coef": float("nan")}], "algorithm.stages[0].coef", "finite"),
    ([{"name": "tempo", "lam": 1.0}], "algorithm.stages[0]", "lam"),
    ([{"name": "polarity"}, {"name": "ktae", "coef": "big"}], "algorithm.stages[1]", "coef"),
    ([{"name": "gtpo_trajectory", "amplify": 0.5}], "algorithm.stages[0]", "amplify"),
    ([{"name": "gtpo_trajectory", "entropy_max": 0}], "algorithm.stages[0]", "entropy_max"),
    ([{"name": "gtpo_trajectory", "amplify": True}], "algorithm.stages[0]", "amplify"),
    ([{"name": "tw_grpo", "max_weight": 0.5}], "algorithm.stages[0]", "max_weight"),
    ([{"name": "stapo"}, {"name": "tw_grpo", "floor": 0.1}], "algorithm.stages[1]", "floor"),
    ([{"name": "ktae", "fisher": 0, "info_gain": 0}], "algorithm.stages[0]", "info_gain"),
    ([{"name": "ktae", "fisher": -1}], "algorithm.stages[0]", "fisher"),
    ([{"name": "ktae", "term_frequency": "yes"}], "algorithm.stages[0]", "term_frequency"),
    ([{"name": "tempo"}, {"name": "polarity"}], "algorithm.stages[1]", "sequence stage"),
])
def test_bad_options_refused_naming_the_entry(stages, field, words):
    from megapo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        make_cfg(stages=stages)
    assert err.value.field == field and words in str(err.value)


def test_under_gae_the_advantage_stages_are_refused_and_tw_grpo_is_not():
    from megapo.config import ConfigError

    for name in ("tempo", "ktae", "gtpo_trajectory"):
        with pytest.raises(ConfigError) as err:
            make_cfg(advantage="gae", stages=[{"name": name}])
        assert err.value.field == "algorithm.stages[0]" and "sequence_advantage" in str(err.value)
    make_cfg(advantage="gae", stages=[{"name": "tw_grpo"}])


def test_a_group_filter_is_refused_with_them():
    """They read groups of rollout.n_samples; a group filter may keep groups of different sizes."""
    from megapo.config import ConfigError, from_dict
    from megapo.trainer.config import RunConfig, _check_group_filter

    for name in ("tempo", "ktae", "gtpo_trajectory", "tw_grpo"):
        data = config_data(stages=[{"name": name}])
        data["data"].update(group_filter="gfpo", group_filter_options={"keep": 2})
        with pytest.raises(ConfigError) as err:
            _check_group_filter(from_dict(RunConfig, data))
        assert err.value.field == "data.group_filter" and f"{name} (algorithm.stages[0])" in str(err.value)


def test_declared_inputs_decide_what_the_loop_computes():
    cases = {  # stage -> (old-log-prob pass, π_old's entropy)
        "tempo": (False, False),
        "ktae": (False, False),
        "gtpo_trajectory": (False, False),
        "tw_grpo": (True, False),
    }
    for name, want in cases.items():
        a = make_cfg(stages=[{"name": name}]).algorithm
        assert (a.needs_old_stats(), a.needs_old_entropy()) == want, name
    a = make_cfg(stages=[{"name": "gtpo_trajectory", "entropy_max": 2.0}]).algorithm
    assert a.needs_old_stats() and a.needs_old_entropy()


# ----------------------------------------------------------------------------- the pipeline on a train batch


def test_the_pipeline_runs_them_in_sequence_on_the_batch():
    from megapo.trainer.update import token_stages

    responses, adv, logp, ent = rand_groups(5, 2, 4, vocab=3)
    cfg = make_cfg(stages=[{"name": "gtpo_trajectory", "entropy_max": 1.2}, {"name": "tw_grpo", "max_weight": 1.3}])
    batch = [{"tokens": [11, 12] + r, "prompt_len": 2, "advantage": a, "old_logp": lp, "old_entropy": e}
             for r, a, lp, e in zip(responses, adv, logp, ent)]
    metrics = token_stages(batch, cfg, step=1)
    want_adv = gtpo_trajectory_loop(responses, adv, ent, 4, 2.0, 1.2)
    want_w = tw_grpo_loop(responses, logp, 4, 1.3)
    for sample, wa, ww in zip(batch, want_adv, want_w):
        assert sample["advantage"] == pytest.approx(wa, rel=1e-12, abs=1e-14)
        assert sample["token_weight"] == pytest.approx(ww, rel=1e-12)
    flat = [w for ww in want_w for w in ww]
    assert metrics == {"tw_grpo/weight_mean": pytest.approx(sum(flat) / len(flat), rel=1e-12)}


def test_after_a_per_token_stage_they_refuse_naming_the_order():
    from megapo.trainer.update import token_stages

    cfg = make_cfg(stages=[{"name": "advantage_reweighting"}, {"name": "ktae"}])
    cfg.rollout.n_samples = 2
    batch = [{"tokens": [1, 2, 3], "prompt_len": 1, "advantage": 1.0, "old_logp": [-0.1, -0.2]},
             {"tokens": [1, 4], "prompt_len": 1, "advantage": -1.0, "old_logp": [-0.3]}]
    with pytest.raises(ValueError, match="ktae reads one sequence advantage"):
        token_stages(batch, cfg, step=1)


def test_objectives_lists_them(capsys):
    from megapo.cli import main

    assert main(["objectives", "--stages"]) == 0
    rows = {line.split()[0]: line.split()[1:3] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["tempo"] == rows["ktae"] == rows["gtpo_trajectory"] == ["token", "sequence_advantage,response_tokens"]
    assert rows["tw_grpo"] == ["token", "old_logp"]


def test_gtpo_trajectory_by_hand():
    """Token 5 at position 0 is in a positive and a negative response: the negative one's update there is
    skipped, the positive one's amplified; token 5 at position 1 of the negative response is no conflict (no
    positive response has 5 there); the zero-advantage response conflicts with nobody."""
    responses = [[5, 6], [5, 5], [7, 6]]
    adv = [1.0, -2.0, 0.0]
    got = run("gtpo_trajectory", responses, adv, None, None, 3, amplify=3.0)
    assert got == [[3.0, 1.0], [0.0, -2.0], [0.0, 0.0]]
    ent = [[0.1, 0.2], [2.0, 3.0], [0.5, 0.5]]  # the second response's mean entropy 2.5 > 1: filtered out
    got = run("gtpo_trajectory", responses, adv, None, ent, 3, amplify=3.0, entropy_max=1.0)
    assert got == [[3.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
