"""DECS's curriculum batch scheduling (group filter decs_curriculum, megapo/algorithms/token_length.py) against its
rule written out here as a loop: the groups kept each round (the mixed ones and ⌊κ·K/(1 − κ)⌋ all-correct ones),
κ's update after each step from the necessary-prefix ratio, the seeded draw, the state through JSON, the length
stage dropping whole groups and finding the answers, and the config-time refusals naming the field."""

import json
import math
from pathlib import Path

import pytest
import torch

from megapo.algorithms.length import ScoredGroup, build_group_filter
from megapo.algorithms.registry import entries
from megapo.algorithms.token_length import DecsCurriculum, nrp_ratios
from megapo.cli import main
from megapo.config import ConfigError, load_config
from megapo.engines.base import Sample
from megapo.tasks.base import Example
from megapo.trainer.config import RunConfig
from megapo.trainer.length_stage import LengthStage
from megapo.trainer.rollout import Group

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "megapo/configs/length_base.yaml"
N = 4


def _group(key: str, kind: str, first: int = 4, length: int = 8) -> ScoredGroup:
    """n = 4 responses of `length` tokens in steps of 2: mixed (two right), easy (all right) or wrong (none);
    every correct response first answers after `first` tokens."""
    right = {"mixed": [1, 0, 1, 0], "easy": [1] * N, "wrong": [0] * N}[kind]
    rewards = torch.tensor(right, dtype=torch.float64)
    return ScoredGroup(key, None, rewards, rewards >= 0.5, torch.full((N,), length, dtype=torch.int64),
                       torch.zeros(N, dtype=torch.bool), tuple(torch.full((length // 2,), 2) for _ in range(N)),
                       torch.tensor([first if r else -1 for r in right], dtype=torch.int64))


LEVEL = [3, 4, 4, 2, 4, 1, 3]  # each step's answer step (of 4), one less in every other group: p̄ up, down, up


def _round(step: int, r: int, mixed: int, easy: int, wrong: int) -> list[ScoredGroup]:
    """One round's groups; the answer positions move p̄ from step to step and differ between groups (the draw
    matters to p̄)."""
    kinds = ["mixed"] * mixed + ["easy"] * easy + ["wrong"] * wrong
    return [_group(f"s{step}r{r}g{i}", k, first=2 * max(1, LEVEL[step - 1] - i % 2)) for i, k in enumerate(kinds)]


# steps of rounds of (mixed, easy, wrong) groups
PLAN = [[(6, 5, 2)], [(3, 6, 1), (4, 4, 0)], [(5, 8, 3)], [(2, 6, 0), (2, 6, 2), (3, 2, 1)], [(4, 9, 1)],
        [(6, 4, 0), (1, 7, 1)], [(5, 5, 5)]]


def _drive(f: DecsCurriculum, steps: range) -> list:
    """Run the plan's `steps` through the filter as the length stage does: select, then observe the kept groups."""
    decisions = []
    for step in steps:
        for r, sizes in enumerate(PLAN[step - 1]):
            groups = _round(step, r, *sizes)
            kept = f.select(groups, step)
            f.observe([g for g, k in zip(groups, kept) if k.numel()], step)
            decisions.append([k.tolist() for k in kept])
    return decisions


def test_kept_groups_and_kappa_against_the_rule_written_out():
    lr = 0.9  # large enough that κ rises past 0 within the plan and all-correct groups come back
    f = build_group_filter("decs_curriculum", {"kappa_lr": lr, "ratio": "tokens"}, 64)
    kappa, last, seen_added, kappas = 0.0, 0.5, 0, []
    for step, rounds in enumerate(PLAN, start=1):
        K, ratios = 0, []
        for r, (mixed, easy, wrong) in enumerate(rounds):
            groups = _round(step, r, mixed, easy, wrong)
            kept = f.select(groups, step)
            f.observe([g for g, k in zip(groups, kept) if k.numel()], step)
            take = 0
            if kappa > 0:
                K += mixed
                q = int(kappa * K / (1 - kappa))
                if q > 0:
                    K = 0
                take = min(q, easy)
            kinds = ["mixed"] * mixed + ["easy"] * easy + ["wrong"] * wrong
            whole = [k.tolist() == list(range(N)) for k in kept]
            assert all(w or k.numel() == 0 for w, k in zip(whole, kept))  # whole groups or none
            assert [w for w, kind in zip(whole, kinds) if kind == "mixed"] == [True] * mixed
            assert not any(w for w, kind in zip(whole, kinds) if kind == "wrong")
            assert sum(w for w, kind in zip(whole, kinds) if kind == "easy") == take
            seen_added += take
            for g, w in zip(groups, whole):  # a_i/L_i of every kept correct response
                if w:
                    ratios += [int(a) / int(n) for a, n, c in zip(g.first_correct, g.lengths, g.correct) if c]
            assert f.kappa == pytest.approx(kappa) and f.mixed_since == (K if kappa > 0 else 0)
        p = sum(ratios) / len(ratios)
        if last != 0:
            kappa += lr * (p - last)
        last = p
        kappas.append(kappa)
    f.select([], len(PLAN) + 1)  # the next step's first round closes the last one
    assert f.kappa == pytest.approx(kappa) and f.last_ratio == pytest.approx(last)
    assert seen_added > 0 and min(kappas) < 0 < max(kappas)  # groups put back; κ rose and fell below 0


def test_quota_is_floor_of_kappa_k_over_one_minus_kappa_and_resets_k():
    f = build_group_filter("decs_curriculum", {"kappa_init": 0.3}, 64)
    easy = [_group(f"e{i}", "easy") for i in range(10)]
    # K = 2: ⌊0.3·2/0.7⌋ = 0, nothing back, K kept; K = 4: ⌊1.71⌋ = 1, K reset; K = 2 again: 0
    for mixed, want, k_after in ((2, 0, 2), (2, 1, 0), (2, 0, 2)):
        kept = f.select([_group(f"m{i}", "mixed") for i in range(mixed)] + easy, 1)
        assert sum(k.numel() > 0 for k in kept[mixed:]) == want and f.mixed_since == k_after
    assert math.floor(0.3 * 4 / 0.7) == 1


def test_kappa_at_or_below_zero_adds_none_and_keeps_no_count():
    f = build_group_filter("decs_curriculum", {}, 64)  # κ_0 = 0
    kept = f.select([_group("m", "mixed"), _group("e", "easy"), _group("w", "wrong")], 1)
    assert [k.numel() for k in kept] == [N, 0, 0] and f.mixed_since == 0


def test_nrp_ratio_in_steps_and_tokens():
    g = _group("g", "mixed", first=4, length=8)  # steps 2,2,2,2: the answer after the 2nd of 4 steps
    assert nrp_ratios(g, "steps") == [2 / 4, 2 / 4] and nrp_ratios(g, "tokens") == [4 / 8, 4 / 8]
    g = ScoredGroup("u", None, g.rewards, g.correct, torch.tensor([5, 5, 5, 5]), g.truncated,
                    tuple(torch.tensor([3, 2]) for _ in range(N)), torch.tensor([3, -1, -1, -1]))
    assert nrp_ratios(g, "steps") == [1 / 2]  # a correct response whose answer is not found has no ratio
    with pytest.raises(ValueError, match="^first_correct:"):
        nrp_ratios(ScoredGroup("b", None, g.rewards, g.correct, g.lengths, g.truncated), "tokens")


def test_the_draw_is_seeded_by_seed_step_and_round():
    def run(seed):
        f = build_group_filter("decs_curriculum", {"kappa_init": 0.6}, 64)
        f.seed = seed
        return _drive(f, range(1, len(PLAN) + 1))

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_a_restored_state_continues_as_the_uninterrupted_run():
    opts = {"kappa_lr": 0.9, "kappa_init": 0.1}
    whole = build_group_filter("decs_curriculum", opts, 64)
    whole.seed = 7
    want = _drive(whole, range(1, len(PLAN) + 1))
    for cut in (2, 4):
        first = build_group_filter("decs_curriculum", opts, 64)
        first.seed = 7
        got = _drive(first, range(1, cut + 1))
        resumed = build_group_filter("decs_curriculum", opts, 64)
        resumed.seed = 7
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        got += _drive(resumed, range(cut + 1, len(PLAN) + 1))
        assert got == want
        assert resumed.state_dict() == whole.state_dict()
    with pytest.raises(ValueError, match="^length state: decs_curriculum"):
        resumed.load_state_dict({"kappa": 0.1})


# ----------------------------------------------------------------------------- through the length stage


class CharTokenizer:
    """One token per character (id = its code point); id 0 the end of sequence, no text."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i == 0 else chr(i) for i in ids)


def _sample(text):
    ids = [ord(c) for c in text] + [0]
    return Sample([1, 2], ids, [-0.1] * len(ids), "stop", 0)


def _cfg(*overrides) -> RunConfig:
    return load_config(RunConfig, CONFIG, ["rollout.n_samples=3", "data.reward=megapo.tasks.addition_cot:reward",
                                           "data.group_filter=decs_curriculum", *overrides])


def _text_groups():
    """addition_cot's checker reads the text after the last ';': '4;7;7' first answers at its 2nd step of 3."""
    mixed = Group(Example("3+4=", "7", difficulty=1), [_sample("4;7;7"), _sample("4;5;7"), _sample("4;5;6")],
                  [1.0, 1.0, 0.0])
    easy = [Group(Example(f"{i}+0=", str(i), difficulty=1), [_sample(f"{i};{i}")] * 3, [1.0] * 3)
            for i in range(1, 7)]
    wrong = Group(Example("1+1=", "2", difficulty=1), [_sample("3")] * 3, [0.0] * 3)
    return [mixed, *easy, wrong]


def test_the_stage_drops_whole_groups_finds_answers_and_saves_its_state():
    cfg = _cfg("data.group_filter_options={step_delimiter: ';', kappa_init: 0.5}", "train.seed=11")
    stage = LengthStage(cfg, tokenizer=CharTokenizer())
    assert stage.filter.seed == 11
    stage.begin_batch()
    out = stage.apply(_text_groups())
    # κ = 0.5, K = 1: ⌊1⌋ = 1 all-correct group back; the all-wrong one and the other five dropped
    assert len(out) == 2 and out[0].example.prompt == "3+4=" and all(len(g.samples) == 3 for g in out)
    # steps '4;' '7;' '7<eos>': 2 of 3 steps for '4;7;7', 3 of 3 for '4;5;7'; an easy 'i;i<eos>' answers in its
    # first step ('i', the prefix less its ';'): 1 of 2
    assert stage.filter.ratio_sum / stage.filter.ratio_count == pytest.approx((2 / 3 + 1 + 3 * (1 / 2)) / 5)
    saved = json.loads(json.dumps(stage.state_dict()))
    stage.begin_batch()
    after = [[g.example.prompt for g in stage.apply(_text_groups())] for _ in range(2)]
    resumed = LengthStage(cfg, saved, tokenizer=CharTokenizer())
    resumed.begin_batch()
    assert [[g.example.prompt for g in resumed.apply(_text_groups())] for _ in range(2)] == after
    assert resumed.state_dict() == stage.state_dict()
    with pytest.raises(ValueError, match="^data.group_filter: decs_curriculum checks"):
        LengthStage(cfg)


# ----------------------------------------------------------------------------- config and registry


@pytest.mark.parametrize("options, field", [
    ("{kappa_lr: -1}", "data.group_filter_options.kappa_lr"),
    ("{kappa_lr: 0}", "data.group_filter_options.kappa_lr"),
    ("{kappa_init: 1.0}", "data.group_filter_options.kappa_init"),
    ("{initial_ratio: 1.5}", "data.group_filter_options.initial_ratio"),
    ("{ratio: chunks}", "data.group_filter_options.ratio"),
    ("{step_delimiter: ''}", "data.group_filter_options.step_delimiter"),
    ("{kapa_lr: 0.2}", "data.group_filter_options"),
])
def test_bad_options_are_refused_naming_the_field(options, field):
    with pytest.raises(ConfigError) as err:
        _cfg(f"data.group_filter_options={options}")
    assert err.value.field == field, str(err.value)


def test_refusals_of_the_combination_name_the_field():
    with pytest.raises(ConfigError) as err:
        _cfg("data.dynamic_sampling=true")
    assert err.value.field == "data.dynamic_sampling"
    with pytest.raises(ValueError, match="^rollout.n_samples: decs_curriculum"):  # the config's dry run calls it
        build_group_filter("decs_curriculum", {}, 64).check_group_size(1)
    with pytest.raises(ConfigError) as err:
        _cfg("algorithm.stages=[{name: decs, step_delimiter: ';'}]")
    assert err.value.field == "data.group_filter_options.step_delimiter"
    # whole groups: stage decs (which reads equal groups) is accepted with the same delimiter
    cfg = _cfg("algorithm.stages=[{name: decs, step_delimiter: ';'}]",
               "data.group_filter_options={step_delimiter: ';'}")
    assert cfg.data.group_filter == "decs_curriculum"


def test_objectives_list_it_with_its_paper_and_formula(capsys):
    assert main(["objectives", "--kind", "group_filter", "--formulas"]) == 0
    out = capsys.readouterr().out
    [e] = [e for e in entries("group_filter") if e.name == "decs_curriculum"]
    assert "Overthinking Reduction with Decoupled Rewards and Curriculum Data Scheduling" in e.paper
    assert e.name in out and e.formula.splitlines()[0].strip() in out
