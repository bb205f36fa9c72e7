"""megapo/progress.py: the lines as given off a terminal; on one, a bar whose ETA is elapsed / done x left; and
the lines `megapo convert`, `megapo bench stability` and `megapo bench scaling` print off a terminal."""

from __future__ import annotations

import io
import re
from pathlib import Path

from megapo.progress import Progress

REPO = Path(__file__).resolve().parents[1]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_not_a_terminal_prints_only_the_lines():
    out = io.StringIO()
    bar = Progress(10, "train", stream=out)
    for step in range(1, 4):
        bar.line(f"step {step}/10 | reward 0.5", done=step)
    bar.close()
    assert out.getvalue() == "".join(f"step {s}/10 | reward 0.5\n" for s in range(1, 4))


def test_terminal_bar_with_eta_redrawn_below_the_lines():
    out, clock = Terminal(), Clock()
    bar = Progress(10, "train", stream=out, clock=clock)
    bar.line("step 1/10", done=1)  # the clock starts at the first finished unit
    clock.now += 30.0
    bar.line("step 4/10", done=4)  # 3 units in 30 s: 10 s each, 6 left -> ETA 1:00
    text = out.getvalue()
    assert text.startswith("step 1/10\n\r\033[Ktrain [##......................] 1/10 10% 0:00 elapsed")
    last = text.rsplit("\r\033[K", 1)[1]
    assert last == "train [#########...............] 4/10 40% 0:30 elapsed, ETA 1:00"
    assert "\r\033[Kstep 4/10\n" in text  # the bar erased before the next line
    bar.close()
    assert out.getvalue().endswith("\n")


def test_finished_bar_has_no_eta_and_hours_are_shown():
    clock = Clock()
    bar = Progress(4, "sft", stream=Terminal(), clock=clock)
    bar.update(0)
    clock.now += 2 * 3600 + 61
    assert bar.bar(4) == "sft [########################] 4/4 100% 2:01:01 elapsed"


def test_logs_written_while_a_bar_is_shown_erase_it_first():
    import logging

    out = Terminal()
    logger = logging.getLogger("test_progress.bar")
    logger.propagate = False
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    bar = Progress(4, "grid", stream=out, clock=Clock())
    with bar.around_logs(logger):
        bar.update(1)
        logger.warning("a log line")
    logger.warning("after: no filter left")
    logger.removeHandler(handler)
    assert out.getvalue().endswith("1/4 25% 0:00 elapsed\r\033[Ka log line\nafter: no filter left\n")


# ----------------------------------------------------------------------------- the commands' lines off a terminal


def test_convert_prints_a_line_per_unit(monkeypatch, capsys):
    """run_plans with the workers' launch replaced: the launch line, the workers' line, one per finished plan."""
    from megapo.commands import convert
    from megapo.config import ParallelConfig

    monkeypatch.setattr(convert, "_launch", lambda plans, timeout_s: 0)
    plans = [convert.Plan(command=name, job=None, parallel=ParallelConfig(), finish=lambda: True, job_path=None)
             for name in ("hf-to-megatron", "verify")]
    assert convert.run_plans(plans, timeout_s=5) == [0, 0]
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "convert: hf-to-megatron, verify in 1 process(es)"
    assert re.fullmatch(r"convert: the workers finished in \d+ s \(1/3\)", lines[1]), lines[1]
    assert lines[2:] == ["convert hf-to-megatron: done (2/3)", "convert verify: done (3/3)"]


def test_stability_grid_prints_a_line_per_ended_cell(tmp_path, capsys):
    """Two cells whose runner writes nothing: each ends unfinished, one line each, counted."""
    from tools.bench import stability as st

    plan = st.GridPlan(config=REPO / "megapo/configs/stability_base.yaml", out=tmp_path / "grid", grid="small",
                       seeds=1, steps=2)
    cells = plan.cells()[:2]
    status: dict[str, str] = {}
    st.run_cells(plan, cells, tmp_path / "model", 2, lambda job: 1, status)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("stability grid:")]
    assert lines == [f"stability grid: {i}/2 cells ended ({c.name}: unfinished)" for i, c in enumerate(cells, 1)]


def test_scaling_prints_a_line_per_launch_with_the_runs_done(tmp_path, monkeypatch, capsys):
    """Specs of two world sizes (3 runs), the launches replaced: one line per launch, runs counted."""
    from megapo.launch import local
    from tools.bench import scaling

    monkeypatch.setattr(local, "run_torchrun", lambda args, nproc, timeout_s, env: 0)
    plan = scaling.plan_from_args(_scaling_args(["--layouts", "tp1,tp2,pp2", "--sizes", "small"]))
    specs = scaling.write_specs(tmp_path, plan, {"small": str(tmp_path / "model")})
    scaling.run_local(specs, tmp_path, timeout_s=5)
    lines = capsys.readouterr().out.splitlines()
    assert [re.sub(r"in \d+ s", "in N s", line) for line in lines] == [
        "scaling: 1-process launch done in N s (1/3 runs)", "scaling: 2-process launch done in N s (3/3 runs)"]


def _scaling_args(argv):
    import argparse

    from tools.bench import scaling

    parser = argparse.ArgumentParser()
    scaling.add_arguments(parser)
    return parser.parse_args(argv)


def test_length_bench_prints_a_line_per_ended_cell(monkeypatch, capsys):
    from types import SimpleNamespace

    from tools.bench import length

    cells = [SimpleNamespace(name=f"m{i}-s0") for i in range(3)]
    plan = SimpleNamespace(jobs=2, cells=lambda: cells)
    monkeypatch.setattr(length, "run_cell", lambda plan, cell, model, runner: "done" if cell.name != "m1-s0" else "failed")
    statuses = length.run_cells(plan, "model", runner=None)
    assert statuses == ["done", "failed", "done"]  # in cell order, whatever order they ended in
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("length bench:")]
    assert [line.split(" cells")[0] for line in lines] == ["length bench: 1/3", "length bench: 2/3", "length bench: 3/3"]
    assert {line.split("(")[1].split(":")[0] for line in lines} == {"m0-s0", "m1-s0", "m2-s0"}
