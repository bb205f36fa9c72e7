"""The trainer's length stage (megapo/trainer/length_stage.py) and ragged groups in the loop, against formulas
written out here: shaped rewards, kept responses, per-group advantages of groups of different sizes, mini-batch
bounds over whole groups, the stage's state through JSON, and the config-time refusals naming the field."""

import json
import math
from pathlib import Path

import pytest
import torch

from megapo.config import ConfigError, load_config
from megapo.engines.base import Sample
from megapo.tasks.base import Example
from megapo.trainer.config import RunConfig
from megapo.trainer.length_stage import LengthStage
from megapo.trainer.rollout import Group
from megapo.trainer.update import group_advantages, mini_batch_bounds

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "megapo/configs/length_base.yaml"


def _cfg(*overrides) -> RunConfig:
    return load_config(RunConfig, CONFIG, ["rollout.n_samples=4", *overrides])


def _group(prompt: str, rewards: list[float], lengths: list[int], cut: tuple[int, ...] = ()) -> Group:
    samples = [Sample([1, 2], list(range(3, 3 + n)), [-0.1] * n, "length" if i in cut else "stop", 0)
               for i, n in enumerate(lengths)]
    return Group(Example(prompt, "0", difficulty=2), samples, list(rewards))


def test_length_penalty_through_the_stage_keeps_the_verifier_scores():
    stage = LengthStage(_cfg("data.length_reward=length_penalty", "data.length_reward_options={coef: 0.01}"))
    stage.begin_batch()
    raw = [[1.0, 0.0, 1.0, 0.3], [0.0, 0.0, 1.0, 1.0]]
    lengths = [[10, 20, 30, 40], [5, 6, 7, 8]]
    out = stage.apply([_group(f"p{i}", r, n) for i, (r, n) in enumerate(zip(raw, lengths))])
    for g, r, n in zip(out, raw, lengths):
        assert g.rewards == pytest.approx([ri - 0.01 * ni for ri, ni in zip(r, n)])
        assert g.scores == r and g.correct == [ri >= 0.5 for ri in r] and g.sampled == 4


def test_overlong_is_dapo_overlong_in_the_same_stage():
    stage = LengthStage(_cfg("data.overlong.enabled=true", "data.overlong.buffer=12", "data.overlong.penalty=0.5",
                             "rollout.max_new_tokens=112"))
    stage.begin_batch()
    lengths = [50, 100, 106, 112]
    [g] = stage.apply([_group("p", [1.0] * 4, lengths)])
    free = 112 - 12
    assert g.rewards == pytest.approx([1.0 - 0.5 * min(max(n - free, 0) / 12, 1.0) for n in lengths])


def test_gfpo_keeps_the_shortest_and_groups_become_ragged():
    cfg = _cfg("data.group_filter=gfpo", "data.group_filter_options={adaptive_keep: [2, 3]}")
    stage = LengthStage(cfg)
    stage.begin_batch()
    easy = _group("easy", [1.0, 1.0, 1.0, 0.0], [9, 4, 7, 5])  # pass rate 3/4: hardness 1/4, bucket 0, k = 2
    hard = _group("hard", [0.0, 1.0, 0.0, 0.0], [9, 4, 7, 5])  # pass rate 1/4: bucket 1, k = 3
    out = stage.apply([easy, hard])
    shortest = lambda g, k: sorted(sorted(range(4), key=lambda i: (len(g.samples[i].output_ids), i))[:k])
    for g, before, k in zip(out, (easy, hard), (2, 3)):
        assert [s.output_ids for s in g.samples] == [before.samples[i].output_ids for i in shortest(before, k)]
        assert g.rewards == [before.rewards[i] for i in shortest(before, k)]
    # advantages per group, over the kept ones only: GRPO written out with its unbiased std
    adv = group_advantages(out, cfg, step=1)
    for g, a in zip(out, adv):
        r = g.rewards
        mean = sum(r) / len(r)
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1))
        assert a.tolist() == pytest.approx([(x - mean) / (std + 1e-6) for x in r])


def test_clamp_correct_stage_keeps_correct_answers_non_negative():
    cfg = _cfg("algorithm.stages=[{name: clamp_correct}]", "data.length_reward=length_penalty",
               "data.length_reward_options={coef: 0.02}")
    stage = LengthStage(cfg)
    stage.begin_batch()
    [g] = stage.apply([_group("p", [1.0, 1.0, 1.0, 0.0], [5, 10, 60, 5])])  # the long correct one falls below mean
    [adv] = group_advantages([g], cfg, step=1)
    r = g.rewards
    mean = sum(r) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / 3)
    plain = [(x - mean) / (std + 1e-6) for x in r]
    assert plain[2] < 0  # the case the clamp is for
    assert adv.tolist() == pytest.approx([max(a, 0.0) if c else a for a, c in zip(plain, g.correct)])


def test_mini_batches_cut_between_whole_groups_of_any_size():
    assert mini_batch_bounds([3, 2, 4], 2) == [(0, 5), (5, 9)]
    assert mini_batch_bounds([3, 2, 4], 3) == [(0, 3), (3, 5), (5, 9)]
    assert mini_batch_bounds([4, 4], 5) == [(0, 4), (4, 8)]


def test_stage_state_through_json_shapes_as_the_unstopped_stage():
    cfg = _cfg("data.length_reward=laconic", "data.length_reward_options={target: 8, dual_lr: 0.5}")
    batches = [[_group(f"p{s}{i}", [1.0, 0.0, 1.0, 1.0], [4 + s, 9, 12 + i, 20]) for i in range(2)]
               for s in range(4)]
    unstopped, first = LengthStage(cfg), LengthStage(cfg)
    for b in batches[:2]:
        unstopped.begin_batch(), first.begin_batch()
        unstopped.apply(b), first.apply(b)
    resumed = LengthStage(cfg, json.loads(json.dumps(first.state_dict())))
    assert resumed.step == 2 and resumed.metrics() == unstopped.metrics() and unstopped.metrics()["length/lambda"] > 0
    for b in batches[2:]:
        unstopped.begin_batch(), resumed.begin_batch()
        assert [g.rewards for g in resumed.apply(b)] == [g.rewards for g in unstopped.apply(b)]
    with pytest.raises(ValueError, match="length state"):
        LengthStage(_cfg(), {"step": 1, "length_reward": {"lambda": 0.3}})  # state for a method not configured


@pytest.mark.parametrize("overrides, field", [
    (("data.length_reward=no_such",), "data.length_reward"),
    (("data.length_reward=laconic", "data.length_reward_options={dual_lr: -1}"), "data.length_reward_options"),
    (("data.length_reward=laconic", "data.length_reward_options={dual_rate: 1}"), "data.length_reward_options"),
    (("data.length_reward_options={coef: 1}",), "data.length_reward_options"),
    (("data.overlong.enabled=true", "data.length_reward=length_penalty"), "data.length_reward"),
    (("data.group_filter=gfpo", "data.group_filter_options={keep: 4}"), "data.group_filter_options"),
    (("data.group_filter=gfpo", "data.group_filter_options={keep: 2}", "algorithm.advantage=reinforce_pp_baseline"),
     "data.group_filter"),
])
def test_bad_length_options_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        _cfg(*overrides)
    assert err.value.field == field, err.value
