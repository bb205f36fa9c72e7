"""megapo/progress.py: the lines as given off a terminal; on one, a bar whose ETA is elapsed / done x left."""

from __future__ import annotations

import io

from megapo.progress import Progress


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
