"""The recipes under launch/: each config.json passes the converter's key check, each run.yaml loads as a RunConfig
(field names, types, ranges; the cross-field rules of parallel, optim, algorithm, rollout and train), and the launch command in its header renders with --dry-run (which runs the memory
planner on the stated cluster) and fits per `megapo plan`.

The dry run uses the recipe's folder (config.json only) as model.path and the Slurm stand-in as --entry-script: the
trainer's own check needs the checkpoint's weights and tokenizer, and R3 with vLLM needs a GPU to pass it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from megapo.cli import main

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.parent for p in (REPO / "launch").glob("*/run.yaml"))
STANDIN = REPO / "tests" / "slurm_standin.py"


def launch_command(recipe: Path) -> list[str]:
    """The `megapo launch slurm ...` line of the recipe's header comment, without `megapo` and overrides."""
    line = next(line for line in recipe.joinpath("run.yaml").read_text().splitlines()
                if line.lstrip("# ").startswith("megapo launch slurm"))
    words = shlex.split(line.lstrip("# "))[1:]
    return [w for w in words if "=" not in w]


def test_every_recipe_is_listed():
    assert len(RECIPES) >= 6
    readme = (REPO / "launch" / "README.md").read_text()
    for recipe in RECIPES:
        assert f"launch/{recipe.name}/run.yaml" in readme


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_renders_and_fits(recipe, capsys, tmp_path):
    from megapo.config import load_config
    from megapo.convert.support import check_config
    from megapo.trainer.config import RunConfig

    check_config(json.loads((recipe / "config.json").read_text()), "model")
    cfg = load_config(RunConfig, recipe / "run.yaml", validate=False)
    with pytest.MonkeyPatch.context() as mp:  # the cross-field rules that read no files, as on a GPU node (R3, bf16)
        mp.setattr("torch.cuda.is_available", lambda: True)
        cfg.parallel.validate()
        cfg.optim.validate()
        cfg._validate_algorithm()
        cfg._validate_rollout()
        cfg._validate_train()
    cmd = launch_command(recipe)
    assert cmd[:3] == ["launch", "slurm", f"launch/{recipe.name}/run.yaml"]
    cmd[2] = str(recipe / "run.yaml")
    overrides = [f"model.path={recipe}", f"train.output_dir={tmp_path / 'out'}"]
    assert main([*cmd, *overrides, "--dry-run", "--entry-script", str(STANDIN)]) == 0
    script = capsys.readouterr().out
    assert script.startswith("#!/bin/bash") and "#SBATCH --gpus-per-node=8" in script
    plan_args = ["plan", cmd[2], *cmd[3:], *overrides]  # the same cluster flags
    assert main(plan_args) == 0
    assert "fits:" in capsys.readouterr().out
