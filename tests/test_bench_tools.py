"""`megapo bench tools`' report from runs' metrics (synthetic rows here): start, final, best and gain per seed,
the tool metrics at the first and last eval, and a config without an environment refused."""

import argparse
import json

import pytest

from megapo.config import ConfigError


def write_run(folder, evals):
    folder.mkdir(parents=True)
    rows = []
    for step, acc, calls in evals:
        rows.append({"step": step, "reward": 0.5})
        rows.append({"step": step, "eval/accuracy": acc, "eval/env/tool_calls": calls, "eval/env/parse_errors": step,
                     "eval/env/tool_errors": 0.0, "eval/env/finish/answer": 1.0, "eval/env/turns": 1 + calls})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_numbers(tmp_path):
    from tools.bench.tools import write_report

    write_run(tmp_path / "seed-0", [(0, 0.1, 0.1), (10, 0.9, 1.0), (20, 0.8, 1.0)])
    write_run(tmp_path / "seed-1", [(0, 0.2, 0.0), (20, 0.5, 0.6)])
    summary = write_report(tmp_path, "cfg.yaml", 20)
    s0, s1 = summary["seeds"]
    assert (s0["start_accuracy"], s0["final_accuracy"], s0["best_accuracy"]) == (0.1, 0.8, 0.9)
    assert s0["gain"] == pytest.approx(0.8 - 0.1) and s1["gain"] == pytest.approx(0.5 - 0.2)
    assert s0["start"]["eval/env/tool_calls"] == 0.1 and s0["final"]["eval/env/parse_errors"] == 20
    table = (tmp_path / "table.md").read_text()
    assert "| seed-0 | 0.100 | 0.800 (0.900) | +0.700 |" in table and (tmp_path / "curves.png").is_file()


def test_config_without_environment_refused(tmp_path):
    from tools.bench.tools import run

    args = argparse.Namespace(out=str(tmp_path), config="megapo/configs/tiny_moe_addition.yaml", seeds=1, set=[],
                              report_only=True)
    with pytest.raises(ConfigError) as err:
        run(args)
    assert err.value.field == "env.name"
