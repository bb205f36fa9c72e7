"""`megapo bench length` without training: every method's config validates, bad arguments name the flag, and the
report's numbers (token cut, accuracy delta, the two targets) equal the formulas applied to hand-written cells;
the held-out eval's per-difficulty metrics against a count written out here."""

import argparse
import json
from pathlib import Path

import pytest

from megapo.config import ConfigError
from megapo.trainer.eval import EvalResult
from tools.bench import length as bench

ROOT = Path(__file__).resolve().parents[1]


def _plan(tmp_path, methods="all", seeds=2) -> bench.Plan:
    args = argparse.Namespace(config=str(ROOT / bench.DEFAULT_CONFIG), out=str(tmp_path / "out"), methods=methods,
                              seeds=seeds, steps=4, jobs=1, threads=1, report_only=False)
    return bench.plan_from_args(args)


def test_every_method_config_validates_and_bad_names_are_refused(tmp_path):
    plan = _plan(tmp_path)
    bench.validate(plan)  # each METHODS entry is a valid config of the base (options, dry run, combinations)
    assert plan.methods[0] == "baseline" and len(plan.cells()) == 2 * len(bench.METHODS)
    assert _plan(tmp_path, "kimi").methods == ["baseline", "kimi"]  # the baseline is always run
    with pytest.raises(ConfigError) as err:
        _plan(tmp_path, "kimi,nope")
    assert err.value.field == "--methods" and "nope" in err.value.message
    with pytest.raises(ConfigError) as err:
        _plan(tmp_path, seeds=0)
    assert err.value.field == "--seeds"


def _fake_cell(plan, method, seed, acc, tokens, by_digit):
    d = plan.cell_dir(bench.Cell(method, seed))
    d.mkdir(parents=True)
    rows = [{"step": 0, "eval/accuracy": 0.3, "eval/len/mean": 50.0},
            {"step": 2, "reward": 0.5},
            {"step": 4, "eval/accuracy": acc, "eval/len/mean": tokens, "eval/len/p90": tokens + 10,
             **{f"eval/len/d{k}": v for k, v in by_digit.items()}}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / bench.DONE_FILE).write_text(json.dumps({"seconds": 1.0}))


def test_report_numbers_follow_the_formulas(tmp_path):
    plan = _plan(tmp_path, "kimi,alp", seeds=2)
    _fake_cell(plan, "baseline", 0, 0.80, 100.0, {2: 50.0, 5: 150.0})
    _fake_cell(plan, "baseline", 1, 0.84, 80.0, {2: 40.0, 5: 120.0})
    _fake_cell(plan, "kimi", 0, 0.81, 50.0, {2: 20.0, 5: 80.0})
    _fake_cell(plan, "kimi", 1, 0.81, 50.0, {2: 20.0, 5: 80.0})
    _fake_cell(plan, "alp", 0, 0.70, 30.0, {2: 30.0, 5: 20.0})  # alp seed 1 unfinished: not counted
    summary = bench.write_report(plan)
    base_acc, base_tok = (0.80 + 0.84) / 2, (100.0 + 80.0) / 2
    kimi = summary["methods"]["kimi"]
    assert kimi["token_cut"] == pytest.approx(1 - 50.0 / base_tok)
    assert kimi["accuracy_delta"] == pytest.approx(0.81 - base_acc)
    assert kimi["hardest_over_easiest_tokens"] == pytest.approx(80.0 / 20.0)
    assert summary["methods"]["alp"]["seeds"] == 1
    assert summary["targets"]["cut_40pct_within_2pts"] == ["kimi"]  # cut 44 %, -1 point; alp cuts more but loses 12
    assert summary["targets"]["adaptive_hardest_over_easiest"] == {"baseline": pytest.approx(135.0 / 45.0),
                                                                   "alp": pytest.approx(20.0 / 30.0)}
    table = (plan.out / "table.md").read_text()
    assert "| kimi | 2 | 0.810 |" in table and "kimi." in table
    assert (plan.out / "pareto.png").stat().st_size > 0 and (plan.out / "tokens_by_difficulty.png").is_file()


def test_eval_metrics_by_difficulty():
    lengths, solved, digits = [5, 7, 20, 30, 31], [True, False, True, True, False], [2, 2, 5, 5, 5]
    r = EvalResult(3 / 5, 3, 5, sum(lengths) / 5, lengths, solved, digits, ["terse", "terse", "checked", "x", "x"])
    m = r.metrics("eval/")
    assert m["eval/kind/terse"] == 0.4 and m["eval/kind/checked"] == 0.2 and m["eval/kind/x"] == 0.4
    assert m["eval/accuracy"] == 0.6 and m["eval/acc_d2"] == 0.5 and m["eval/acc_d5"] == pytest.approx(2 / 3)
    assert m["eval/len/d2"] == 6.0 and m["eval/len/d5"] == pytest.approx(27.0) and m["eval/len/mean"] == 18.6
