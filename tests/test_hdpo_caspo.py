"""The last two self-distillation seed rows of issue 31: CASPO (stage caspo: opid's token self-distillation reward
with the model's own best response as the reference, megapo/algorithms/self_distill.py) and HDPO (stage hdpo:
privileged rollouts on all-fail prompts, megapo/trainer/privileged.py, trained behind the original prompt with
advantage λ).

Checked: caspo's per-token advantage against its formula written as a loop, and its default context; the cliff-group
detection and the privileged prompt's ids against hand-written cases; hdpo's advantage and, through policy_loss, its
loss and gradient (−λ/N per privileged token at ratio 1: the NLL's) against the formula; one step of the loop with a
scripted engine and a recording learner: all-fail groups get their correct privileged responses behind the original
prompt's ids, mixed groups get none, the learner recomputes their π_old routing freely and their μ is that π_old;
config refusals naming the field; `megapo objectives --formulas`; a two-step `megapo train` logging hdpo's metrics.
"""

from __future__ import annotations

import json
import math
import sys
from functools import partial

import numpy as np
import pytest
import torch

from megapo.algorithms import policy_loss
from megapo.algorithms.self_distill import TeacherInputs, self_distill_advantages
from megapo.config import ConfigError
from megapo.engines.base import Sample

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import algorithm_configs  # noqa: E402
from test_self_distill import CharTokenizer, CountingLearner, stand_in_logp  # noqa: E402
from scripted_engine import ScriptedEngine, Source  # noqa: E402
from train_runs import train_rows  # noqa: E402

make_cfg = partial(algorithm_configs.make_cfg, n_samples=2)
F64 = torch.float64
EOS = 2


# ----------------------------------------------------------------------------- CASPO


def test_caspo_advantage_against_its_formula():
    """A'_t = A_t + β·(log π(y_t | x ⊕ r) − log π_old(y_t | x)) at every response token, written out."""
    lengths = [3, 1, 4]
    adv = [0.5, -1.0, [0.1, 0.2, 0.3, 0.4]]
    old = [[-1.0, -2.0, -0.5], [-0.25], [-3.0, -1.0, -2.0, -0.1]]
    teacher = [[-0.5, -2.5, -0.5], [-1.25], [-1.0, -1.0, -4.0, -0.2]]
    beta = 0.3
    want = []
    for i, n in enumerate(lengths):
        row = []
        for t in range(n):
            a = adv[i][t] if isinstance(adv[i], list) else adv[i]
            row.append(a + beta * (teacher[i][t] - old[i][t]))
        want.append(row)
    got = self_distill_advantages("caspo", lengths=lengths, advantages=adv, teacher=TeacherInputs(teacher),
                                  old_logp=old, beta=beta)
    for g, w in zip(got, want):
        assert g.tolist() == pytest.approx(w, rel=1e-14, abs=1e-14)
    assert want[0] == pytest.approx([0.65, 0.35, 0.5])  # by hand: 0.5 + 0.3·(0.5, −0.5, 0)


def test_caspo_reads_the_groups_best_response_by_default():
    spec = make_cfg(stages=[{"name": "caspo"}]).algorithm.self_teacher()
    assert spec.context == "best_sample" and not spec.entropy and spec.contrast == 0
    assert make_cfg(stages=[{"name": "caspo", "context": "reference_answer"}]).algorithm.self_teacher().context == \
        "reference_answer"
    assert make_cfg(stages=[{"name": "caspo"}]).algorithm.needs_old_stats()  # π_old per token: the separate pass


# ----------------------------------------------------------------------------- HDPO: cliffs and prompts


def group(rewards, scores=None, correct=None, n_prompt=3):
    from megapo.tasks.addition import example
    from megapo.trainer.rollout import Group

    samples = [Sample(list(range(10, 10 + n_prompt)), [5, EOS], [-0.1, -0.2], "stop", 0) for _ in rewards]
    return Group(example(123_456), samples, list(rewards), scores=scores, correct=correct)


def test_cliff_groups_by_hand():
    from megapo.trainer.privileged import cliff_groups

    groups = [
        group([0.0, 0.0]),  # 0: all fail
        group([0.0, 1.0]),  # 1: mixed
        group([0.4, 0.49]),  # 2: below the threshold 0.5: all fail
        group([0.5, 0.0]),  # 3: 0.5 is correct (>=)
        group([1.0, 1.0], correct=[False, False]),  # 4: the length stage's verdicts win over the rewards
        group([-1.0, -1.0], scores=[0.0, 1.0]),  # 5: shaped rewards, the verifier's scores decide: mixed
        group([2.0, 2.0], scores=[0.0, 0.0]),  # 6: shaped up, but every score failed
        group([]),  # 7: no sample: no cliff
    ]
    assert cliff_groups(groups, 0.5) == [0, 2, 4, 6]
    assert cliff_groups(groups, 0.3) == [0, 4, 6]  # 0.4 passes now


def test_privileged_prompt_ids_by_hand():
    from megapo.tasks.base import Example
    from megapo.trainer.data import encode_example
    from megapo.trainer.privileged import privileged_prompt

    tok = CharTokenizer()
    encode = partial(encode_example, tok, chat_template=False)
    ex = Example("12+34=", "0046", {})
    from megapo.algorithms.self_distill import DEFAULT_TEMPLATE

    assert privileged_prompt(ex, DEFAULT_TEMPLATE, encode) == [ord(c) for c in
                                                               "Hint: a correct answer is 0046\n12+34="]
    assert privileged_prompt(ex, "[{hint}] {prompt}", encode) == [ord(c) for c in "[0046] 12+34="]
    chat = Example("q?", "7", {"messages": [{"role": "user", "content": "q?"}]})
    from megapo.trainer.self_teacher import with_context

    assert with_context(chat, "7", "{prompt} ({hint})").meta["messages"][-1]["content"] == "q? (7)"


# ----------------------------------------------------------------------------- HDPO: the term


def test_hdpo_advantage_and_loss_against_the_formula():
    """Privileged samples: A_t = λ on every token, the others' A_t kept; through ppo's token-mean loss at ratio 1
    the loss is −Σ_t A_t / N and its gradient in log π_θ(y_t|x) is −A_t / N: −λ/N at a privileged token, the NLL of
    the privileged response weighted λ."""
    lengths, lam = [2, 3, 1], 0.25
    adv = [0.7, [0.1, -0.2, 0.3], -0.4]
    privileged = [False, True, False]
    got = self_distill_advantages("hdpo", lengths=lengths, advantages=adv, teacher=None, privileged=privileged,
                                  lam=lam)
    want = [[0.7, 0.7], [0.25, 0.25, 0.25], [-0.4]]
    for g, w in zip(got, want):
        assert g.tolist() == pytest.approx(w, rel=0, abs=0)
    n = sum(lengths)
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.3, -2.0], [-1.5, 0.0, 0.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    a = torch.zeros(3, 3, dtype=F64)
    for i, row in enumerate(got):
        a[i, :len(row)] = row
    loss, _ = policy_loss("ppo", lp, lp.detach(), a, mask, loss_agg="token-mean")
    loss.backward()
    flat = [x for row in want for x in row]
    assert loss.item() == pytest.approx(-sum(flat) / n, rel=1e-14)
    grad = [[-x / n for x in row] for row in want]
    for i, row in enumerate(grad):
        assert lp.grad[i, :len(row)].tolist() == pytest.approx(row, rel=1e-14)
    with pytest.raises(ValueError, match="privileged"):
        self_distill_advantages("hdpo", lengths=lengths, advantages=adv, teacher=None, privileged=[True])


# ----------------------------------------------------------------------------- HDPO: one step of the loop


class AdditionEngine(ScriptedEngine):
    """Answers behind a hinted prompt with `hinted` (the hint's answer where the script says "right"), behind a
    plain prompt with the script of that prompt's text; records every call's prompts and parameters."""

    def __init__(self, plain: dict[str, list[str]], hinted: list[str]):
        self.plain, self.hinted, self.calls = plain, hinted, []
        self.weight_version = 1

    def generate(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], params))
        out = []
        for p in prompts:
            text = "".join(chr(i) for i in p)
            if text.startswith("Hint: a correct answer is "):
                answer = text.split("is ", 1)[1].split("\n", 1)[0]
                texts = [answer if h == "right" else "9999" for h in self.hinted[:params.n]]
            else:
                texts = self.plain[text][:params.n]
            out.append([self._sample(p, t, params) for t in texts])
        return out

    def _sample(self, prompt, text, params):
        ids = [ord(c) for c in text] + [EOS]
        routes = np.full((len(prompt) + len(ids) - 1, 1, 1), 7, np.int32) if params.return_routes else None
        return Sample(list(prompt), ids, [-0.01] * len(ids), "stop", self.weight_version, routes)


def test_cliff_groups_get_privileged_samples_behind_the_original_prompt():
    from megapo.tasks.addition import example
    from megapo.trainer.data import encode_example
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.privileged import privileged_rollouts
    from megapo.trainer.rollout import collect_rollouts, sampling_params
    from megapo.trainer.update import update_policy

    tok = CharTokenizer()
    cfg = make_cfg(stages=[{"name": "hdpo", "lam": 0.5, "max_privileged": 3}], routing_replay="r3")
    cfg.data.prompts_per_step = 2
    cliff, mixed = example(111_222), example(333_444)
    pool = [(ex, encode_example(tok, ex, False)) for ex in (cliff, mixed)]
    engine = AdditionEngine({cliff.prompt: ["0000", "0001"], mixed.prompt: [mixed.answer, "0000"]},
                            hinted=["right", "wrong", "right"])

    def reward(pairs):
        return [float(tok.decode(s.output_ids[:-1]) == ex.answer) for ex, s in pairs]

    params = sampling_params(cfg, EOS, routes=True)
    privileged = privileged_rollouts(cfg, tok, params)
    groups, metrics, tokens = collect_rollouts(engine, params, pool, Source(), reward, cfg, privileged=privileged)
    # the second engine call: the cliff prompt only, with its reference answer, max_privileged responses, no routes
    (hinted_prompts, hinted_params), = engine.calls[1:]
    assert hinted_prompts == [[ord(c) for c in f"Hint: a correct answer is {cliff.answer}\n{cliff.prompt}"]]
    assert hinted_params.n == 3 and not hinted_params.return_routes
    assert metrics["hdpo/cliff_groups"] == 1 and metrics["hdpo/privileged_sampled"] == 3
    assert metrics["hdpo/privileged_kept"] == 2
    assert tokens == 4 * 5 + 3 * 5  # every response is 4 characters and EOS
    assert [g.privileged for g in groups] == [False, False, True]
    extra = groups[2]
    assert extra.example is cliff and extra.sample_ids == [0, 2] and extra.sampled == 3
    for s in extra.samples:  # behind the ORIGINAL prompt's ids, with the hinted call's routes dropped
        assert s.prompt_ids == pool[0][1] and s.output_ids == [ord(c) for c in cliff.answer] + [EOS]
        assert s.routes is None

    learner = CountingLearner(hook=True)
    out = update_policy(learner, groups, cfg, None, cfg.loss_spec(), StepTimer(), tokenizer=tok)
    kinds = [c[0] for c in learner.calls]
    assert kinds == ["logprobs", "train_step"]  # the old-log-prob pass, no other forward
    _, sequences, routes, _ = learner.calls[0]
    assert sequences[4:] == [pool[0][1] + [ord(c) for c in cliff.answer] + [EOS]] * 2
    assert routes[4] is None and routes[5] is None  # routed freely behind x: no route of the hinted call
    assert all((np.asarray(r) == 7).all() for r in routes[:4])  # the engine's routes replayed (r3)
    trained = learner.calls[-1][1]
    for s in trained[4:]:
        old = stand_in_logp(s["tokens"])[s["prompt_len"] - 1:].tolist()
        assert s["old_logp"] == pytest.approx(old, rel=1e-15)
        assert s["rollout_logp"] == s["old_logp"]  # μ := π_old behind x, not the hinted call's −0.01
        assert s["advantage"] == [0.5] * 5  # λ on every token
        assert np.asarray(s["routes"]).shape[0] == len(s["tokens"]) - 1  # the pass's routes, replayed in training
    # the mixed group trains on GRPO's advantages, the cliff group on zero; neither gets a privileged response
    first = [s["advantage"][0] for s in trained[:4]]
    assert first[:2] == [0.0, 0.0] and first[2] > 0 > first[3]
    assert all(s["rollout_logp"] == [-0.01] * 5 for s in trained[:4])
    assert out["hdpo/privileged_samples"] == 2


def test_mixed_groups_only_no_privileged_call():
    from megapo.tasks.addition import example
    from megapo.trainer.data import encode_example
    from megapo.trainer.privileged import privileged_rollouts
    from megapo.trainer.rollout import collect_rollouts, sampling_params

    tok = CharTokenizer()
    cfg = make_cfg(stages=[{"name": "hdpo"}])
    cfg.data.prompts_per_step = 1
    ex = example(555_111)
    engine = AdditionEngine({ex.prompt: ["0000", ex.answer]}, hinted=[])
    params = sampling_params(cfg, EOS, routes=False)
    groups, metrics, _ = collect_rollouts(
        engine, params, [(ex, encode_example(tok, ex, False))], Source(),
        lambda pairs: [float(tok.decode(s.output_ids[:-1]) == e.answer) for e, s in pairs], cfg,
        privileged=privileged_rollouts(cfg, tok, params))
    assert len(engine.calls) == 1 and [g.privileged for g in groups] == [False]
    assert metrics["hdpo/cliff_groups"] == 0 and metrics["hdpo/privileged_kept"] == 0


def test_with_dynamic_sampling_the_dropped_cliff_groups_get_privileged_samples():
    """Dynamic sampling drops the all-fail group from the RL batch; hdpo still looks at it and adds its privileged
    group after the kept ones."""
    from megapo.tasks.addition import example
    from megapo.trainer.data import encode_example
    from megapo.trainer.privileged import privileged_rollouts
    from megapo.trainer.rollout import collect_rollouts, sampling_params

    tok = CharTokenizer()
    cfg = make_cfg(stages=[{"name": "hdpo", "max_privileged": 2}])
    cfg.data.prompts_per_step, cfg.data.dynamic_sampling, cfg.data.max_sampling_rounds = 2, True, 1
    cliff, mixed = example(111_222), example(333_444)
    engine = AdditionEngine({cliff.prompt: ["0000", "0001"], mixed.prompt: ["0000", mixed.answer]},
                            hinted=["wrong", "right"])
    params = sampling_params(cfg, EOS, routes=False)
    groups, metrics, _ = collect_rollouts(
        engine, params, [(ex, encode_example(tok, ex, False)) for ex in (cliff, mixed)], Source(),
        lambda pairs: [float(tok.decode(s.output_ids[:-1]) == e.answer) for e, s in pairs], cfg,
        privileged=privileged_rollouts(cfg, tok, params))
    assert [(g.example, g.privileged) for g in groups] == [(mixed, False), (cliff, True)]
    assert metrics["dynamic/groups_kept"] == 1 and metrics["hdpo/cliff_groups"] == 1
    assert groups[1].sample_ids == [1] and metrics["hdpo/privileged_kept"] == 1


def test_privileged_groups_keep_whole_groups_per_dp_rank():
    from megapo.trainer.rollout import dp_whole

    assert dp_whole(["a", "b"], ["c", "d", "e"], 2) == ["a", "b", "c", "d"]
    assert dp_whole(["a", "b"], ["c"], 2) == ["a", "b"]
    assert dp_whole(["a"], ["c"], 1) == ["a", "c"]
    assert dp_whole([], ["c"], 1) == []  # no regular group left: the step is skipped as without hdpo


# ----------------------------------------------------------------------------- config and listing


@pytest.mark.parametrize("fields, field, words", [
    ({"stages": [{"name": "hdpo", "lam": 0}]}, "algorithm.stages[0].lam", "> 0"),
    ({"stages": [{"name": "hdpo", "max_privileged": 0}]}, "algorithm.stages[0].max_privileged", ">= 1"),
    ({"stages": [{"name": "hdpo", "max_privileged": 2.5}]}, "algorithm.stages[0].max_privileged", "an int"),
    ({"stages": [{"name": "hdpo", "template": "{prompt}"}]}, "algorithm.stages[0].template", "{hint}"),
    ({"stages": [{"name": "hdpo", "context": "best_sample"}]}, "algorithm.stages[0]", "unknown option"),
    ({"stages": [{"name": "hdpo"}], "old_policy": "engine"}, "algorithm.stages[0]", "old_policy=learner"),
    ({"stages": [{"name": "hdpo"}], "advantage": "gae", "critic": {"path": "policy"}}, "algorithm.advantage",
     "group estimator"),
    ({"stages": [{"name": "caspo", "beta": -1}]}, "algorithm.stages[0].beta", ">= 0"),
    ({"stages": [{"name": "caspo", "context": "skills"}]}, "algorithm.stages[0].context", "best_sample"),
    ({"stages": [{"name": "caspo"}, {"name": "opid"}]}, "algorithm.stages[1].context", "one context"),
])
def test_bad_options_refused_naming_the_field(fields, field, words):
    with pytest.raises(ConfigError) as err:
        make_cfg(**fields)
    assert err.value.field == field and words in str(err.value)


def test_objectives_lists_caspo_and_hdpo(capsys):
    from megapo.cli import main

    assert main(["objectives", "--formulas"]) == 0
    out = capsys.readouterr().out
    for name, words in (("caspo", "Consequence-Aware Safety Policy Optimization"),
                        ("hdpo", "Hybrid Distillation Policy Optimization via Privileged Self-Distillation")):
        row = next(line for line in out.splitlines() if line.split()[:1] == [name] and not line.startswith(" "))
        assert words in row
    assert "A'_t = A_t + β·(log π_old(y_t | x ⊕ r, y_<t) − log π_old(y_t | x, y_<t))" in out
    assert "privileged sample: A'_t = λ on every token" in out
    assert main(["objectives", "--stages"]) == 0
    rows = {line.split()[0]: line.split()[1:3] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["caspo"] == ["token", "old_logp,self_teacher_logp"]
    assert rows["hdpo"] == ["token", "old_logp,privileged"]


# ----------------------------------------------------------------------------- one tiny run


# a reward in phases of 8 calls, in the order the trainer scores: a step's 4 prompts x 2 samples all fail, then
# the privileged round's 4 cliff prompts x 2 responses all pass (the config's start-up check, which passes the
# reference answer itself, is not counted)
PHASED = """CALLS = [0]


def phased(response, answer):
    if response == answer:
        return 1.0
    CALLS[0] += 1
    return float(((CALLS[0] - 1) // 8) % 2)
"""


def test_megapo_train_with_hdpo(tmp_path, tiny_moe):
    """Two steps of `megapo train` (the Megatron learner on CPU, r3 from the config) with caspo and hdpo: every group
    fails, every privileged response passes (a reward in phases), so each step trains 8 privileged samples behind
    their original prompts (routed freely under r3 beside the replayed ones) and logs hdpo's metrics; caspo's
    self-teacher pass (the group's best response in the prompt) runs on the same batch."""
    (tmp_path / "hdpo_phased.py").write_text(PHASED)
    rows = train_rows(tmp_path, "hdpo", f"model.path={tiny_moe}", "train.steps=2", "data.prompts_per_step=4",
                      "rollout.n_samples=2", "rollout.max_new_tokens=6", "data.reward=hdpo_phased:phased",
                      "train.log_samples=true",
                      "algorithm.stages=[{name: caspo}, {name: hdpo, lam: 0.5, max_privileged: 2}]")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["hdpo/cliff_groups"] == 4 and r["hdpo/privileged_sampled"] == 8
        assert r["hdpo/privileged_kept"] == 8 and r["hdpo/privileged_samples"] == 8
        assert r["reward"] == 0 and math.isfinite(r["train/loss"]) and r["train/loss"] != 0
        assert math.isfinite(r["mismatch/k3"])  # over the engine's own samples only
        assert r["time/self_teacher"] > 0 and math.isfinite(r["caspo/adv_shift"]) and r["caspo/adv_shift"] > 0
    logged = [json.loads(line) for line in (tmp_path / "hdpo" / "samples.jsonl").read_text().splitlines()]
    plain = {(r["step"], r["prompt_id"]): r["prompt_ids"] for r in logged if not r.get("privileged")}
    privileged = [r for r in logged if r.get("privileged")]
    assert len(privileged) == 16 and len(plain) == 8
    assert all(r["prompt_ids"] == plain[(r["step"], r["prompt_id"])] for r in privileged)  # the original prompt
