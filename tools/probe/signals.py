"""Probe cases of the class 'poor: Ctrl-C / logprobs / plot': Ctrl-C mid-run checkpoints, `megapo logprobs`
on bad input files, and `megapo plot` on missing or cut-off runs.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

from tools.probe.inputs import _jsonl, _metrics_rows
from tools.probe.outcomes import MEGAPO, ROOT, RUN_TIMEOUT_S, Outcome, classify
from tools.probe.registry import case, refused


SIGNALS = "poor: Ctrl-C / logprobs / plot"


@case(SIGNALS, cheap=False)
def ctrl_c_mid_run_checkpoints(ctx):
    """SIGINT once step 1 is logged: the step in flight is finished, a checkpoint saved, exit 75, no traceback;
    then --resume continues and every step is logged once."""
    folder = ctx.fresh("ctrl_c")
    config = ctx.config(folder, train={"steps": 6, "ckpt_every": 0})
    argv = [str(MEGAPO), "train", str(config)]
    proc = subprocess.Popen(argv, cwd=ROOT, env=ctx.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = folder / "run" / "metrics.jsonl"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.is_file() and '"step": 1' in metrics.read_text():
                proc.send_signal(signal.SIGINT)
                break
            time.sleep(0.1)
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
        out = Outcome(argv, proc.returncode, stdout, stderr)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        out = Outcome(argv, None, stdout, stderr)
    ckpts = folder / "run" / "checkpoints"
    saved = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
    if out.rc == 0:
        return out, ("wrong", "the run finished instead of stopping on SIGINT (signal sent too late?)")
    verdict = classify(out, rc=75, wrong_state=None if saved else "no checkpoint after SIGINT")
    if verdict[0] != "good":
        return out, verdict
    resumed = ctx.train(config, flags=("--resume",), timeout=RUN_TIMEOUT_S)
    steps = [r["step"] for r in _metrics_rows(folder / "run") if r.get("step")]
    if resumed.rc != 0:
        return resumed, classify(resumed, rc=0)
    if sorted(steps) != list(range(1, 7)):
        return resumed, ("wrong", f"after the resume the metrics hold steps {steps}")
    return out, ("good", f"exit 75 with {saved[-1]}; --resume logged steps 1-6 once each")


def _logprobs(ctx, name, rows, *names, raw: bytes | None = None):
    folder = ctx.fresh(name)
    inp = folder / "in.jsonl"
    if raw is not None:
        inp.write_bytes(raw)
    elif rows is not None:
        _jsonl(inp, rows)
    out = ctx.megapo("logprobs", "--model", ctx.model, "--input", inp, "--output", folder / "out.jsonl")
    return refused(ctx, out, "--input", *names, forbid=(folder / "out.jsonl",))


@case(SIGNALS)
def logprobs_empty_file(ctx):
    return _logprobs(ctx, "logprobs_empty", [], "in.jsonl")


@case(SIGNALS)
def logprobs_missing_file(ctx):
    return _logprobs(ctx, "logprobs_missing", None, "in.jsonl")


@case(SIGNALS)
def logprobs_token_out_of_vocab(ctx):
    return _logprobs(ctx, "logprobs_oov", [{"tokens": [1, 2, 99999]}], "in.jsonl:1")


@case(SIGNALS)
def logprobs_line_not_json(ctx):
    return _logprobs(ctx, "logprobs_not_json", None, "in.jsonl:2", raw=b'{"tokens": [1, 2]}\n{"tokens": [1,\n')


@case(SIGNALS)
def logprobs_bad_layout(ctx):
    folder = ctx.fresh("logprobs_tp3")
    inp = _jsonl(folder / "in.jsonl", [{"tokens": [1, 2, 3]}])
    out = ctx.megapo("logprobs", "--model", ctx.model, "--input", inp, "--output", folder / "out.jsonl",
                     "--tp", "3")
    return refused(ctx, out, "tp", forbid=(folder / "out.jsonl",))


@case(SIGNALS)
def plot_missing_run(ctx):
    folder = ctx.fresh("plot_missing")
    out = ctx.megapo("plot", folder / "absent", "--out", folder / "c.png")
    return refused(ctx, out, "absent", forbid=(folder / "c.png",))


@case(SIGNALS)
def plot_run_without_metrics(ctx):
    folder = ctx.fresh("plot_no_metrics")
    (folder / "run").mkdir()
    out = ctx.megapo("plot", folder / "run", "--out", folder / "c.png")
    return refused(ctx, out, "metrics.jsonl", forbid=(folder / "c.png",))


@case(SIGNALS)
def plot_cut_off_last_metrics_line(ctx):
    """A run killed mid-write leaves a cut last line: good is a plot of the complete rows (exit 0, the png
    written, the cut line mentioned) or exit 2 naming metrics.jsonl and its line."""
    folder = ctx.fresh("plot_cut_line")
    (folder / "run").mkdir()
    rows = [json.dumps({"step": s, "reward": 0.1 * s, "response_len": 5}) for s in (1, 2, 3)]
    (folder / "run" / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 4, "rew')
    out = ctx.megapo("plot", folder / "run", "--out", folder / "c.png")
    if out.rc == 0:
        if not (folder / "c.png").is_file():
            return out, ("wrong", "exit 0 but no png written")
        if "metrics.jsonl" in out.text and "4" in out.text:
            return out, ("good", "exit 0, the complete rows plotted, the cut line reported")
        return out, ("poor", "exit 0 but the cut line went unmentioned")
    return out, classify(out, rc=2, names=("metrics.jsonl:4",))
