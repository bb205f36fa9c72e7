"""`megapo bench length`: accuracy against response tokens for every length method, from one shared warm start.

    megapo bench length --out runs/length                        # run (or continue) every method x seed, report
    megapo bench length --out runs/length --methods baseline,kimi --seeds 1
    megapo bench length --out runs/length --report-only          # summary/table/plots from what ran

Every cell is `megapo train megapo/configs/length_base.yaml` (2- to 5-digit addition_cot: the answer alone, the
column scratchpad, or the scratchpad done twice) plus one method's overrides (METHODS: GRPO with no length term
as the baseline, then each data.length_reward / data.group_filter with the options chosen for this task) and a
seed. A cell's numbers are its last held-out eval (the test split, greedy): accuracy, mean and p90 response
tokens, and both by digit count. The step-0 eval of every cell is the warm start itself.

Layout of --out:
    bench.json          the shared settings (config hash, steps); a rerun with other ones is refused
    warm_start/         the one SFT warm start every cell starts from
    cells/<method>-s<seed>/   a `megapo train` output dir; done.json once its metrics reach the last step
    summary.json, table.md, pareto.png, tokens_by_difficulty.png   rewritten after every run

Cells run `--jobs` at a time with OMP_NUM_THREADS = cores // jobs; a rerun skips finished cells.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from megapo.config import ConfigError, config_digest, load_config
from megapo.progress import Progress

log = logging.getLogger(__name__)

DEFAULT_CONFIG = "megapo/configs/length_base.yaml"
BENCH_FILE = "bench.json"
DONE_FILE = "done.json"
BUDGET = 160  # the base config's rollout.max_new_tokens: a checked 5-digit response is 104 tokens


def _reward(name: str, options: str = "{}") -> list[str]:
    return [f"data.length_reward={name}", f"data.length_reward_options={options}"]


# Each method's overrides of the base config. Options are set for this task's lengths: one pass of the columns
# is 22 / 32 / 42 / 52 tokens at 2 / 3 / 4 / 5 digits (end-of-sequence included), the checked response twice that.
METHODS: dict[str, list[str]] = {
    "baseline": [],
    "length_penalty": _reward("length_penalty", "{coef: 0.0005}"),
    "dapo_overlong": _reward("dapo_overlong", f"{{cache_len: {BUDGET - 56}}}"),  # the penalty starts at 56
    "alp": _reward("alp", "{beta: 0.05}"),
    "laser": _reward("laser", "{target_len: 56, alpha: 0.5}"),
    "laser_d": _reward("laser_d", "{alpha: 0.5, update_every: 10, coverage: 0.9}"),
    "kimi": _reward("kimi", "{weight: 0.2}"),
    "laconic": _reward("laconic", "{target: 56, dual_lr: 0.05}"),
    "laconic_tight": _reward("laconic", "{target: 40, dual_lr: 0.05}"),
    # λ per token: 0.002 is 0.1 at a 3-digit checked response (~50 tokens); η = 0.01 moves λ by 1e-3 per 0.1 of
    # accuracy above the first step's, so over the 60 steps the penalty can reach ~0.5 at 50 tokens
    "adlp": _reward("adlp", "{lambda_init: 0.002, lr: 0.01}"),
    # the same with η ten times smaller: at η 0.01 λ outran the policy (its reference, the first step's sampled
    # accuracy, is far below what the warm start reaches) and the responses fell to two tokens
    "adlp_slow": _reward("adlp", "{lambda_init: 0.002, lr: 0.001}"),
    "grpo_lambda": [*_reward("grpo_lambda", "{inner: kimi, min_correct_ratio: 0.5}"),
                    "algorithm.stages=[{name: clamp_correct}]"],
    "hapo": _reward("hapo"),
    "curriculum": _reward("curriculum", f"{{start: {BUDGET}, end: 56, steps: 50}}"),
    "dler": [*_reward("dler", "{truncate_at: 60}"), "algorithm.advantage=reinforce_pp_baseline",
             "data.dynamic_sampling=true"],
    "dast": _reward("dast"),
    "deepcompress": _reward("deepcompress"),
    "gfpo": ["data.group_filter=gfpo", "data.group_filter_options={keep: 4}"],
    # rewards on responses split into steps (megapo/algorithms/step_length.py): a step is a column, or the sum
    "step_pruner": _reward("step_pruner", '{step_delimiter: ";", penalty: 0.05}'),  # 6 steps cost 0.3 at 5 digits
    "post_answer": _reward("post_answer", '{step_delimiter: ";"}'),
    "grsp": _reward("grsp", '{step_delimiter: ";"}'),  # every column is under 16 tokens: one cluster, weight 1
    "hmpo": _reward("hmpo"),
    "lead": _reward("lead"),
    # token stages (megapo/algorithms/token_length.py): the answer is checked at each ";" (a column, or the sum)
    "decs": ['algorithm.stages=[{name: decs, step_delimiter: ";"}]'],
    "bingo": ["algorithm.stages=[{name: bingo, decay_start: 30}]"],  # λ_dyn decays over the second half
    # DECS with its curriculum batch scheduling (a group filter: mixed groups plus a share κ of all-correct ones)
    "decs_curriculum": ['algorithm.stages=[{name: decs, step_delimiter: ";"}]', "data.group_filter=decs_curriculum",
                        'data.group_filter_options={step_delimiter: ";"}'],
    # IAPO (megapo/algorithms/information.py): each step's information about the reference answer, shared by its
    # tokens, shifts their advantage; one more learner forward of the prefix before each step followed by the answer
    "iapo": ['algorithm.stages=[{name: iapo, step_delimiter: ";"}]'],
    # SPAE (the same module): each step's potential from the answer's probability and entropy after it
    "spae": ['algorithm.stages=[{name: spae, step_delimiter: ";"}]'],
    # AnytimeReasoner (megapo/algorithms/anytime.py): each response cut at 20 / 40 / 80 / 160 tokens (a uniform prior;
    # budgets ours, dense where this task's responses end), a summary of at most 16 tokens drawn after each cut and
    # the task's ";", BRPO on the response's segments, the summaries trained with their own advantages
    "anytime": ['algorithm.stages=[{name: anytime, budgets: [20, 40, 80, 160], summary_tokens: 16}]'],
    # DUET (megapo/algorithms/duet.py): each prompt's rollouts from a pass-rate surrogate (a prompt not seen yet: its
    # digit count's pooled pass rate) under GRPO's budget, and under half of it; its abort rule needs an answer
    # marker, which this task's responses have none of
    "duet": ["data.group_filter=duet"],
    "duet_half": ["data.group_filter=duet", "data.group_filter_options={budget_scale: 0.5}"],
    # DUET with the prompt-feature surrogate (megapo/algorithms/duet_surrogate.py, ours): a prompt never drawn before
    # gets the logistic model's pass rate instead of the tracker's prior
    "duet_features": ["data.group_filter=duet", "data.group_filter_options={surrogate: features}"],
    # DAST's budget preference optimisation (megapo/algorithms/dast_preference.py): the dast length reward's shaped
    # rewards make on-policy SimPO pairs in each group (a shorter correct over a longer correct, a longer incorrect
    # over a shorter incorrect, score gap > 0.1), their gradient added to GSPO's at π_old
    "dast_simpo": [*_reward("dast"), "algorithm.stages=[{name: dast_simpo}]"],
}
# the methods whose length target follows the prompt's difficulty (the second target of issue 15)
ADAPTIVE = ("alp", "laser_d", "dast", "deepcompress", "dler")


@dataclass(frozen=True)
class Cell:
    method: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.method}-s{self.seed}"


@dataclass
class Plan:
    config: Path
    out: Path
    methods: list[str]
    seeds: int
    steps: int | None
    jobs: int
    threads: int

    def cells(self) -> list[Cell]:
        return [Cell(m, s) for m in self.methods for s in range(self.seeds)]

    def cell_dir(self, cell: Cell) -> Path:
        return self.out / "cells" / cell.name


def method_names(spec: str) -> list[str]:
    if spec in ("", "all"):
        return list(METHODS)
    names = [n for n in spec.split(",") if n]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ConfigError("--methods", f"unknown method {unknown[0]!r}; known: {', '.join(METHODS)} (or all)")
    return names if "baseline" in names else ["baseline", *names]  # every comparison is against the baseline


def load_base(plan: Plan, overrides: list[str]):
    from megapo.trainer.config import RunConfig

    return load_config(RunConfig, plan.config, overrides)


def steps_of(plan: Plan) -> int:
    return plan.steps or load_base(plan, []).train.steps


def cell_overrides(plan: Plan, cell: Cell, model_path: str) -> list[str]:
    return [*METHODS[cell.method], f"model.path={model_path}", "sft.enabled=false", f"train.seed={cell.seed}",
            f"train.output_dir={plan.cell_dir(cell)}", f"train.steps={steps_of(plan)}"]


def validate(plan: Plan) -> None:
    """Every method's config loads and validates before anything is written (a ConfigError names the method)."""
    base = load_base(plan, [])
    for method in plan.methods:
        try:
            load_base(plan, cell_overrides(plan, Cell(method, 0), base.model.path))
        except ConfigError as err:
            raise ConfigError(err.field, f"{err.message} (method {method})") from None


def check_bench_folder(plan: Plan) -> None:
    """A folder made with another config or step count is refused (its cells would not compare)."""
    want = {"config_sha256": config_digest(plan.config), "steps": steps_of(plan)}
    path = plan.out / BENCH_FILE
    if path.is_file():
        have = json.loads(path.read_text())
        if {k: have.get(k) for k in want} != want:
            raise ConfigError("--out", f"{plan.out} was made with {have}, not {want}; use another --out")
    else:
        plan.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**want, "config": str(plan.config)}, indent=1))


def make_warm_start(plan: Plan) -> Path:
    from megapo.trainer.run import prepare_model

    where = plan.out / "warm_start"
    cfg = load_base(plan, [f"model.path={where / 'base'}", f"train.output_dir={where}"])
    return prepare_model(cfg, where)


def run_cell(plan: Plan, cell: Cell, model: Path, runner) -> str:
    from tools.bench.stability import CellJob, last_step, write_json_atomic

    cell_dir = plan.cell_dir(cell)
    if (cell_dir / DONE_FILE).is_file():
        return "done before"
    cell_dir.mkdir(parents=True, exist_ok=True)
    overrides = cell_overrides(plan, cell, str(model))
    argv = [sys.executable, "-m", "megapo.cli", "train", str(plan.config), *overrides, "--overwrite"]
    env = {**os.environ, "OMP_NUM_THREADS": str(plan.threads), "MKL_NUM_THREADS": str(plan.threads)}
    t0 = time.perf_counter()
    rc = runner(CellJob(cell, cell_dir, overrides, argv, env, False))
    if rc != 0 or last_step(cell_dir) != steps_of(plan):
        log.warning("cell %s: exit code %s, unfinished (see %s)", cell.name, rc, cell_dir / "train.log")
        return "failed"
    write_json_atomic(cell_dir / DONE_FILE, {"seconds": time.perf_counter() - t0})
    log.info("cell %s: done in %.0f s", cell.name, time.perf_counter() - t0)
    return "done"


def run_cells(plan: Plan, model: Path, runner) -> list[str]:
    """Every cell, plan.jobs at a time: their statuses in cell order, a line per ended cell (a bar on a terminal)."""
    cells = plan.cells()
    bar = Progress(len(cells), "length bench", stream=sys.stderr)
    bar.update(0)
    with ThreadPoolExecutor(plan.jobs) as pool, bar.around_logs():
        futures = {pool.submit(run_cell, plan, c, model, runner): c for c in cells}
        for ended, future in enumerate(as_completed(futures), 1):
            bar.line(f"length bench: {ended}/{len(cells)} cells ended ({futures[future].name}: {future.result()})",
                     done=ended)
    bar.close()
    return [future.result() for future in futures]


def run_bench(plan: Plan, runner=None) -> dict:
    from tools.bench.stability import SubprocessRunner

    validate(plan)
    check_bench_folder(plan)
    t0 = time.perf_counter()
    model = make_warm_start(plan)
    warm_s = time.perf_counter() - t0
    runner = runner or SubprocessRunner()
    statuses = run_cells(plan, model, runner)
    return write_report(plan, run={"warm_start_s": warm_s, "total_s": time.perf_counter() - t0, "jobs": plan.jobs,
                                   "threads": plan.threads,
                                   "statuses": dict(zip([c.name for c in plan.cells()], statuses))})


# ----------------------------------------------------------------------------- report


def cell_result(plan: Plan, cell: Cell) -> dict | None:
    """The cell's warm-start (step 0) and last held-out evals; None when it has not finished."""
    from megapo.trainer.metrics import read_metrics

    cell_dir = plan.cell_dir(cell)
    if not (cell_dir / DONE_FILE).is_file():
        return None
    evals = [r for r in read_metrics(cell_dir) if "eval/accuracy" in r]
    first, last = evals[0], evals[-1]
    pick = lambda row: {k.removeprefix("eval/"): v for k, v in row.items() if k.startswith("eval/")}
    return {"cell": cell.name, "method": cell.method, "seed": cell.seed, "step": last["step"],
            "start": pick(first), "final": pick(last),
            "seconds": json.loads((cell_dir / DONE_FILE).read_text()).get("seconds")}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def method_summary(rows: list[dict]) -> dict:
    """Means over a method's seeds of accuracy, mean / p90 tokens, and tokens and accuracy by digit count."""
    keys = sorted({k for r in rows for k in r["final"]})
    out = {k: _mean([r["final"][k] for r in rows if k in r["final"]]) for k in keys}
    out["seeds"] = len(rows)
    out["per_seed_accuracy"] = [r["final"]["accuracy"] for r in rows]
    out["per_seed_tokens"] = [r["final"]["len/mean"] for r in rows]
    return out


def digit_counts(summary: dict) -> list[int]:
    return sorted({int(k[len("len/d"):]) for k in summary if k.startswith("len/d") and k[5:].isdigit()})


def write_report(plan: Plan, run: dict | None = None) -> dict:
    """summary.json (with `run`, the timing and statuses of the run that just ended, when given), table.md and
    the plots, from the finished cells."""
    results = [r for r in (cell_result(plan, c) for c in plan.cells()) if r is not None]
    methods = {m: method_summary([r for r in results if r["method"] == m]) for m in plan.methods
               if any(r["method"] == m for r in results)}
    base = methods.get("baseline")
    for m, s in methods.items():
        if base is not None:
            s["token_cut"] = 1.0 - s["len/mean"] / base["len/mean"]
            s["accuracy_delta"] = s["accuracy"] - base["accuracy"]
        digits = digit_counts(s)
        if digits:
            s["hardest_over_easiest_tokens"] = s[f"len/d{digits[-1]}"] / s[f"len/d{digits[0]}"]
    warm = results[0]["start"] if results else None
    summary = {"config": _shown(plan.config), "steps": steps_of(plan), "warm_start": warm, "methods": methods,
               "cells": results, "targets": targets(methods), **({"run": run} if run is not None else {})}
    plan.out.mkdir(parents=True, exist_ok=True)
    (plan.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (plan.out / "table.md").write_text(table_markdown(summary))
    if methods:
        write_plots(plan, summary)
    return summary


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it lies under it (summaries compare across clones)."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def targets(methods: dict) -> dict:
    """Issue 15's two targets: a method with >= 40 % fewer mean tokens than the baseline at accuracy within 2
    points of it; adaptive methods spending more tokens on the hardest digit count than on the easiest."""
    cut = [m for m, s in methods.items() if m != "baseline" and s.get("token_cut", 0) >= 0.4
           and s.get("accuracy_delta", -1) >= -0.02]
    adaptive = {m: methods[m].get("hardest_over_easiest_tokens") for m in ("baseline", *ADAPTIVE) if m in methods}
    return {"cut_40pct_within_2pts": cut, "adaptive_hardest_over_easiest": adaptive}


def _fmt(x, kind: str = "f") -> str:
    if x is None:
        return "-"
    if kind == "pts":
        return f"{100 * x:+.1f} pts"
    return f"{x:+.1%}" if kind == "pct" else f"{x:.3f}" if kind == "acc" else f"{x:.1f}"


def table_markdown(summary: dict) -> str:
    methods = summary["methods"]
    digits = digit_counts(next(iter(methods.values()), {}))
    kinds = sorted({k for s in methods.values() for k in s if k.startswith("kind/")})
    head = ["method", "seeds", "accuracy", "Δ acc vs baseline", "mean tokens", "token cut", "p90 tokens",
            *[f"tokens d{d}" for d in digits], *[f"acc d{d}" for d in digits],
            *[f"{k.removeprefix('kind/')} share" for k in kinds], "per-seed accuracy"]
    lines = [f"# Length bench ({summary['steps']} RL steps per cell, {summary['config']})", "",
             "Held-out test split, greedy; means over seeds. Token cut: 1 − mean tokens / the baseline's. Shares: "
             "the task's response kinds (addition_cot: terse = the answer alone, scratchpad = one pass of the "
             "columns, checked = the columns twice).", ""]
    if summary.get("warm_start"):
        w = summary["warm_start"]
        lines += [f"Warm start: accuracy {_fmt(w.get('accuracy'), 'acc')}, mean tokens {_fmt(w.get('len/mean'))}.", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, s in methods.items():
        cols = [m, str(s["seeds"]), _fmt(s.get("accuracy"), "acc"), _fmt(s.get("accuracy_delta"), "pts"),
                _fmt(s.get("len/mean")), _fmt(s.get("token_cut"), "pct"), _fmt(s.get("len/p90")),
                *[_fmt(s.get(f"len/d{d}")) for d in digits], *[_fmt(s.get(f"acc_d{d}"), "acc") for d in digits],
                *[_fmt(s.get(k), "acc") for k in kinds], " ".join(f"{a:.3f}" for a in s["per_seed_accuracy"])]
        lines.append("| " + " | ".join(cols) + " |")
    t = summary["targets"]
    lines += ["", f"≥ 40 % fewer tokens at accuracy within 2 points of the baseline: "
                  f"{', '.join(t['cut_40pct_within_2pts']) or 'none'}.",
              "Hardest / easiest digit count, mean tokens (the baseline, then the adaptive methods): " +
              (", ".join(f"{m} {_fmt(v)}×" if v is not None else f"{m} -" for m, v in
                         t["adaptive_hardest_over_easiest"].items()) or "-") + "."]
    return "\n".join(lines) + "\n"


def write_plots(plan: Plan, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = summary["methods"]
    fig, ax = plt.subplots(figsize=(7, 5))
    for m, s in methods.items():
        base = m == "baseline"
        ax.scatter(s["per_seed_tokens"], s["per_seed_accuracy"], s=12, alpha=0.4, color="k" if base else None)
        ax.scatter([s["len/mean"]], [s["accuracy"]], s=80 if base else 40, marker="*" if base else "o",
                   color="k" if base else None, label=m)
        ax.annotate(m, (s["len/mean"], s["accuracy"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("mean response tokens (held-out)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("accuracy vs tokens (mean over seeds; small dots: seeds; star: baseline)")
    fig.tight_layout()
    fig.savefig(plan.out / "pareto.png", dpi=120)
    plt.close(fig)
    digits = digit_counts(next(iter(methods.values())))
    fig, ax = plt.subplots(figsize=(max(7, len(methods) * 0.6), 4))
    width = 0.8 / max(len(digits), 1)
    for j, d in enumerate(digits):
        ax.bar([i + j * width for i in range(len(methods))], [s.get(f"len/d{d}", 0) for s in methods.values()],
               width, label=f"{d} digits")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(methods))], list(methods), rotation=45, ha="right")
    ax.set_ylabel("mean response tokens (held-out)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(plan.out / "tokens_by_difficulty.png", dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="base run config every cell overrides")
    parser.add_argument("--out", default="runs/length", help="bench folder (warm start, cells, report)")
    parser.add_argument("--methods", default="all", help=f"comma-separated of {', '.join(METHODS)}, or all")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per method (train.seed 0..N-1)")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per cell (default: the config's)")
    parser.add_argument("--jobs", type=int, default=None, help="cells at a time (default: cores // 1, at most 2)")
    parser.add_argument("--threads", type=int, default=None, help="OpenMP threads per cell (default: cores // jobs)")
    parser.add_argument("--report-only", action="store_true", help="rewrite summary/table/plots; run nothing")


def plan_from_args(args: argparse.Namespace) -> Plan:
    from tools.bench.stability import check_run_args, cores

    config = check_run_args(args)
    jobs = args.jobs or min(2, cores())
    return Plan(config.resolve(), Path(args.out).resolve(), method_names(args.methods), args.seeds, args.steps,
                jobs, args.threads or max(1, cores() // jobs))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    plan = plan_from_args(args)
    summary = write_report(plan) if args.report_only else run_bench(plan)
    done = len(summary["cells"])
    print(f"{done}/{len(plan.cells())} cells; wrote {plan.out / 'summary.json'}, {plan.out / 'table.md'}")
    print((plan.out / "table.md").read_text())
    return 0 if done == len(plan.cells()) else 1
