"""The held-out anytime accuracy of stage anytime (megapo/trainer/anytime_eval.py; Optimizing Anytime Reasoning via
Budget Relative Policy Optimization, arXiv:2505.13438) and `megapo bench anytime` (tools/bench/anytime.py).

Checked with a scripted engine: the greedy thinkings, then per budget the cut prefixes x ⊕ z[:b] ⊕ trigger and their
forced summaries, token for token against a loop written here; acc@b and the AUC against the formula written out (and
by hand); a budget longer than a thinking (one that ended: its own answer; one cut short: all of it summarised);
batches split over several engine calls; Run.evaluate's eval/anytime_acc@<b> and eval/anytime_auc on the task's test
split; refusals naming the field (the stage's eval_budgets, the command's flags); one `megapo train` step logging the
metrics at its eval steps; the command's JSON table from a tiny model.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from functools import partial
from types import SimpleNamespace

import pytest

from megapo.config import ConfigError
from megapo.engines.base import Sample
from megapo.tasks.base import Example

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import algorithm_configs  # noqa: E402
from scripted_engine import ScriptedEngine  # noqa: E402
from test_self_distill import CharTokenizer  # noqa: E402
from train_runs import train_rows  # noqa: E402

EOS = 2
TRIGGER = ";"
make_cfg = partial(algorithm_configs.make_cfg, n_samples=2)


class Tok(CharTokenizer):
    eos_token_id = EOS


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def text(tokens) -> str:
    return "".join(chr(t) for t in tokens)


def last_digits(s: str) -> str:
    """The last run of digits in s ("0" when there is none)."""
    runs = "".join(c if c.isdigit() else " " for c in s).split()
    return runs[-1] if runs else "0"


class BudgetEngine(ScriptedEngine):
    """Behind a prompt "…=" its script (thinking text, finish): the characters, EOS after them when it finished
    "stop"; behind a prompt ending in the trigger the summary: the last digits of the thinking before the trigger,
    then EOS. Both cut at max_new_tokens (finish "length"). Records every call."""

    def __init__(self, scripts: dict[str, tuple[str, str]]):
        self.scripts, self.calls, self.weight_version = scripts, [], 1

    def generate(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], params))
        return [[self._sample(list(p), params)] * params.n for p in prompts]

    def _sample(self, prompt, params):
        t = text(prompt)
        if t.endswith(TRIGGER):
            out, finish = ids(last_digits(t.rsplit("=", 1)[1][:-1])) + [EOS], "stop"
        else:
            thinking, finish = self.scripts[t]
            out = ids(thinking) + ([EOS] if finish == "stop" else [])
        if len(out) > params.max_new_tokens:
            out, finish = out[:params.max_new_tokens], "length"
        return Sample(prompt, out, [-0.1] * len(out), finish, self.weight_version)


def verify(example, response):
    return float(response.split(",")[-1] == example.answer)


# (prompt, thinking, finish, answer); budgets 2, 4, 8, 16; summaries of at most 4 tokens
CASES = [
    ("100+23=", "1,12,123", "stop", "123"),  # 9 tokens: at 8 its whole text (no EOS) is summarised
    ("50+5=", "5,55", "stop", "55"),  # 5 tokens: its own answer from 8 on
    ("90+9=", "9,99", "length", "99"),  # cut short at 4 tokens: summarised whole at 8 and 16
    ("70+7=", "7,70", "stop", "77"),  # wrong everywhere
    ("1+1233=", "123456", "stop", "1234"),  # at 4 the summary "1234" has no room for EOS: wrong
]
BUDGETS = [2, 4, 8, 16]
SUMMARY_TOKENS = 4


def setup(cases=CASES):
    engine = BudgetEngine({p: (z, f) for p, z, f, _ in cases})
    examples = [Example(p, a) for p, _, _, a in cases]
    return engine, examples, [ids(p) for p, *_ in cases]


def reference(cases, budgets, summary_tokens):
    """The per-budget summary prompts and each example's verdict at each budget, written out."""
    prompts_by_budget, right = [], [[None] * len(budgets) for _ in cases]
    for s, b in enumerate(budgets):
        prompts = []
        for i, (p, z, finish, answer) in enumerate(cases):
            z_ids = ids(z) + ([EOS] if finish == "stop" else [])
            if finish == "stop" and len(z_ids) <= b:  # ended within b: its own answer
                right[i][s] = z.split(",")[-1] == answer
                continue
            prompt = ids(p) + z_ids[:b] + ids(TRIGGER)
            prompts.append(prompt)
            summary = ids(last_digits(text(z_ids[:b]))) + [EOS]
            right[i][s] = len(summary) <= summary_tokens and text(summary[:-1]) == answer
        prompts_by_budget.append(prompts)
    return prompts_by_budget, right


def accuracy_formula(right, budgets):
    acc = [sum(1 for row in right if row[s]) / len(right) for s in range(len(budgets))]
    return acc, sum(acc) / len(budgets)


def test_cut_prefixes_summaries_and_verdicts_token_for_token():
    from megapo.trainer.anytime_eval import anytime_accuracy

    engine, examples, prompts = setup()
    r = anytime_accuracy(engine, Tok(), examples, prompts, verify, BUDGETS, ids(TRIGGER), SUMMARY_TOKENS)
    (thinking_prompts, thinking_params), *summary_calls = engine.calls
    assert thinking_prompts == prompts
    assert (thinking_params.n, thinking_params.temperature, thinking_params.max_new_tokens) == (1, 0.0, 16)
    assert thinking_params.stop_token_ids == (EOS,)
    want_prompts, want_right = reference(CASES, BUDGETS, SUMMARY_TOKENS)
    assert [c[0] for c in summary_calls] == want_prompts  # one call per budget, the cut prefixes in example order
    assert all((p.n, p.temperature, p.max_new_tokens) == (1, 0.0, SUMMARY_TOKENS) for _, p in summary_calls)
    assert r.right == want_right
    assert r.right == [[False, False, True, True], [False, True, True, True], [False, True, True, True],
                       [False] * 4, [False] * 4]  # the same by hand
    assert r.summaries == [5, 5, 2, 1]


def test_accuracy_per_budget_and_auc_are_the_formula():
    from megapo.trainer.anytime_eval import anytime_accuracy

    engine, examples, prompts = setup()
    r = anytime_accuracy(engine, Tok(), examples, prompts, verify, BUDGETS, ids(TRIGGER), SUMMARY_TOKENS)
    acc, auc = accuracy_formula(reference(CASES, BUDGETS, SUMMARY_TOKENS)[1], BUDGETS)
    assert r.accuracies() == acc == [0.0, 0.4, 0.6, 0.6]
    assert r.auc() == pytest.approx(auc, abs=1e-15) and auc == pytest.approx(0.4, abs=1e-15)
    assert r.metrics("eval/") == pytest.approx({"eval/anytime_acc@2": 0.0, "eval/anytime_acc@4": 0.4,
                                                "eval/anytime_acc@8": 0.6, "eval/anytime_acc@16": 0.6,
                                                "eval/anytime_auc": 0.4}, abs=1e-15)
    table = r.table()
    assert table["examples"] == 5 and table["budgets"] == BUDGETS and table["auc"] == pytest.approx(0.4, abs=1e-15)
    # ended: thinkings that stopped within the budget (9, 5, -, 5, 7 tokens)
    assert [row["ended"] for row in table["rows"]] == [0.0, 0.0, 0.6, 0.8]
    assert [row["summaries"] for row in table["rows"]] == [5, 5, 2, 1]
    assert table["mean_thinking_len"] == (9 + 5 + 4 + 5 + 7) / 5
    json.dumps(table)


def test_a_budget_longer_than_the_thinking_uses_all_of_it():
    from megapo.trainer.anytime_eval import anytime_accuracy

    cases = [("5+6=", "1,11", "stop", "11"), ("90+9=", "9,99", "length", "99")]
    engine, examples, prompts = setup(cases)
    r = anytime_accuracy(engine, Tok(), examples, prompts, verify, [3, 50, 100], ids(TRIGGER), 3)
    assert engine.calls[0][1].max_new_tokens == 100
    # the ended thinking: its own answer at 50 and 100 (no summary); the one cut short: summarised whole
    assert [c[0] for c in engine.calls[1:]] == [
        [ids("5+6=1,1;"), ids("90+9=9,9;")],
        [ids("90+9=9,99;")], [ids("90+9=9,99;")]]
    assert r.right == [[False, True, True], [False, True, True]] and r.summaries == [2, 1, 1]


def test_batches_split_over_engine_calls_give_the_same_prompts():
    from megapo.trainer.anytime_eval import anytime_accuracy

    engine, examples, prompts = setup()
    r = anytime_accuracy(engine, Tok(), examples, prompts, verify, BUDGETS, ids(TRIGGER), SUMMARY_TOKENS,
                         batch_size=2)
    assert [len(c[0]) for c in engine.calls] == [2, 2, 1, 2, 2, 1, 2, 2, 1, 2, 1]
    per_budget = reference(CASES, BUDGETS, SUMMARY_TOKENS)[0]
    got = [c[0] for c in engine.calls[3:]]
    assert got[0] + got[1] + got[2] == per_budget[0] and got[3] + got[4] + got[5] == per_budget[1]
    assert got[6] == per_budget[2] and got[7] == per_budget[3]
    assert r.accuracies() == [0.0, 0.4, 0.6, 0.6]


# ----------------------------------------------------------------------------- a training run's eval


class SumEngine(ScriptedEngine):
    """Behind "a+b=": "s;s" (s = a + b) cut at max_new_tokens; behind a prompt ending in the trigger: the digits
    before the first ";" of the thinking when it holds one, else "0", then EOS."""

    def __init__(self):
        self.calls, self.weight_version = [], 1

    def generate(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], params))
        out = []
        for p in prompts:
            t = text(p)
            head, thinking = t.split("=", 1)
            if t.endswith(TRIGGER) and thinking:  # a summary request: x ⊕ z[:b] ⊕ ";"
                cut = thinking[:-1]
                ids_ = ids(cut.split(";")[0] if ";" in cut else "0") + [EOS]
                finish = "stop"
            else:
                s = str(sum(int(x) for x in head.split("+")))
                ids_, finish = ids(f"{s};{s}")[:params.max_new_tokens], "length"
            out.append([Sample(list(p), ids_, [-0.1] * len(ids_), finish, 1)])
        return out


def test_run_evaluate_logs_the_anytime_accuracy_of_the_test_split():
    from megapo.tasks.registry import get_task
    from megapo.trainer.anytime import anytime_rollouts
    from megapo.trainer.rollout import sampling_params
    from megapo.trainer.run import Run

    cfg = make_cfg(stages=[{"name": "anytime", "budgets": [2, 4, 8], "trigger": TRIGGER, "eval_budgets": [3, 5, 7]}])
    cfg.data.task, cfg.train.eval_prompts = "addition_cot", 4
    tok = Tok()
    run = SimpleNamespace(cfg=cfg, engine=SumEngine(), tokenizer=tok, turns=None,
                          anytime=anytime_rollouts(cfg, tok, sampling_params(cfg, EOS, routes=False)))
    metrics = Run.evaluate(run)
    examples = get_task("addition_cot").examples("test", 4)
    # right at b exactly when "s;" fits in b tokens: the summary then reads s
    acc = [sum(len(ex.answer) + 1 <= b for ex in examples) / 4 for b in (3, 5, 7)]
    assert {k: v for k, v in metrics.items() if "anytime" in k} == pytest.approx(
        {"eval/anytime_acc@3": acc[0], "eval/anytime_acc@5": acc[1], "eval/anytime_acc@7": acc[2],
         "eval/anytime_auc": sum(acc) / 3}, abs=1e-15)
    assert len(set(acc)) > 1  # the budgets tell the examples apart
    assert "eval/accuracy" in metrics  # beside the plain held-out accuracy
    anytime_calls = [c for c in run.engine.calls if c[1].max_new_tokens == 7]
    assert [c[0] for c in anytime_calls] == [[ids(ex.prompt) for ex in examples]]


def test_eval_budgets_default_to_the_budgets():
    from megapo.algorithms.anytime import AnytimeOptions

    assert AnytimeOptions(budgets=[2, 4]).evaluated_budgets() == [2, 4]
    assert AnytimeOptions(budgets=[2, 4], eval_budgets=[1, 3, 8]).evaluated_budgets() == [1, 3, 8]


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("stage, field, words", [
    ({"eval_budgets": [4, 2]}, "algorithm.stages[0].eval_budgets", "increasing"),
    ({"eval_budgets": [0, 2]}, "algorithm.stages[0].eval_budgets", "positive ints"),
    ({"eval_budgets": "4"}, "algorithm.stages[0].eval_budgets", "positive ints"),
    ({"eval_budgets": [2, 9]}, "algorithm.stages[0].eval_budgets", "rollout.max_new_tokens=8"),
])
def test_bad_eval_budgets_refused_naming_the_field(stage, field, words):
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "anytime", "budgets": [2, 4], "trigger": TRIGGER, **stage}])
    assert err.value.field == field and words in str(err.value)


def bench_args(tmp_path, *argv):
    from tools.bench.anytime import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", str(tmp_path), "--out", str(tmp_path / "t.json"), *argv])


@pytest.mark.parametrize("argv, field, words", [
    (["--budgets", "4,2"], "--budgets", "increasing"),
    (["--budgets", "0,2"], "--budgets", "positive ints"),
    (["--budgets", "2,x"], "--budgets", "positive ints"),
    (["--budgets", "2", "--summary-tokens", "0"], "--summary-tokens", ">= 1"),
    (["--budgets", "2", "--batch-size", "0"], "--batch-size", ">= 1"),
    (["--budgets", "2", "--task", "addition"], "--trigger", "summary_trigger"),
    (["--budgets", "2", "--task", "nope"], "--task", "unknown task"),
    (["--budgets", "2", "--split", "dev"], "--split", "test"),
    (["--budgets", "2", "--n", "100000"], "--n", "the test split"),
    (["--budgets", "2"], "--model", "config.json"),
])
def test_bench_flags_refused_naming_the_flag(tmp_path, argv, field, words):
    from tools.bench.anytime import check_args

    with pytest.raises(ConfigError) as err:
        check_args(bench_args(tmp_path, *argv))
    assert err.value.field == field and words in str(err.value)


# ----------------------------------------------------------------------------- a run and the command


def test_megapo_train_logs_the_anytime_accuracy_at_its_eval_steps(tmp_path, tiny_moe):
    rows = train_rows(tmp_path, "anytime_eval", f"model.path={tiny_moe}", "train.steps=1", "data.prompts_per_step=2",
                      "rollout.n_samples=2", "rollout.max_new_tokens=6", "train.eval_every=1", "train.eval_prompts=4",
                      'algorithm.stages=[{name: anytime, budgets: [2, 4, 6], trigger: ";", summary_tokens: 3}]')
    evals = [r for r in rows if "eval/accuracy" in r]
    assert len(evals) == 2  # the start (step 0) and step 1
    for r in evals:
        acc = [r[f"eval/anytime_acc@{b}"] for b in (2, 4, 6)]
        assert all(round(a * 4) == pytest.approx(a * 4, abs=1e-12) for a in acc)  # shares of the 4 examples
        assert r["eval/anytime_auc"] == pytest.approx(math.fsum(acc) / 3, abs=1e-15)


def test_megapo_bench_anytime_writes_the_table(tmp_path, tiny_moe):
    from megapo.cli import main

    out = tmp_path / "table.json"
    assert main(["bench", "anytime", "--model", str(tiny_moe), "--budgets", "2,4", "--n", "3", "--summary-tokens",
                 "3", "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    assert table["task"] == "addition_cot" and table["trigger"] == ";" and table["examples"] == 3
    assert [row["budget"] for row in table["rows"]] == [2, 4]
    acc = [row["accuracy"] for row in table["rows"]]
    assert all(round(a * 3) == pytest.approx(a * 3, abs=1e-12) for a in acc)
    assert table["auc"] == pytest.approx(sum(acc) / 2, abs=1e-15)
    for row in table["rows"]:  # each example either ended within the budget or was summarised there
        assert row["summaries"] == pytest.approx(3 * (1 - row["ended"]), abs=1e-12)
