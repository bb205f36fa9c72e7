"""algorithm.stages, the declared pipeline of stages (megapo/algorithms/pipeline.py): the list checked once at
config time (unknown name, bad options, order, an input the run does not compute), each naming its entry; the
stage fields it replaced refused, naming the entry that replaces them; the loop computes only the inputs a stage
asks for; a pipeline gives the advantages and weights of its stage functions called in sequence; `megapo
objectives --stages` lists the stages."""

from __future__ import annotations

import re
import sys
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from megapo.config import ConfigError, from_dict, load_config
from megapo.trainer.config import RunConfig

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import algorithm_configs  # noqa: E402
from objective_loops import RecordingLearner  # noqa: E402

config_data = partial(algorithm_configs.config_data, n_samples=3, seed=5)
make_cfg = partial(algorithm_configs.make_cfg, n_samples=3, seed=5)

F64 = torch.float64


def refused(**algorithm) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        make_cfg(**algorithm)
    return err.value


# ----------------------------------------------------------------------------- the list, checked at config time


def test_a_token_stage_before_a_sequence_stage_is_refused():
    err = refused(stages=[{"name": "polarity"}, {"name": "stapo"}, {"name": "d3s_select"}])
    assert err.field == "algorithm.stages[2]" and "d3s_select" in str(err) and "algorithm.stages[1]" in str(err)
    make_cfg(stages=[{"name": "polarity"}, {"name": "d3s_select"}, {"name": "stapo"}, {"name": "token_select"}])


def test_unknown_stage_names_its_entry_and_the_known_ones():
    from megapo.algorithms.pipeline import STAGES

    err = refused(stages=[{"name": "polarity"}, {"name": "gtpoo"}])
    assert err.field == "algorithm.stages[1].name" and "'gtpoo'" in str(err)
    assert all(name in str(err) for name in STAGES)


@pytest.mark.parametrize("stages, field, words", [
    ([{"name": "polarity"}, {"name": "gtpo", "alpha3": 1}], "algorithm.stages[1]", "alpha3"),
    ([{"name": "token_select", "rho": 2.0}], "algorithm.stages[0]", "rho"),
    ([{"name": "nat_prefix", "rho": 0.5}], "algorithm.stages[0]", "rho"),
    ([{"name": "polarity"}, {"polarity": "negative"}], "algorithm.stages[1]", "name"),
    (["stapo"], "algorithm.stages[0]", "mapping"),
    ("stapo", "algorithm.stages", "list"),
])
def test_bad_entries_name_their_index(stages, field, words):
    err = refused(stages=stages)
    assert err.field == field and words in str(err)


def test_a_stage_whose_input_nobody_computes_is_refused():
    from megapo.algorithms.pipeline import INPUTS, check_inputs, parse_stages

    stages = parse_stages([{"name": "polarity"}, {"name": "future_drift"}, {"name": "stapo"}])
    with pytest.raises(ConfigError) as err:  # a run without a reference
        check_inputs(stages, set(INPUTS) - {"ref_logp"})
    assert err.value.field == "algorithm.stages[1]" and "future_drift reads ref_logp" in str(err.value)
    check_inputs(parse_stages([{"name": "future_drift", "against": "engine"}]), set(INPUTS) - {"ref_logp"})
    # in a config: gae's critic gives per-token advantages, no per-sample ones for polarity or gtpo to reshape
    err = refused(advantage="gae", stages=[{"name": "token_select"}, {"name": "gtpo"}])
    assert err.field == "algorithm.stages[1]" and "sequence_advantage" in str(err)
    assert refused(advantage="gae", stages=[{"name": "polarity"}]).field == "algorithm.stages[0]"


def test_stage_inputs_decide_what_the_loop_computes():
    """needs_old_stats / needs_old_entropy / needs_reference follow the declared inputs."""
    cases = {  # stages -> (old-log-prob pass, π_old's entropy, reference)
        (): (False, False, False),
        ("polarity",): (False, False, False),
        ("nat_prefix",): (False, False, False),
        ("advantage_reweighting",): (True, False, False),
        ("gtpo",): (True, True, False),
        ("token_select",): (True, True, False),
        ("future_drift",): (True, False, True),
    }
    for names, want in cases.items():
        a = make_cfg(stages=[{"name": n} for n in names]).algorithm
        assert (a.needs_old_stats(), a.needs_old_entropy(), a.needs_reference()) == want, names
    engine = make_cfg(stages=[{"name": "future_drift", "against": "engine"}]).algorithm
    assert engine.stage_inputs() >= {"old_logp", "rollout_logp"} and not engine.needs_reference()


def test_an_input_no_stage_asks_for_is_not_computed():
    from megapo.trainer.update import new_prompt_stats, old_logprob_pass

    for names, entropy in ((["advantage_reweighting"], False), (["stapo"], True)):
        cfg = make_cfg(stages=[{"name": n} for n in names])
        learner = RecordingLearner()
        batch = [{"tokens": [1, 2, 3, 4], "prompt_len": 2, "advantage": 1.0}]
        old_logprob_pass(learner, batch, cfg)
        assert learner.asked == [entropy] and batch[0]["old_logp"] == [-0.5, -0.5, -0.5]
        assert (batch[0].get("old_entropy") is not None) == entropy, names
    assert new_prompt_stats(make_cfg(stages=[{"name": "polarity"}])) is None  # no stage reads prompt_stats
    assert new_prompt_stats(make_cfg(stages=[{"name": "cumulative_std"}])) is not None


# ----------------------------------------------------------------------------- the fields algorithm.stages replaced


@pytest.mark.parametrize("old, value, stage", [
    ("advantage_polarity", "positive", "polarity"),
    ("pos_scale", 2.0, "polarity"),
    ("neg_scale", 0.5, "polarity"),
    ("sample_select", {"keep": 0.5}, "d3s_select"),
    ("advantage_smoothing", "cumulative", "cumulative_std"),
    ("clamp_correct_adv", True, "clamp_correct"),
    ("token_advantage", "gtpo", "gtpo"),
    ("token_advantage_options", {"alpha1": 0.3}, "gtpo"),
    ("kl_mode", "future", "future_kl"),
    ("token_select", {"rho": 0.2}, "token_select"),
    ("token_mask", "stapo", "stapo"),
    ("token_mask_options", {"prob_max": 0.1}, "stapo"),
])
def test_an_old_stage_field_names_the_entry_that_replaces_it(old, value, stage):
    with pytest.raises(ConfigError) as err:
        from_dict(RunConfig, config_data(**{old: value}))
    assert err.value.field == f"algorithm.{old}"
    assert "algorithm.stages: [{name: " in str(err.value) and stage in str(err.value)


def test_stages_from_a_command_line_override():
    cfg = load_config(RunConfig, None, [f"{k}={v}" for k, v in {
        "model.path": "/nonexistent", "algorithm.objective": "ppo", "data.task": "addition",
        "algorithm.stages": "[{name: polarity, polarity: positive}, {name: stapo, prob_max: 0.1}]"}.items()],
        validate=False)
    cfg._validate_algorithm()
    assert cfg.algorithm.stages == [{"name": "polarity", "polarity": "positive"}, {"name": "stapo", "prob_max": 0.1}]
    assert [s.name for s in cfg.algorithm.pipeline()] == ["polarity", "stapo"]


# ----------------------------------------------------------------------------- one pipeline, its functions in sequence


def groups_of(rewards, lengths):
    from megapo.tasks.base import Example
    from megapo.trainer.rollout import Group

    def sample(n):
        return SimpleNamespace(prompt_ids=[1, 2], output_ids=list(range(3, 3 + n)), logprobs=[-0.1] * n, routes=None,
                               finish_reason="stop")

    return [Group(Example(f"p{i}", "0"), [sample(n) for n in ns], list(r))
            for i, (r, ns) in enumerate(zip(rewards, lengths))]


def test_a_pipeline_gives_its_stage_functions_in_sequence():
    from megapo.algorithms import compute_advantages
    from megapo.algorithms.stages import apply_polarity, token_advantages, token_select_weights
    from megapo.trainer.update import token_stages, train_samples

    rewards, lengths = [[1.0, 0.0, 0.5], [0.0, 0.2, 1.0]], [[2, 3, 1], [4, 2, 3]]
    cfg = make_cfg(stages=[{"name": "polarity", "polarity": "both", "pos_scale": 0.5, "neg_scale": 2.0},
                           {"name": "gtpo", "alpha1": 0.3, "alpha2": 0.7},
                           {"name": "token_select", "score": "adv_entropy", "rho": 0.5, "weight": 0.25}])
    batch = train_samples(groups_of(rewards, lengths), cfg, step=2)
    g = torch.Generator().manual_seed(3)
    flat = [n for ns in lengths for n in ns]
    old = [(-torch.rand(n, generator=g, dtype=F64)).tolist() for n in flat]
    ent = [torch.rand(n, generator=g, dtype=F64).tolist() for n in flat]
    for sample, lp, h in zip(batch, old, ent):
        sample.old_logp, sample.old_entropy = lp, h
    metrics = token_stages(batch, cfg, step=2)

    # the same, written out: the estimator, then each stage's function on the previous one's output
    seq = apply_polarity(compute_advantages("grpo", torch.tensor(rewards, dtype=F64)), "both", 0.5, 2.0)
    per_token = token_advantages("gtpo", seq.reshape(-1), old, ent, group_size=3, alpha1=0.3, alpha2=0.7)
    weights = token_select_weights(per_token, ent, step=2, score="adv_entropy", rho=0.5, weight=0.25)
    for sample, a, w in zip(batch, per_token, weights):
        assert sample.advantage == pytest.approx(a.tolist(), rel=1e-13, abs=1e-15)
        assert sample.token_weight == w.tolist()
    assert metrics["token_select/kept_frac"] == pytest.approx(float(torch.cat(weights).eq(1).double().mean()))
    assert any(x < 0 for a in per_token for x in a.tolist()) and any(x > 0 for a in per_token for x in a.tolist())


def test_the_pipeline_sets_a_runners_advantages_after_checking_count_and_lengths():
    """A token stage's runner returns its per-sample advantages; run_token_stages writes them, and refuses a wrong
    count or a wrong length naming the stage and the sample, before writing any."""
    from megapo.algorithms.pipeline import Stage, StageDecl, TokenContext, run_token_stages
    from megapo.algorithms.sample import TrainSample

    def throwaway(values):  # a stage whose runner returns `values` as its advantages
        decl = StageDecl("token", "advantage_stage", (), lambda batch, s, ctx: (values, {}))
        return Stage("throwaway", {}, None, decl)

    def fresh():  # responses of 2 and 3 tokens
        return [TrainSample(tokens=[7, 1, 2], prompt_len=1, advantage=0.5),
                TrainSample(tokens=[7, 7, 1, 2, 3], prompt_len=2, advantage=-0.5)]

    ctx = TokenContext(group_size=2, step=0, seed=0, kl_coef=0.0)
    third = torch.tensor([1 / 3, -2 / 3], dtype=F64), torch.tensor([0.1, 0.2, 0.3], dtype=F64)
    batch = fresh()
    run_token_stages([throwaway(list(third))], batch, ctx)
    assert [x.advantage for x in batch] == [[1 / 3, -2 / 3], [0.1, 0.2, 0.3]]  # the float64 values, as Python floats
    for values, words in [([third[0]], "1 per-sample advantages for a batch of 2 samples"),
                          ([third[0], third[0]], "2 advantages for sample 1, whose response has 3 tokens"),
                          ([third[0], third[1].reshape(1, 3)],
                           "Tensor torch.Size([1, 3]) for sample 1; expected a 1-D floating tensor")]:
        batch = fresh()
        with pytest.raises(ValueError, match="^" + re.escape(f"advantage: stage throwaway returned {words}") + "$"):
            run_token_stages([throwaway(values)], batch, ctx)
        assert [x.advantage for x in batch] == [0.5, -0.5]  # nothing written


def test_objectives_lists_the_stages(capsys):
    from megapo.algorithms.pipeline import STAGES, entry
    from megapo.cli import main

    assert main(["objectives", "--stages"]) == 0
    rows = {line.split()[0]: line.split()[1:3] for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == set(STAGES)
    assert rows["polarity"] == ["sequence", "sequence_advantage"]
    assert rows["future_drift"] == ["token", "sequence_advantage,old_logp,ref_logp"]
    assert rows["nat_prefix"] == ["token", "seed,step"]
    assert all(entry(name).paper for name in STAGES)
