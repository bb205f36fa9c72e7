"""`megapo plan` (megapo/launch/plan.py): the parameter count formula against real tiny models, the per-GPU bytes of
weights / gradients / optimizer state / guard copy against what the learner holds (tools/bench/memory.py's measuring
function, one 2-process launch), and misfits refused, also by `megapo launch slurm --dry-run` before submitting."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from safetensors import safe_open

from megapo.cli import main
from megapo.config import ParallelConfig
from megapo.launch.plan import RunShape, param_counts, plan_memory
from megapo.models.family import family_for
from megapo.models.tiny import write_tiny_model

REPO = Path(__file__).resolve().parents[1]
DSV3 = REPO / "launch" / "deepseek-v3"


def safetensors_numel(model_dir: Path) -> int:
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def spec_of(model_dir: Path):
    hf = json.loads((model_dir / "config.json").read_text())
    return family_for(hf).spec(hf)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss", "glm4_moe"])
def test_param_count_matches_the_tiny_models(tmp_path, family):
    model = write_tiny_model(tmp_path / family, family)
    assert param_counts(spec_of(model))["total"] == safetensors_numel(model)


def test_param_count_of_the_published_models():
    # the model cards' totals: DeepSeek-V3 671 B (37 B active), Qwen3-30B-A3B 30.5 B (3.3 B active)
    c = param_counts(spec_of(DSV3))
    assert round(c["total"] / 1e9) == 671 and round(c["active"] / 1e9) == 38
    c = param_counts(spec_of(REPO / "launch" / "qwen3-30b-a3b"))
    assert round(c["total"] / 1e8) == 305 and round(c["active"] / 1e8) == 34


STATE = ("weights", "gradients (fp32)", "optimizer (main params + Adam)", "guard copy (optim.restore_nonfinite)")


def test_planner_matches_measured_memory(tmp_path):
    """TP=2 x EP=2 and PP=2, bf16 with the distributed optimizer: the planner's weights, gradients, optimizer state
    and guard copy within 10 % of the tensors each rank holds after two train steps (one launch of 2 processes)."""
    from tools.bench import memory

    model = write_tiny_model(tmp_path / "m", "qwen3_moe")
    measured = memory.measure(model, ["tp2-ep2-bf16-do", "pp2-bf16-do"], steps=1, warmup=1, threads=1,
                              work_dir=tmp_path / "work")
    spec, run = spec_of(model), RunShape(precision="bf16")
    layouts = {"tp2-ep2-bf16-do": ParallelConfig(tp=2, ep=2, dp=1, distributed_optimizer=True),
               "pp2-bf16-do": ParallelConfig(pp=2, dp=1, distributed_optimizer=True)}
    for name, parallel in layouts.items():
        plan = plan_memory(spec, parallel, run)
        for rank, got in enumerate(measured[name]["bytes_per_rank"]):
            stage = rank if parallel.pp > 1 else 0
            planned = dict(plan.stages[stage]["rows"])
            want = {STATE[0]: got["weights"], STATE[1]: got["grads"],
                    STATE[2]: got["optimizer_main"] + got["optimizer_moments"], STATE[3]: got["guard_copy"]}
            for term, bytes_ in want.items():
                assert planned[term] == pytest.approx(bytes_, rel=0.10), (name, rank, term)


def test_deepseek_v3_on_one_h100_node_is_refused(capsys):
    """DeepSeek-V3 on 1 node x 8 H100, EP=8: refused (exit 2) naming the overflowing term; with the engine
    elsewhere (rollout.servers) the learner's own state overflows."""
    base = [str(DSV3 / "run.yaml"), "--nodes", "1", "--gpu", "h100", f"model.path={DSV3}",
            "parallel.tp=1", "parallel.ep=8", "parallel.dp=8"]
    assert main(["plan", *base]) == 2
    err = capsys.readouterr().err
    assert "does not fit a h100" in err and "the largest term colocated engine weights" in err
    assert main(["plan", *base, 'rollout.servers=["gpu-node:8000"]']) == 2
    err = capsys.readouterr().err
    assert "the largest term guard copy" in err and "no layout of 8 h100 GPUs fits it" in err


def test_launch_refuses_a_misfit_before_submitting(tmp_path, capsys, monkeypatch):
    """`megapo launch slurm` on a layout that does not fit: exit 2, the term and a layout that fits named, no sbatch."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "sbatch_calls"
    (bindir / "sbatch").write_text(f'#!/bin/bash\necho "$@" >> {record}\necho 4242\n')
    (bindir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    recipe = REPO / "launch" / "gpt-oss-20b"  # its recipe at TP=1 instead of 2: 80 GB per GPU
    args = ["launch", "slurm", str(recipe / "run.yaml"), "--nodes", "3", "--rollout-nodes", "1", "--gpu", "h100",
            f"model.path={recipe}", "parallel.tp=1", "parallel.dp=16",
            "--entry-script", str(REPO / "tests" / "slurm_standin.py")]
    for extra in (["--dry-run"], []):
        assert main([*args, *extra]) == 2
        out, err = capsys.readouterr()
        assert out == "" and "does not fit a h100" in err and "the largest term guard copy" in err
        assert "a layout that fits on these 16 GPUs: parallel.tp=1 parallel.pp=1 parallel.ep=16" in err
    assert not record.exists()
