"""tools/probe_inputs.py, the issue-22 probe: its classifier on made-up outcomes (the verdict written out per
outcome), and a few of its cheapest cases run for real through the same functions, so the probe cannot rot.

References: the classification rules (exit code, traceback, culprit named, wrong state) applied by hand to each
fake outcome; for the real cases the exit code and culprit each case's expectation names (2 and the field for a
config error) and the folder it must not create."""

from pathlib import Path

import pytest

from tools import probe_inputs as probe

TRACEBACK = 'Traceback (most recent call last):\n  File "x.py", line 1\nKeyError: \'num_experts\'\n'


@pytest.mark.parametrize("out, want", [
    (probe.Outcome(["megapo"], 2, stderr="megapo train: optim.lr: must be a finite number, got inf\n"), "good"),
    (probe.Outcome(["megapo"], 1, stderr=TRACEBACK), "poor"),  # refused, but with a traceback
    (probe.Outcome(["megapo"], 2, stderr=TRACEBACK + "megapo train: optim.lr: bad\n"), "poor"),
    (probe.Outcome(["megapo"], 2, stderr="megapo train: something is wrong\n"), "poor"),  # culprit not named
    (probe.Outcome(["megapo"], 1, stderr="megapo train: optim.lr: bad\n"), "poor"),  # exit 1, not 2
    (probe.Outcome(["megapo"], 0, stdout="step 1/2 | loss 0\n"), "wrong"),  # a bad input accepted
    (probe.Outcome(["megapo"], None, stderr=""), "wrong"),  # hung until the timeout
])
def test_classifier_on_made_up_outcomes(out, want):
    verdict, reason = probe.classify(out, rc=2, names=("optim.lr",))
    assert verdict == want, reason


def test_wrong_state_is_wrong_even_with_the_right_refusal(tmp_path):
    (tmp_path / "a").write_text("1")
    before = probe.snapshot(tmp_path)
    (tmp_path / "config.json").write_text("{}")  # written by a command that then refused
    wrong = probe.changed(before, probe.snapshot(tmp_path))
    assert wrong is not None and "config.json" in wrong
    out = probe.Outcome(["megapo"], 2, stderr="megapo train: optim.lr: bad\n")
    assert probe.classify(out, rc=2, names=("optim.lr",), wrong_state=wrong)[0] == "wrong"
    assert probe.changed(before, before) is None


def test_message_line_prefers_megapos_line():
    out = probe.Outcome(["megapo"], 2, stderr="2026 INFO loading\nmegapo train: train.steps: must be >= 1, got 0\n")
    assert probe.message_line(out) == "megapo train: train.steps: must be >= 1, got 0"
    assert probe.message_line(probe.Outcome(["x"], 1, stderr=TRACEBACK)) == "KeyError: 'num_experts'"


# one per kind of check: a field's number, YAML syntax, a data file's line, another command, a convention
CHEAP = ["config_optim_lr_.inf", "yaml_syntax_error", "jsonl_null_answer", "plot_missing_run", "mis_token_keeps_rho"]


def test_cheap_cases_run_and_hold(tmp_path, tiny_moe):
    """Each of these is a refusal the current code gets right (exit 2 naming the culprit, nothing written) or a
    convention it follows; a probe case that stopped running or a refusal that regressed fails here."""
    assert set(CHEAP) <= set(probe.CASES), sorted(set(CHEAP) - set(probe.CASES))
    ctx = probe.Ctx(tmp_path)
    ctx._model = Path(tiny_moe)  # the session's tiny model instead of `megapo tiny-model`
    results = {name: probe.run_case(ctx, name) for name in CHEAP}
    bad = {n: (r.verdict, r.reason, r.message) for n, r in results.items() if r.verdict != "good"}
    assert not bad, bad
    assert results["config_optim_lr_.inf"].rc == 2 and "optim.lr" in results["config_optim_lr_.inf"].message
    assert "config.yaml" in results["yaml_syntax_error"].message
