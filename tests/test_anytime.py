"""Stage anytime: AnytimeReasoner's budget summaries and BRPO (megapo/algorithms/anytime.py, megapo/trainer/anytime.py;
Optimizing Anytime Reasoning via Budget Relative Policy Optimization, arXiv:2505.13438).

Checked: the budget prior and the seeded draws (the same for the same train.seed and step, resumable); BRPO's
thinking advantages against the authors' loop written out here; the segment each thinking token falls in; the summary
baselines (one summary per budget: the group's mean at that budget; several: the same truncation's mean); one step of
the loop with a scripted engine and a recording learner (the summary prompts x ⊕ z[:b] ⊕ trigger, the budget rewards,
the summary group trained behind its own prompt with the engine's μ, every trained token's advantage); config
refusals naming the field; `megapo objectives --formulas`; one `megapo train` step with the stage on.
"""

from __future__ import annotations

import json
import math
import sys
from functools import partial

import numpy as np
import pytest
import torch

from megapo.algorithms.anytime import (AnytimeOptions, BudgetRewards, brpo_advantages, prior_weights, segment_of,
                                       step_budgets, summary_baselines, thinking_token_advantages)
from megapo.config import ConfigError
from megapo.engines.base import Sample

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import algorithm_configs  # noqa: E402
from test_self_distill import CharTokenizer, CountingLearner, stand_in_logp  # noqa: E402
from objective_loops import objectives_listing  # noqa: E402
from scripted_engine import ScriptedEngine, Source  # noqa: E402
from train_runs import train_rows  # noqa: E402

make_cfg = partial(algorithm_configs.make_cfg, n_samples=2)
F64 = torch.float64
EOS = 2


# ----------------------------------------------------------------------------- budgets


def test_prior_weights_by_hand():
    assert prior_weights([2, 4, 8], "uniform") == [1 / 3] * 3
    assert prior_weights([2, 4, 8], "linear") == [2 / 14, 4 / 14, 8 / 14]
    assert prior_weights([2, 4, 8], "base") == [0.0, 0.0, 1.0]


def test_every_budget_each_step_without_draws():
    o = AnytimeOptions(budgets=[2, 4, 8], prior="linear")
    assert step_budgets(o, seed=0, step=1) == ([2, 4, 8], [2 / 14, 4 / 14, 8 / 14])
    assert step_budgets(o, seed=5, step=9) == step_budgets(o, seed=0, step=1)


def test_budget_draws_are_seeded_by_seed_and_step():
    o = AnytimeOptions(budgets=[2, 4, 8, 16, 32], draws=3)
    draws = {step: step_budgets(o, seed=7, step=step) for step in range(1, 30)}
    for step, (support, weights) in draws.items():
        assert step_budgets(o, seed=7, step=step) == (support, weights)  # a resumed run draws the same
        assert support == sorted(set(support)) and set(support) <= set(o.budgets)
        assert all(w * 3 == pytest.approx(round(w * 3)) for w in weights)  # each a share of the 3 draws
        assert math.fsum(weights) == pytest.approx(1.0, abs=1e-15)
    assert len({tuple(s) for s, _ in draws.values()}) > 1  # the steps draw differently
    assert any(step_budgets(o, seed=8, step=s) != draws[s] for s in draws)  # so do the seeds
    # the shares are the draws' frequencies: many draws from a linear prior come close to it
    support, weights = step_budgets(AnytimeOptions(budgets=[1, 3], prior="linear", draws=20000), seed=0, step=1)
    assert support == [1, 3] and weights == pytest.approx([0.25, 0.75], abs=0.01)


# ----------------------------------------------------------------------------- BRPO


def brpo_loop(R, p):
    """The authors' compute_cot_advantage (variance_reduction brpo) for one group, written out."""
    G, S = len(R), len(R[0])
    p = [x / sum(p) for x in p]
    out = [[0.0] * S for _ in range(G)]
    for g in range(G):
        for s in range(S):
            cot_return = sum(R[g][j] * p[j] for j in range(s, S))
            avg_return = 0.0
            if G > 1:
                avg_return = sum(sum(R[h][j] * p[j] for j in range(s, S)) for h in range(G)) / G
            last = 0.0
            if s > 0:
                disc = [2.0 ** j for j in range(s)]
                prev = sum(R[g][j] * disc[j] for j in range(s)) / sum(disc)
                last = prev * sum(p[s:])
            out[g][s] = cot_return - (s * last + (S - s) * avg_return) / S
    return out


@pytest.mark.parametrize("G, S", [(4, 3), (8, 5), (1, 4), (3, 1)])
def test_brpo_against_the_authors_loop(G, S):
    gen = torch.Generator().manual_seed(G * 10 + S)
    R = torch.rand(G, S, generator=gen, dtype=F64).round()
    R[0] = torch.rand(S, generator=gen, dtype=F64)  # a mean over several summaries
    p = torch.rand(S, generator=gen, dtype=F64) + 0.1
    got = brpo_advantages(R, p)
    want = torch.tensor(brpo_loop(R.tolist(), p.tolist()), dtype=F64)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_brpo_at_the_first_budget_is_the_group_relative_return():
    R = torch.tensor([[1.0, 1.0], [0.0, 1.0]], dtype=F64)
    got = brpo_advantages(R, torch.tensor([0.5, 0.5], dtype=F64))
    # s = 0: ret − mean ret = (1 − 0.75, 0.5 − 0.75); s = 1: ret − (V1 + V2)/2 with V1 = R_{g,0} · 0.5, V2 = 0.5
    assert got.tolist() == [[0.25, 0.5 - (0.5 + 0.5) / 2], [-0.25, 0.5 - (0.0 + 0.5) / 2]]


def test_thinking_tokens_take_their_segments_advantage():
    adv = torch.tensor([0.5, -1.0, 2.0], dtype=F64)
    assert [segment_of(t, [2, 5, 6]) for t in range(8)] == [0, 0, 1, 1, 1, 2, None, None]
    assert thinking_token_advantages(8, [2, 5, 6], adv).tolist() == [0.5, 0.5, -1, -1, -1, 2, 0, 0]
    assert thinking_token_advantages(3, [2, 5, 6], adv).tolist() == [0.5, 0.5, -1]


def test_summary_baselines_one_and_several_summaries():
    R = [[0.0, 1.0], [1.0, 1.0], [0.0, 0.5]]
    one = BudgetRewards([2, 4], [0.5, 0.5], R, slots=[(0, 0, 2), (1, 1, 4), (2, 1, 3)])
    assert summary_baselines(one, [0.0, 1.0, 1.0], 1) == [1 / 3, 2.5 / 3, 2.5 / 3]
    # two summaries each: the mean of the same thinking's summaries after the same truncation
    several = BudgetRewards([2, 4], [0.5, 0.5], R, slots=[(2, 0, 2), (2, 0, 2), (2, 1, 3), (2, 1, 3), (0, 0, 2)])
    assert summary_baselines(several, [0.0, 1.0, 1.0, 0.0, 1.0], 2) == [0.5, 0.5, 0.5, 0.5, 0.0]  # a lone one: 0


# ----------------------------------------------------------------------------- one step of the loop


class SummaryEngine(ScriptedEngine):
    """Behind a plain prompt the script of that prompt's text (finish `length` where it has no EOS room); behind a
    prompt ending in the trigger ";" the right answer when the thinking before it has `right_cut` characters, else
    "0"; records every call."""

    def __init__(self, plain: dict[str, list[tuple[str, str]]], answer: str, right_cut: int, prompt_len: int):
        self.plain, self.answer, self.right_cut, self.prompt_len = plain, answer, right_cut, prompt_len
        self.calls, self.weight_version = [], 1

    def generate(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], params))
        out = []
        for p in prompts:
            text = "".join(chr(i) for i in p)
            if text.endswith(";"):
                cut = len(p) - self.prompt_len - 1
                right = self.answer if cut == self.right_cut else "0"
                out.append([self._sample(p, right, "stop", params)] * params.n)
            else:
                out.append([self._sample(p, t, why, params) for t, why in self.plain[text][:params.n]])
        return out

    def _sample(self, prompt, text, finish, params):
        ids = [ord(c) for c in text] + ([EOS] if finish == "stop" else [])
        routes = np.full((len(prompt) + len(ids) - 1, 1, 1), 7, np.int32) if params.return_routes else None
        return Sample(list(prompt), ids, [-0.01] * len(ids), finish, self.weight_version, routes)


def test_summaries_after_each_truncation_and_their_advantages():
    from megapo.tasks.base import Example
    from megapo.trainer.anytime import anytime_rollouts
    from megapo.trainer.data import encode_example
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.rollout import collect_rollouts, sampling_params
    from megapo.trainer.update import update_policy

    tok = CharTokenizer()
    cfg = make_cfg(stages=[{"name": "anytime", "budgets": [2, 4, 8], "trigger": ";", "summary_tokens": 5}],
                   routing_replay="r3")
    cfg.data.prompts_per_step = 1
    ex = Example("12+34=", "46")
    prompt = encode_example(tok, ex, False)
    # z0 "46" + EOS: ended within 4 and 8 (its own score, 1), cut at 2 ("46" without EOS); z1: 8 characters, cut
    # by max_new_tokens (finish length): summarised after 2, 4 and all 8 of them
    engine = SummaryEngine({ex.prompt: [("46", "stop"), ("2+4=6;46", "length")]}, ex.answer, right_cut=4,
                           prompt_len=len(prompt))

    def reward(pairs):
        return [float(tok.decode(s.output_ids[:-1] if s.finish_reason == "stop" else s.output_ids) == e.answer)
                for e, s in pairs]

    params = sampling_params(cfg, EOS, routes=True)
    anytime = anytime_rollouts(cfg, tok, params)
    groups, metrics, tokens = collect_rollouts(engine, params, [(ex, prompt)], Source(), reward, cfg,
                                               anytime=anytime)
    (summary_prompts, summary_params), = engine.calls[1:]
    z0, z1 = [ord(c) for c in "46"] + [EOS], [ord(c) for c in "2+4=6;46"]
    semi = [ord(";")]
    assert summary_prompts == [prompt + z0[:2] + semi, prompt + z1[:2] + semi, prompt + z1[:4] + semi,
                               prompt + z1 + semi]
    assert summary_params.n == 1 and summary_params.max_new_tokens == 5
    assert summary_params.return_routes  # the engine drew them behind exactly these prompts: their routes replay
    thinking, summaries = groups
    R = [[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]  # z1 summarised right only after its first 4 characters
    assert thinking.anytime.rewards == R and thinking.anytime.budgets == [2, 4, 8] and thinking.anytime.slots is None
    assert summaries.anytime.slots == [(0, 0, 2), (1, 0, 2), (1, 1, 4), (1, 2, 8)]
    assert summaries.rewards == [0.0, 0.0, 1.0, 0.0] and summaries.extra and not thinking.extra
    assert metrics["anytime/summaries"] == 4 and metrics["anytime/reward@4"] == 1.0
    assert metrics["anytime/score"] == pytest.approx((0 + 1 + 0.5) / 3)
    assert tokens == 3 + 8 + (2 + 2 + 3 + 2)  # the summaries "0", "0", "46", "0", each with EOS

    learner = CountingLearner(hook=True)
    update_policy(learner, groups, cfg, None, cfg.loss_spec(), StepTimer(), tokenizer=tok)
    assert [c[0] for c in learner.calls] == ["logprobs", "train_step"]
    trained = learner.calls[-1][1]
    adv = brpo_loop(R, [1 / 3] * 3)
    assert trained[0]["advantage"] == pytest.approx([adv[0][0]] * 2 + [adv[0][1]], abs=1e-15)
    assert trained[1]["advantage"] == pytest.approx([adv[1][0]] * 2 + [adv[1][1]] * 2 + [adv[1][2]] * 4, abs=1e-15)
    baseline = [sum(R[g][s] for g in range(2)) / 2 for s in (0, 0, 1, 2)]  # one summary: the group's mean at s
    for x, r, b, n in zip(trained[2:], [0.0, 0.0, 1.0, 0.0], baseline, [2, 2, 3, 2]):
        assert x["advantage"] == [r - b] * n  # a summary's own advantage on each of its tokens
        assert x["rollout_logp"] == [-0.01] * n  # μ: the engine's own log-probs behind this prompt
        old = stand_in_logp(x["tokens"])[x["prompt_len"] - 1:].tolist()
        assert x["old_logp"] == pytest.approx(old, rel=1e-15)
    assert [x["tokens"][:x["prompt_len"]] for x in trained[2:]] == summary_prompts


def test_a_group_whose_thinkings_all_ended_early_gets_no_summary_group():
    from megapo.tasks.base import Example
    from megapo.trainer.anytime import anytime_rollouts
    from megapo.trainer.data import encode_example
    from megapo.trainer.rollout import collect_rollouts, sampling_params

    tok = CharTokenizer()
    cfg = make_cfg(stages=[{"name": "anytime", "budgets": [4, 8], "trigger": ";"}])
    cfg.data.prompts_per_step = 1
    ex = Example("1+2=", "3")
    prompt = encode_example(tok, ex, False)
    engine = SummaryEngine({ex.prompt: [("3", "stop"), ("4", "stop")]}, ex.answer, 0, len(prompt))
    groups, metrics, _ = collect_rollouts(
        engine, sampling_params(cfg, EOS, routes=False), [(ex, prompt)], Source(),
        lambda pairs: [float(tok.decode(s.output_ids[:-1]) == e.answer) for e, s in pairs], cfg,
        anytime=anytime_rollouts(cfg, tok, sampling_params(cfg, EOS, routes=False)))
    assert len(engine.calls) == 1 and len(groups) == 1 and metrics["anytime/summaries"] == 0
    assert groups[0].anytime.rewards == [[1.0, 1.0], [0.0, 0.0]]


# ----------------------------------------------------------------------------- config and listing


@pytest.mark.parametrize("stage, field, words", [
    ({"budgets": [2, 4]}, "algorithm.stages[0].trigger", "summary_trigger"),
    ({"budgets": [2, 9], "trigger": ";"}, "algorithm.stages[0].budgets", "rollout.max_new_tokens=8"),
    ({"budgets": [], "trigger": ";"}, "algorithm.stages[0].budgets", "positive ints"),
    ({"budgets": [0, 4], "trigger": ";"}, "algorithm.stages[0].budgets", "positive ints"),
    ({"budgets": [2.5], "trigger": ";"}, "algorithm.stages[0].budgets", "positive ints"),
    ({"budgets": [4, 2], "trigger": ";"}, "algorithm.stages[0].budgets", "increasing"),
    ({"budgets": [2], "trigger": ";", "prior": "normal"}, "algorithm.stages[0].prior", "uniform"),
    ({"budgets": [2], "trigger": ";", "draws": -1}, "algorithm.stages[0].draws", ">= 0"),
    ({"budgets": [2], "trigger": ";", "summaries": 0}, "algorithm.stages[0].summaries", ">= 1"),
    ({"budgets": [2], "trigger": ";", "summary_tokens": True}, "algorithm.stages[0].summary_tokens", "an int"),
    ({"budgets": [2], "trigger": 3}, "algorithm.stages[0].trigger", "string"),
])
def test_bad_options_refused_naming_the_field(stage, field, words):
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "anytime", **stage}])
    assert err.value.field == field and words in str(err.value)


def test_the_task_gives_the_trigger():
    from megapo.config import from_dict
    from megapo.trainer.anytime_config import trigger_text
    from megapo.trainer.config import RunConfig

    data = algorithm_configs.config_data(stages=[{"name": "anytime", "budgets": [4]}])
    data["data"]["task"] = "addition_cot"
    cfg = from_dict(RunConfig, data)
    cfg._validate_algorithm()
    assert trigger_text(cfg, cfg.algorithm.pipeline()[0].options) == ";"


@pytest.mark.parametrize("change, field, words", [
    (lambda d: d["train"].update(mode="async"), "train.mode", "sync"),
    (lambda d: d["algorithm"].update(advantage="gae", critic={"path": "policy"}), "algorithm.advantage", "group"),
    (lambda d: d["algorithm"]["stages"].append({"name": "hdpo"}), "algorithm.stages[0]", "hdpo"),
    (lambda d: d["data"].update(length_reward="kimi"), "data.length_reward", "verifier's scores"),
])
def test_runs_it_cannot_serve_refused(change, field, words):
    data = algorithm_configs.config_data(stages=[{"name": "anytime", "budgets": [4], "trigger": ";"}])
    change(data)
    err = algorithm_configs.refusal(data)
    assert err.field == field and words in str(err)


def test_objectives_lists_anytime(capsys):
    row, out, inputs = objectives_listing(capsys, "anytime")
    assert "Optimizing Anytime Reasoning via Budget Relative Policy Optimization" in row and "2505.13438" in row
    assert "A_{g,s} = ret_{g,s} −" in out and "Assumption" in out
    assert inputs == ["token", "anytime"]


# ----------------------------------------------------------------------------- one tiny run


def test_megapo_train_with_anytime(tmp_path, tiny_moe):
    """One step of `megapo train` (the Megatron learner on CPU, r3 from the config) with stage anytime: the
    summaries after each truncation are drawn, scored and trained beside the thinkings."""
    rows = train_rows(tmp_path, "anytime", f"model.path={tiny_moe}", "train.steps=1", "data.prompts_per_step=2",
                      "rollout.n_samples=2", "rollout.max_new_tokens=6", "train.log_samples=true",
                      'algorithm.stages=[{name: anytime, budgets: [2, 4, 6], trigger: ";", summary_tokens: 3}]')
    (r,) = rows
    assert r["anytime/summaries"] > 0 and r["anytime/budgets"] == 3
    assert {"anytime/reward@2", "anytime/reward@4", "anytime/reward@6", "anytime/score"} <= set(r)
    assert math.isfinite(r["train/loss"])
    logged = [json.loads(line) for line in (tmp_path / "anytime" / "samples.jsonl").read_text().splitlines()]
    plain = [x for x in logged if not x.get("summary")]
    summaries = [x for x in logged if x.get("summary")]
    assert len(plain) == 4 and len(summaries) == r["anytime/summaries"]
    for x in summaries:  # behind x ⊕ z[:b] ⊕ trigger: one of the step's responses cut at a budget
        thinking = next(p for p in plain if x["prompt_ids"][:len(p["prompt_ids"])] == p["prompt_ids"]
                        and p["response_ids"][:len(x["prompt_ids"]) - len(p["prompt_ids"]) - 1]
                        == x["prompt_ids"][len(p["prompt_ids"]):-1])
        assert len(x["prompt_ids"]) - len(thinking["prompt_ids"]) - 1 in (2, 4, 6)
        assert len(x["response_ids"]) <= 3


def test_advantages_do_not_depend_on_how_the_groups_are_split():
    """Each group's advantages read its own BudgetRewards only: any split of the step's groups (over DP ranks or
    micro-batches) gives each sample the same per-token advantages as the whole batch."""
    from megapo.tasks.base import Example
    from megapo.trainer.anytime import anytime_token_advantages
    from megapo.trainer.rollout import Group

    gen = torch.Generator().manual_seed(3)

    def sample(n, finish="length"):
        return Sample([1, 2], list(range(3, 3 + n)), [-0.1] * n, finish, 1)

    groups = []
    for k in range(4):
        R = torch.rand(3, 2, generator=gen, dtype=F64).round().tolist()
        info = BudgetRewards([3, 6], [0.5, 0.5], R)
        groups.append(Group(Example(f"{k}+1=", str(k + 1)), [sample(6), sample(4, "stop"), sample(5)], [0.0] * 3,
                            anytime=info))
        groups.append(Group(Example(f"{k}+1=", str(k + 1)), [sample(2, "stop")] * 3, [1.0, 0.0, 1.0],
                            anytime=BudgetRewards(info.budgets, info.weights, R,
                                                  slots=[(0, 0, 3), (0, 1, 6), (2, 0, 3)])))
    whole = anytime_token_advantages(groups, 1)
    parts = [anytime_token_advantages(groups[i:i + 2], 1) for i in range(0, len(groups), 2)]
    assert all(torch.equal(a, b) for a, b in zip(whole, [x for p in parts for x in p]))
    assert len(whole) == 24 and [len(a) for a in whole[:6]] == [6, 4, 5, 2, 2, 2]
