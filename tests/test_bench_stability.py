"""The stability study: the collapse rule on synthetic metrics files, and `megapo bench stability`'s grid
(resume after a kill, done markers, summary/table verdicts, the small grid's questions) with a fake cell
runner that writes metrics instead of training; one real 2-step cell of the tiny model."""

import json
import math
from pathlib import Path

import pytest

from megapo.config import ConfigError
from megapo.trainer.collapse import Collapse, accuracy_dip, detect_collapse, run_collapse
from tools.bench import stability as st

CONFIG = Path(__file__).resolve().parents[1] / "megapo" / "configs" / "stability_base.yaml"


def write_metrics(run_dir: Path, rows: list[dict], cut_tail: str = "") -> Path:
    """metrics.jsonl as MetricsLogger writes it (json.dumps per line; NaN as NaN), plus an optional cut-off
    last line without its newline."""
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"time": 0.0, **r}) + "\n" for r in rows) + cut_tail
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir


def healthy_rows(steps: int = 40, start_acc: float = 0.30) -> list[dict]:
    """A noisy run that does not collapse: accuracy dips by 0.08 at worst, the reward dips below 0.05 on 9
    consecutive steps at most, the loss stays finite."""
    rows = [{"step": 0, "eval/accuracy": start_acc}]
    for s in range(1, steps + 1):
        reward = 0.01 if 11 <= s <= 19 else 0.12 + 0.05 * math.sin(s)  # 9 low steps, then back
        row = {"step": s, "reward": reward, "train/loss": 0.3 * math.cos(s), "train/skipped_nonfinite": 0}
        if s % 10 == 0:
            row["eval/accuracy"] = start_acc + (-0.08, 0.05, -0.02, 0.1)[s // 10 - 1]
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- the collapse rule


def test_noisy_but_fine_run_does_not_collapse(tmp_path):
    assert run_collapse(write_metrics(tmp_path, healthy_rows())) == Collapse(False, None, "")


def test_accuracy_drop_alone(tmp_path):
    rows = healthy_rows()
    rows[20]["eval/accuracy"] = 0.19  # step 20: below 0.30 - 0.1, and so to the end
    rows[30]["eval/accuracy"] = 0.10
    rows[40]["eval/accuracy"] = 0.15
    assert run_collapse(write_metrics(tmp_path, rows)) == Collapse(True, 20, "accuracy")
    assert accuracy_dip(rows) == 20
    rows[20]["eval/accuracy"], rows[30]["eval/accuracy"], rows[40]["eval/accuracy"] = 0.21, 0.205, 0.201
    assert not detect_collapse(rows).collapsed  # 0.09 / 0.095 / 0.099 below: not yet
    assert accuracy_dip(rows) is None


def test_a_dip_the_run_recovers_from_is_not_a_collapse():
    rows = healthy_rows()
    rows[10]["eval/accuracy"] = 0.15  # down at 10, back above 0.20 at 20, down again from 30 to the end
    assert not detect_collapse(rows).collapsed and accuracy_dip(rows) == 10
    rows[30]["eval/accuracy"], rows[40]["eval/accuracy"] = 0.12, 0.05
    assert detect_collapse(rows) == Collapse(True, 30, "accuracy")  # dated to the final stretch's first eval
    assert accuracy_dip(rows) == 10


def test_reward_floor_for_ten_steps_alone(tmp_path):
    rows = healthy_rows()
    for s in range(25, 35):  # ten consecutive steps below 0.05, from step 25
        rows[s]["reward"] = 0.049
    assert run_collapse(write_metrics(tmp_path, rows)) == Collapse(True, 25, "reward")
    rows[30]["reward"] = 0.05  # not below: the stretch is broken into 5 + 4
    assert not detect_collapse(rows).collapsed


def test_non_finite_loss_alone(tmp_path):
    for bad in (float("nan"), float("inf")):
        rows = healthy_rows()
        rows[7]["train/loss"] = bad
        assert run_collapse(write_metrics(tmp_path, rows)) == Collapse(True, 7, "loss")
    rows = healthy_rows()
    rows[12]["train/skipped_nonfinite"] = 1  # the learner dropped a non-finite update
    assert detect_collapse(rows) == Collapse(True, 12, "loss")


def test_earliest_rule_wins_and_a_resumed_run_counts_a_step_once(tmp_path):
    rows = healthy_rows()
    rows[30]["train/loss"] = float("nan")
    for s in (20, 30, 40):
        rows[s]["eval/accuracy"] = 0.1
    assert detect_collapse(rows) == Collapse(True, 20, "accuracy")
    # a resume logged steps 15..20 again: the later rows replace the earlier ones
    again = [dict(r) for r in healthy_rows()[15:21]]
    assert detect_collapse(rows + again) == Collapse(True, 30, "loss")


def test_cut_off_last_line_is_tolerated(tmp_path):
    rows = healthy_rows()
    write_metrics(tmp_path, rows, cut_tail='{"step": 41, "reward": 0.0, "train/loss": Na')
    assert run_collapse(tmp_path) == Collapse(False, None, "")
    rows[7]["train/loss"] = float("nan")
    write_metrics(tmp_path, rows, cut_tail='{"step": 41, "rew')
    assert run_collapse(tmp_path) == Collapse(True, 7, "loss")


# ----------------------------------------------------------------------------- the grid

STEPS = 20


def collapses(cell: st.Cell) -> bool:
    """The fake runs' scenario: no replay at the highest off-policy degree collapses (its reward falls)."""
    return cell.replay == "off" and cell.mini_batches == 8 and cell.mismatch == "none"


def mismatch_kl(cell: st.Cell, step: int) -> float:
    return (1e-3 if cell.replay == "off" else 1e-6) * step


def fake_rows(cell: st.Cell, upto: int) -> list[dict]:
    rows = [{"step": 0, "eval/accuracy": 0.3}]
    for s in range(1, upto + 1):
        reward = 0.01 if collapses(cell) and s >= 6 else 0.2
        row = {"step": s, "reward": reward, "train/loss": 0.1, "train/mismatch_k3": mismatch_kl(cell, s),
               "tokens_per_s": 1000.0 + s}
        if s % 10 == 0:
            row["eval/accuracy"] = 0.1 if collapses(cell) else 0.4
        rows.append(row)
    return rows


class FakeRunner:
    """Writes a cell's synthetic metrics instead of training. `stop_at`: on that call (1-based), write half
    the metrics and raise KeyboardInterrupt, as a killed grid would leave the cell."""

    def __init__(self, stop_at: int | None = None, upto: int = STEPS):
        self.calls: list[st.CellJob] = []
        self.stop_at = stop_at
        self.upto = upto

    def __call__(self, job: st.CellJob) -> int:
        self.calls.append(job)
        if len(self.calls) == self.stop_at:
            write_metrics(job.dir, fake_rows(job.cell, STEPS // 2))
            raise KeyboardInterrupt
        write_metrics(job.dir, fake_rows(job.cell, self.upto))
        return 0


def fake_warm_start(plan: st.GridPlan) -> Path:
    return plan.out / "warm_start" / "sft"


def make_plan(tmp_path, **kw) -> st.GridPlan:
    return st.GridPlan(config=CONFIG, out=tmp_path / "grid", grid="small", seeds=1, steps=STEPS, **kw)


def test_killed_grid_resumes_without_rerunning_finished_cells(tmp_path):
    plan = make_plan(tmp_path)
    cells = plan.cells()
    killer = FakeRunner(stop_at=4)
    with pytest.raises(KeyboardInterrupt):
        st.run_grid(plan, runner=killer, warm_start=fake_warm_start)
    assert [j.cell for j in killer.calls] == cells[:4]
    assert [st.is_done(plan.cell_dir(c)) for c in cells[:5]] == [True, True, True, False, False]

    again = FakeRunner()
    status = st.run_grid(plan, runner=again, warm_start=fake_warm_start)
    assert [j.cell for j in again.calls] == cells[3:]  # the interrupted cell and the rest, once each
    assert all("--overwrite" in j.argv and "--resume" not in j.argv for j in again.calls)
    assert status == {**{c.name: "skipped" for c in cells[:3]}, **{c.name: "done" for c in cells[3:]}}

    third = FakeRunner()
    st.run_grid(plan, runner=third, warm_start=fake_warm_start)
    assert third.calls == []

    summary = json.loads((plan.out / "summary.json").read_text())
    by_name = {r["cell"]: r for r in summary["cells"]}
    assert sorted(by_name) == sorted(c.name for c in cells)
    for c in cells:
        row = by_name[c.name]
        assert row["status"] == "done"
        assert (row["collapsed"], row["collapse_step"]) == ((True, 6) if collapses(c) else (False, None))
        assert row["final_accuracy"] == (0.1 if collapses(c) else 0.4)
        assert row["mismatch_kl_mean"] == pytest.approx(sum(mismatch_kl(c, s) for s in range(1, STEPS + 1)) / STEPS)
        assert row["mismatch_kl_max"] == pytest.approx(mismatch_kl(c, STEPS))
        assert row["read"]["mismatch_kl"] == "train/mismatch_k3"
    table = (plan.out / "table.md").read_text()
    for c in cells:  # every setting's row, with its collapse count over its one seed
        line = next(ln for ln in table.splitlines()
                    if ln.startswith(f"| {c.objective} | {c.replay} | {c.mismatch} |")
                    and ln in table.split(f"train.mini_batches={c.mini_batches})")[1].split("##")[0])
        assert f"| {int(collapses(c))} / 1 |" in line
    assert sorted(p.name for p in (plan.out / "plots").glob("*.png")) == sorted(
        {f"{c.objective}-{c.mismatch}.png" for c in cells})


def test_unfinished_cell_resumes_from_its_checkpoint_with_resume(tmp_path):
    from megapo.trainer import checkpoint as ckpt

    plan = make_plan(tmp_path, resume=True)
    cells = plan.cells()
    with pytest.raises(KeyboardInterrupt):
        st.run_grid(plan, runner=FakeRunner(stop_at=1), warm_start=fake_warm_start)
    saved = ckpt.step_dir(plan.cell_dir(cells[0]) / "checkpoints", STEPS // 2)
    saved.mkdir(parents=True)
    (saved / ckpt.MANIFEST).write_text("{}")
    again = FakeRunner()
    st.run_grid(plan, runner=again, warm_start=fake_warm_start)
    assert again.calls[0].cell == cells[0] and again.calls[0].resume and again.calls[0].argv[-1] == "--resume"
    assert all(j.argv[-1] == "--overwrite" for j in again.calls[1:])


def test_cell_that_stops_short_is_not_marked_done(tmp_path):
    plan = make_plan(tmp_path, only=["ppo-r3-m1-none-s0"])
    status = st.run_grid(plan, runner=FakeRunner(upto=STEPS - 1), warm_start=fake_warm_start)
    assert status == {"ppo-r3-m1-none-s0": "unfinished"}
    assert not st.is_done(plan.cell_dir(plan.cells()[0]))
    summary = json.loads((plan.out / "summary.json").read_text())
    assert summary["cells"][0]["status"] == "unfinished"
    assert summary["settings"][0]["done"] == 0 and summary["settings"][0]["collapse_rate"] is None


def test_grid_folder_of_other_settings_is_refused(tmp_path):
    plan = make_plan(tmp_path, only=["ppo-r3-m1-none-s0"])
    st.run_grid(plan, runner=FakeRunner(), warm_start=fake_warm_start)
    other = make_plan(tmp_path, only=["ppo-r3-m1-none-s0"])
    other.steps = STEPS + 5
    runner = FakeRunner()
    with pytest.raises(ConfigError, match="--out.*--steps"):
        st.run_grid(other, runner=runner, warm_start=fake_warm_start)
    assert runner.calls == []


def test_bad_override_is_refused_before_any_cell_runs(tmp_path):
    plan = make_plan(tmp_path, sets=["data.prompts_per_step=12"])  # 8 does not divide 12: the m=8 cells are invalid
    runner = FakeRunner()
    with pytest.raises(ConfigError, match=r"train.mini_batches.*\(cell ppo-off-m8-none-s0\)"):
        st.run_grid(plan, runner=runner, warm_start=fake_warm_start)
    assert runner.calls == [] and not (plan.out / "cells").exists()


def test_small_grid_answers_the_three_questions():
    from megapo.algorithms.registry import get

    cells = st.grid_cells("small", seeds=3)
    assert {c.seed for c in cells} == {0, 1, 2}
    settings = {(c.objective, c.replay, c.mini_batches, c.mismatch) for c in cells}
    low, high = min(st.AXES["mini_batches"]), max(st.AXES["mini_batches"])
    # 1. replay off / r2 / r3 with everything else equal, at the highest off-policy degree (and the lowest)
    for m in (low, high):
        assert any({(o, r, m, x) for r in ("off", "r2", "r3")} <= settings for o, _, _, x in settings)
    # 2. a token-level and a sequence-level objective with everything else equal, off-policy
    for o, r, m, x in settings:
        if m == high and get("objective", o).granularity == "token":
            if any(get("objective", o2).granularity == "sequence" and (o2, r, m, x) in settings
                   for o2 in st.AXES["objective"]):
                break
    else:
        pytest.fail("no token-level vs sequence-level pair at the highest off-policy degree")
    # 3. the correction on and off with everything else equal, on- and off-policy
    for m in (low, high):
        assert any({(o, r, m, "none"), (o, r, m, "tis")} <= settings for o, r, _, _ in settings)
    assert len(settings) == len(cells) // 3 and len(st.grid_cells("full", 1)) == 4 * 3 * 3 * 2


def test_real_two_step_cell(tmp_path, tiny_moe):
    """One real cell: `megapo train` as a child process on the tiny model (no SFT), marked done."""
    plan = make_plan(tmp_path, only=["ppo-r3-m1-none-s0"], threads=2,
                     sets=["train.eval_prompts=20", "data.prompts_per_step=8", "data.dynamic_sampling=false",
                           "train.eval_every=2", "train.ckpt_every=0", "train.log=[jsonl]"])
    plan.steps = 2
    status = st.run_grid(plan, warm_start=lambda p: Path(tiny_moe))
    cell_dir = plan.cell_dir(plan.cells()[0])
    assert status == {"ppo-r3-m1-none-s0": "done"}, (cell_dir / "train.log").read_text()[-3000:]
    rows = [json.loads(line) for line in (cell_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    saved = json.loads((cell_dir / "config.json").read_text())
    assert (saved["algorithm"]["objective"], saved["algorithm"]["routing_replay"], saved["train"]["mini_batches"],
            saved["rollout"]["dtype"], saved["sft"]["enabled"]) == ("ppo", "r3", 1, "bfloat16", False)
    row = json.loads((plan.out / "summary.json").read_text())["cells"][0]
    assert row["status"] == "done" and row["read"]["mismatch_kl"] is not None


def test_dry_run_lists_the_cells_and_estimates(tmp_path, capsys):
    from megapo.cli import main

    out = tmp_path / "grid"
    assert main(["bench", "stability", "--dry-run", "--out", str(out), "--seeds", "2", "--steps", "100",
                 "--jobs", "1", "--assume-step-s", "0.5", "--assume-startup-s", "30",
                 "--assume-warm-start-s", "120"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[:-1] == [c.name for c in st.grid_cells("small", 2)]
    minutes = (120 + 20 * (30 + 100 * 0.5)) / 60  # warm start, then 20 cells one after another
    assert printed[-1].startswith(f"20 cells x 100 steps, 1 at a time") and f"about {minutes:.0f} min" in printed[-1]
    assert not out.exists()  # nothing written
    assert main(["bench", "stability", "--dry-run", "--out", str(out), "--cells", "ppo-off-m2-none-s0"]) == 2
    assert "--cells: 'ppo-off-m2-none-s0' is not a cell of the small grid" in capsys.readouterr().err


def test_objectives_add_one_setting_each_in_the_collapse_regime(tmp_path):
    from megapo.algorithms import entries

    plan = make_plan(tmp_path, objectives=st.objective_names("dppo,gspo"))
    extra = [c for c in plan.cells() if c.objective == "dppo"]
    assert [(c.replay, c.mini_batches, c.mismatch, c.seed) for c in extra] == [("off", 8, "none", 0)]
    # gspo-off-m8-none is a small-grid cell already: not added twice
    assert len(plan.cells()) == len(make_plan(tmp_path).cells()) + 1
    assert st.objective_names("all") == [e.name for e in entries("objective")]
    with pytest.raises(ConfigError) as err:
        st.objective_names("ppo,nope")
    assert err.value.field == "--objectives" and "'nope'" in str(err.value)
    st.run_grid(plan, runner=FakeRunner(), warm_start=fake_warm_start)
    table = (plan.out / "table.md").read_text()
    m8 = table.split("train.mini_batches=8)")[1].split("## Cells")[0]
    assert "| dppo | off | none | 1 / 1 |" in m8  # its row (the fake scenario collapses every off-m8-none cell)
    assert m8.index("| minirl |") < m8.index("| dppo |")


def test_sspo_cells_carry_the_tokenizers_sentence_ends(tmp_path, tiny_moe):
    """sspo without sentence_end_ids is refused by a run's config (one sentence per response: GSPO with sspo's
    clip); its cells split at the run's tokenizer's '.', '?', '!', newline and EOS, resolved when the cells are
    built: from the tiny model the grid will write (not there yet), or from the model folder the config names."""
    from transformers import AutoTokenizer

    plan = make_plan(tmp_path, objectives=st.objective_names("sspo,gspo"))
    (cell,) = [c for c in plan.cells() if c.objective == "sspo"]
    tok = AutoTokenizer.from_pretrained(tiny_moe)  # the same tiny tokenizer the grid's base model gets (vocab 512)
    ids = st.sentence_end_ids(tok)
    assert ids and tok.eos_token_id in ids and tok.encode(".", add_special_tokens=False)[0] in ids
    assert cell.objective_options == f"{{sentence_end_ids: {ids}}}"
    assert f"algorithm.objective_options={{sentence_end_ids: {ids}}}" in cell.overrides()
    assert all(not c.objective_options for c in plan.cells() if c.objective != "sspo")
    st.validate_cells(plan, plan.cells(), STEPS)  # the config accepts the sspo cell
    assert plan.cells()[-1] == cell  # the same cell each time the plan lists them

    on_folder = make_plan(tmp_path, objectives=["sspo"], sets=[f"model.path={tiny_moe}"])
    (cell,) = [c for c in on_folder.cells() if c.objective == "sspo"]
    assert cell.objective_options == f"{{sentence_end_ids: {ids}}}"
    cfg = st.load_base(on_folder, st.cell_overrides(on_folder, cell, str(tiny_moe), STEPS))
    assert cfg.algorithm.objective_options["sentence_end_ids"] == ids

    bare = st.Cell("sspo", "off", 8, "none", 0)  # without the ids the run's config refuses the cell
    with pytest.raises(ConfigError) as err:
        st.load_base(plan, st.cell_overrides(plan, bare, str(tiny_moe), STEPS))
    assert err.value.field == "algorithm.objective_options.sentence_end_ids"


def test_haepo_cells_carry_their_overrides(tmp_path, monkeypatch):
    """haepo is refused by a run's config without stage plackett_luce and an entropy bonus: its cells get
    OBJECTIVE_OVERRIDES after their axes, in their argv, cell.json and row's options; other cells do not."""
    plan = make_plan(tmp_path, objectives=st.objective_names("haepo,dppo"), only=["haepo-off-m8-none-s0",
                                                                                 "dppo-off-m8-none-s0"])
    (cell,) = [c for c in plan.cells() if c.objective == "haepo"]
    extra = list(st.OBJECTIVE_OVERRIDES["haepo"])
    assert extra == ["algorithm.stages=[{name: plackett_luce}]", "algorithm.entropy_coef=0.01"]
    assert cell.name == "haepo-off-m8-none-s0" and cell.overrides()[-2:] == extra
    assert not any(o in c.overrides() for c in plan.cells() if c.objective != "haepo" for o in extra)
    runner = FakeRunner()
    st.run_grid(plan, runner=runner, warm_start=fake_warm_start)  # validate_cells: the config accepts the cell
    job = next(j for j in runner.calls if j.cell.objective == "haepo")
    axes = job.argv.index("train.seed=0")
    assert job.argv[axes + 1: axes + 3] == extra
    assert json.loads((plan.cell_dir(cell) / st.CELL_FILE).read_text())["overrides"][-6:-4] == extra
    summary = json.loads((plan.out / "summary.json").read_text())
    row = next(s for s in summary["settings"] if s["setting"] == "haepo-off-m8-none")
    assert row["options"][-2:] == extra and row["label"] == "haepo"
    table = (plan.out / "table.md").read_text()
    assert f"| haepo | `{' '.join(extra)}` |" in table.split("OBJECTIVE_OVERRIDES")[1]

    monkeypatch.setitem(st.OBJECTIVE_OVERRIDES, "haepo", ())  # without them the run's config refuses the cell
    with pytest.raises(ConfigError) as err:
        st.validate_cells(plan, plan.cells(), STEPS)
    assert err.value.field == "algorithm.stages" and "(cell haepo-off-m8-none-s0)" in str(err.value)


@pytest.mark.parametrize("table, field, words", [
    ({"haepo": ("algorithm.stages=[{name: plackett_luce}]", "train.mini_batches=4")},
     "OBJECTIVE_OVERRIDES['haepo'][1]", "cell axis"),
    ({"haepo": ("algorithm.routing_replay=r3",)}, "OBJECTIVE_OVERRIDES['haepo'][0]", "cell axis"),
    ({"haepo": ("entropy_coef",)}, "OBJECTIVE_OVERRIDES['haepo'][0]", "section.field=value"),
    ({"ppo": ("algorithm.entropy_coef=0.01",)}, "OBJECTIVE_OVERRIDES['ppo']", "variants' baseline"),
])
def test_objective_overrides_that_set_a_cell_axis_are_refused(tmp_path, monkeypatch, table, field, words):
    with pytest.raises(ConfigError) as err:
        st.check_objective_overrides(table)
    assert err.value.field == field and words in str(err.value)
    monkeypatch.setattr(st, "OBJECTIVE_OVERRIDES", table)  # and the grid stops before any cell runs
    runner = FakeRunner()
    with pytest.raises(ConfigError) as err:
        st.run_grid(make_plan(tmp_path, objectives=["haepo"]), runner=runner, warm_start=fake_warm_start)
    assert err.value.field == field and runner.calls == []


# ----------------------------------------------------------------------------- --variants


def test_variants_add_one_setting_each_with_their_overrides(tmp_path):
    plan = make_plan(tmp_path, objectives=["dppo"], variants=st.variant_names("stapo,kl_future"))
    added = [c for c in plan.cells() if c.variant]
    assert [(c.name, c.objective, c.replay, c.mini_batches, c.mismatch) for c in added] == [
        ("stapo-off-m8-none-s0", "ppo", "off", 8, "none"), ("kl_future-off-m8-none-s0", "ppo", "off", 8, "none")]
    assert len(plan.cells()) == len(make_plan(tmp_path, objectives=["dppo"]).cells()) + 2
    assert st.variant_names("all") == list(st.VARIANTS)
    with pytest.raises(ConfigError) as err:
        st.variant_names("stapo,nope")
    assert err.value.field == "--variants" and "'nope'" in str(err.value)
    # a cell.json written before variants existed still reads, as the same cell
    old = st.Cell(**{"objective": "ppo", "replay": "off", "mini_batches": 8, "mismatch": "none", "seed": 1})
    assert old.variant == "" and old.name == "ppo-off-m8-none-s1" and old.label == "ppo"

    runner = FakeRunner()
    st.run_grid(plan, runner=runner, warm_start=fake_warm_start)
    job = next(j for j in runner.calls if j.cell.variant == "kl_future")
    axes = job.argv.index("train.seed=0")  # the variant's overrides come after the cell's axes
    assert job.argv[axes + 1: axes + 3] == ["algorithm.stages=[{name: future_kl}]", "algorithm.kl_coef=0.05"]
    table = (plan.out / "table.md").read_text()
    m8 = table.split("train.mini_batches=8)")[1].split("## Variants")[0]
    assert "| ppo + stapo | off | none | 1 / 1 |" in m8  # the fake scenario collapses every off-m8-none cell
    assert m8.index("| dppo |") < m8.index("| ppo + kl_future |") < m8.index("| ppo + stapo |")
    assert "| kl_future | `algorithm.stages=[{name: future_kl}] algorithm.kl_coef=0.05` |" in table
    summary = json.loads((plan.out / "summary.json").read_text())
    row = next(s for s in summary["settings"] if s["setting"] == "stapo-off-m8-none")
    assert (row["variant"], row["objective"], row["label"]) == ("stapo", "ppo", "ppo + stapo")
    plots = sorted(p.name for p in (plan.out / "plots").glob("*.png"))
    assert "variants-m8.png" in plots and "objectives-m8.png" in plots
    assert "stapo-none.png" not in plots and "ppo-none.png" in plots  # variants stay out of the grid's figures


def test_every_variant_config_is_valid_and_a_bad_one_stops_the_grid_first(tmp_path, monkeypatch):
    plan = make_plan(tmp_path, variants=st.variant_names("all"))
    st.validate_cells(plan, plan.cells(), STEPS)  # every listed variant is a valid config of the base
    monkeypatch.setitem(st.VARIANTS, "bad_mask", ("algorithm.stages=[{name: nope}]",))
    plan = make_plan(tmp_path, variants=["stapo", "bad_mask"])
    runner = FakeRunner()
    with pytest.raises(ConfigError) as err:
        st.run_grid(plan, runner=runner, warm_start=fake_warm_start)
    assert err.value.field == "algorithm.stages[0].name" and "(cell bad_mask-off-m8-none-s0)" in str(err.value)
    assert runner.calls == [] and not (plan.out / "cells").exists()


@pytest.mark.parametrize("variants, field, words", [
    ({"v": ("algorithm.objective=gspo",)}, "VARIANTS['v'][0]", "cell axis"),
    ({"v": ("algorithm.stages=[{name: stapo}]", "train.mini_batches=4")}, "VARIANTS['v'][1]", "cell axis"),
    ({"v": ("stages",)}, "VARIANTS['v'][0]", "section.field=value"),
    ({"gspo": ("algorithm.stages=[{name: stapo}]",)}, "VARIANTS['gspo']", "objective's name"),
])
def test_malformed_variants_are_refused(variants, field, words):
    with pytest.raises(ConfigError) as err:
        st.check_variants(variants, ["ppo", "gspo"], {})
    assert err.value.field == field and words in str(err.value)


def test_an_objective_option_variant_runs_on_its_objective(tmp_path):
    plan = make_plan(tmp_path, variants=st.variant_names("holder_anneal"))
    cell = next(c for c in plan.cells() if c.variant)
    assert (cell.name, cell.objective, cell.label) == ("holder_anneal-off-m8-none-s0", "holder",
                                                        "holder + holder_anneal")
    options = next(o for o in cell.overrides() if o.startswith("algorithm.objective_options="))
    assert "schedule: linear" in options and "algorithm.objective=holder" in cell.overrides()
    st.validate_cells(plan, [cell], STEPS)  # the schedule is a valid holder config
    for table, words in (({"nope": "holder"}, "names no variant"), ({"stapo": "nope"}, "no registered objective")):
        with pytest.raises(ConfigError) as err:
            st.check_variants({"stapo": ()}, ["ppo", "holder"], table)
        assert err.value.field == f"VARIANT_OBJECTIVES[{next(iter(table))!r}]" and words in str(err.value)


# ----------------------------------------------------------------------------- --grid dose


def test_dose_grid_cells_and_overrides():
    cells = st.grid_cells("dose", seeds=2)
    # 5 doses x replay {off, r2, r3} x m {1, 8}, and 5 alternatives x m {1, 8} at the highest dose; per seed
    assert len(cells) == 2 * (5 * 3 * 2 + 5 * 2) == 80
    assert sorted(st.DOSES) == [0.0, 0.005, 0.026, 0.09, 0.28]
    names = [c.name for c in cells]
    assert names[:6] == ["ppo-off-m1-none-s0", "ppo-off-m8-none-s0", "ppo-r2-m1-none-s0", "ppo-r2-m8-none-s0",
                         "ppo-r3-m1-none-s0", "ppo-r3-m8-none-s0"]  # dose 0: the small grid's names
    for name in ("ppo-off-m8-none-n0.005-s0", "ppo-r3-m1-none-n0.09-s1", "ppo-r2-m8-none-n0.28-s1",
                 "ppo-off-m8-tis-n0.28-s0", "ppo-off-m1-icepop-n0.28-s0", "ppo-off-m8-mis_seq-n0.28-s1",
                 "gspo-off-m8-none-n0.28-s0", "gspo-r3-m1-none-n0.28-s1"):
        assert name in names
    assert len(set(names)) == len(names) and names[40:] == [n.replace("-s0", "-s1") for n in names[:40]]
    assert not any("-n0.09-" in n and ("tis" in n or "gspo" in n) for n in names)  # alternatives: top dose only
    cell = next(c for c in cells if c.name == "ppo-r3-m8-none-n0.09-s0")
    assert cell.noise == 0.09 and "rollout.router_noise=0.09" in cell.overrides()
    assert cell.options == ["algorithm.objective=ppo", "algorithm.routing_replay=r3", "train.mini_batches=8",
                            "algorithm.mismatch=none", "rollout.router_noise=0.09"]
    zero = next(c for c in cells if c.name == "ppo-r3-m8-none-s0")
    assert not any(o.startswith("rollout.router_noise") for o in zero.overrides())
    # the small grid's cells (and a cell.json written before doses) keep their names and overrides
    assert [c.name for c in st.grid_cells("small", 1)] == [
        "ppo-off-m1-none-s0", "ppo-off-m8-none-s0", "ppo-r2-m1-none-s0", "ppo-r2-m8-none-s0", "ppo-r3-m1-none-s0",
        "ppo-r3-m8-none-s0", "minirl-off-m8-none-s0", "gspo-off-m8-none-s0", "ppo-off-m1-tis-s0", "ppo-off-m8-tis-s0"]
    old = st.Cell(objective="ppo", replay="off", mini_batches=8, mismatch="tis", seed=2)
    assert old.noise == 0.0 and old.name == "ppo-off-m8-tis-s2" and len(old.overrides()) == 5


def test_dose_grid_dry_run_defaults_to_three_seeds(tmp_path, capsys):
    from megapo.cli import main

    out = tmp_path / "grid"
    assert main(["bench", "stability", "--grid", "dose", "--dry-run", "--out", str(out), "--steps", "60",
                 "--jobs", "1"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[:-1] == [c.name for c in st.grid_cells("dose", 3)]
    assert {int(name.rsplit("-s", 1)[1]) for name in printed[:-1]} == {0, 1, 2}
    minutes = (120 + 120 * (30 + 60 * 0.5)) / 60
    assert printed[-1].startswith("120 cells x 60 steps, 1 at a time") and f"about {minutes:.0f} min" in printed[-1]
    assert not out.exists()
    assert main(["bench", "stability", "--grid", "dose", "--dry-run", "--out", str(out),
                 "--set", "rollout.router_noise=0.1"]) == 2
    assert "the dose grid sets rollout.router_noise per cell" in capsys.readouterr().err


def test_dose_report_from_synthetic_metrics(tmp_path):
    """Cells at two doses (0 and the highest), metrics written as a run would: the dose table lists each dose's
    measured disagreement and each row's collapse count and options, and plots/dose.png is written."""
    top = max(st.DOSES)
    plan = make_plan(tmp_path)
    plan.grid = "dose"
    cells = [c for c in st.grid_cells("dose", 1) if c.noise in (0.0, top)]
    for c in cells:
        rows = fake_rows(c, STEPS)
        for r in rows[1:]:
            r["router/disagree"] = 0.006 if c.noise == 0 else 0.31
        d = plan.cell_dir(c)
        write_metrics(d, rows)
        (d / st.CELL_FILE).write_text(json.dumps({"cell": st.asdict(c), "name": c.name, "overrides": c.overrides()}))
        (d / st.DONE_FILE).write_text("{}")
    summary = st.write_report(plan, STEPS)
    assert [(d["noise"], d["done"]) for d in summary["doses"]] == [(0.0, 6), (0.005, 0), (0.026, 0), (0.09, 0),
                                                                  (top, 16)]
    assert summary["doses"][0]["measured_disagree"] == pytest.approx(0.006)
    assert summary["doses"][-1]["measured_disagree"] == pytest.approx(0.31)
    assert summary["doses"][0]["calibrated_disagree"] == st.DOSES[0.0]
    row = next(s for s in summary["settings"] if s["setting"] == "ppo-off-m8-mis_seq-n0.28")
    assert row["noise"] == top and "algorithm.mismatch=mis_seq" in row["options"]
    table = (plan.out / "table.md").read_text()
    assert "| 0 | 0.55 % | 0.60 % | 6 / 6 |" in table and "| 0.28 | 30.00 % | 31.00 % | 16 / 16 |" in table
    dose = table.split("## Router disagreement dose")[1].split("## 1 optimizer step")[0]
    # the ppo rows at both doses (the fake scenario: off-m8-none collapses at every dose), alternatives at the top
    assert ("| 8 | ppo | off | none | 1 / 1 · 0.100 | – | – | – | 1 / 1 · 0.100 | `algorithm.objective=ppo "
            "algorithm.routing_replay=off train.mini_batches=8 algorithm.mismatch=none` |") in dose
    assert "| σ 0 (0.60 %) | σ 0.005 (1.00 %) | σ 0.026 (3.00 %) | σ 0.09 (10.00 %) | σ 0.28 (31.00 %) |" in dose
    assert "| 8 | ppo | r3 | none | 0 / 1 · 0.400 | – | – | – | 0 / 1 · 0.400 |" in dose
    assert "| 8 | gspo | r3 | none | – | – | – | – | 0 / 1 · 0.400 |" in dose
    assert "| 1 | ppo | off | icepop | – | – | – | – | 0 / 1 · 0.400 |" in dose
    # every row of the per-m tables names its dose and lists the options it ran with
    m8 = table.split("train.mini_batches=8)")[1].split("## Cells")[0]
    assert ("| ppo | off | tis | 0.28 | 0 / 1 |" in m8 and "rollout.router_noise=0.28` |" in m8)
    assert all(ln.endswith("` |") for ln in m8.splitlines() if ln.startswith("| ppo") or ln.startswith("| gspo"))
    plots = sorted(p.name for p in (plan.out / "plots").glob("*.png"))
    assert "dose.png" in plots and "ppo-none.png" in plots and "ppo-none-n0.28.png" in plots
    assert "ppo-icepop-n0.28.png" in plots and "ppo-icepop.png" not in plots
