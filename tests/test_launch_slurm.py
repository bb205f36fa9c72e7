"""`megapo launch slurm|local` without a cluster: impossible layouts are refused before anything is
submitted, and rendered sbatch scripts are valid bash that carry the run's layout and overrides.

A fake `sbatch` on PATH records whether it was called, so "refused before submission" is checked
on the real submit path, not only with --dry-run.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from megapo.cli import main
from megapo.engines.auth import read_key_file

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "megapo" / "configs" / "tiny_moe_addition.yaml"


@pytest.fixture
def fake_sbatch(tmp_path, monkeypatch):
    """An `sbatch` that records its arguments and prints a job id; returns the record file."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "sbatch_calls"
    script = bindir / "sbatch"
    script.write_text(f'#!/bin/bash\necho "$@" >> {record}\necho 4242\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return record


def write_config(tmp_path: Path, model: Path | str, **sections) -> Path:
    """The shipped run config (so the trainer's own config check passes) on `model`, with `sections` replaced."""
    cfg = yaml.safe_load(SHIPPED.read_text())
    cfg["model"] = {"path": str(model)}
    cfg["train"]["output_dir"] = str(tmp_path / "out")
    cfg["parallel"] = {}
    for name, value in sections.items():
        cfg[name] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["launch", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------- refused layouts
# tiny_moe: 4 attention heads, 2 KV heads, 2 layers, 8 experts; tiny_dense: the same without experts.

REFUSED = [
    # (id, parallel section, cli args, words the error must contain)
    ("tp_heads", {"tp": 3}, ["--nodes", 1, "--gpus-per-node", 3],
     ["parallel.tp", "tp=3", "num_attention_heads=4"]),
    ("ep_experts", {"ep": 3}, ["--nodes", 1, "--gpus-per-node", 3],
     ["parallel.ep", "ep=3", "experts (8)"]),
    ("world_size", {"tp": 2, "dp": 1}, ["--nodes", 2, "--gpus-per-node", 4],
     ["parallel", "8 learner processes", "2*1*1 = 2"]),
    ("pp_layers", {"pp": 4}, ["--nodes", 1, "--gpus-per-node", 4],
     ["parallel.pp", "pp=4", "num_hidden_layers=2"]),
    ("rollout_nodes", {}, ["--nodes", 2, "--gpus-per-node", 1, "--rollout-nodes", 2],
     ["--rollout-nodes", "2 rollout nodes", "--nodes 2"]),
    ("not_multiple_of_tp_pp", {"tp": 2}, ["--nodes", 1, "--gpus-per-node", 3],
     ["parallel", "3 learner processes", "tp*pp = 2*1 = 2"]),
    ("ep_divides_tp_dp", {"tp": 1, "dp": 2, "ep": 4}, ["--nodes", 1, "--gpus-per-node", 2],
     ["parallel.ep", "4", "tp*dp"]),
    ("unknown_parallel_field", {"tpp": 2}, ["--nodes", 1, "--gpus-per-node", 1],
     ["parallel.tpp", "did you mean 'tp'"]),
    ("cpu_without_procs", {}, ["--nodes", 1, "--gpus-per-node", 0],
     ["--procs-per-node", "required"]),
    ("more_procs_than_gpus", {}, ["--nodes", 1, "--gpus-per-node", 2, "--procs-per-node", 4],
     ["--procs-per-node", "4 processes", "2 GPUs"]),
    ("bad_time", {}, ["--nodes", 1, "--gpus-per-node", 1, "--time", "2 hours"],
     ["--time", "'2 hours'"]),
]


@pytest.mark.parametrize("parallel,cli,words", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_impossible_layout_is_refused_before_submission(tmp_path, tiny_moe, fake_sbatch, capsys, parallel, cli, words):
    config = write_config(tmp_path, tiny_moe, parallel=parallel)
    rc, out, err = launch(capsys, "slurm", config, *cli)
    assert rc == 2, (out, err)
    for word in words:
        assert word in err, f"{word!r} not in: {err}"
    assert not fake_sbatch.exists(), "sbatch was called for a refused layout"
    assert not (tmp_path / "out").exists(), "the launcher created the output dir for a refused layout"


def test_missing_model_dir_is_refused(tmp_path, fake_sbatch, capsys):
    config = write_config(tmp_path, tmp_path / "no_such_model")
    rc, _, err = launch(capsys, "slurm", config, "--nodes", 1)
    assert rc == 2
    assert "model.path" in err and "no_such_model" in err and "does not exist" in err
    assert not fake_sbatch.exists()


def test_model_dir_without_config_json_is_refused(tmp_path, fake_sbatch, capsys):
    (tmp_path / "empty_model").mkdir()
    config = write_config(tmp_path, tmp_path / "empty_model")
    rc, _, err = launch(capsys, "slurm", config, "--nodes", 1)
    assert rc == 2 and "no config.json" in err
    assert not fake_sbatch.exists()


def test_missing_output_dir_and_config_are_refused(tmp_path, tiny_moe, fake_sbatch, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": str(tiny_moe)}}))
    rc, _, err = launch(capsys, "slurm", path, "--nodes", 1)
    assert rc == 2 and "train.output_dir" in err
    rc, _, err = launch(capsys, "slurm", tmp_path / "nope.yaml", "--nodes", 1)
    assert rc == 2 and "nope.yaml does not exist" in err
    assert not fake_sbatch.exists()


def test_dense_model_with_ep_is_refused(tmp_path, tiny_dense, capsys):
    config = write_config(tmp_path, tiny_dense, parallel={"ep": 2})
    rc, _, err = launch(capsys, "slurm", config, "--nodes", 1, "--gpus-per-node", 2, "--dry-run")
    assert rc == 2 and "parallel.ep" in err and "dense" in err


def test_disaggregated_needs_a_server_engine(tmp_path, tiny_moe, capsys):
    config = write_config(tmp_path, tiny_moe, rollout={"engine": "embedded"})
    rc, _, err = launch(capsys, "slurm", config, "--nodes", 2, "--rollout-nodes", 1, "--dry-run")
    assert rc == 2 and "rollout.engine" in err and "embedded" in err
    config = write_config(tmp_path, tiny_moe, rollout={"engine": "vllm", "servers": ["a:1"]})
    rc, _, err = launch(capsys, "slurm", config, "--nodes", 2, "--rollout-nodes", 1, "--dry-run")
    assert rc == 2 and "rollout.servers" in err
    config = write_config(tmp_path, tiny_moe, rollout={"engine": "vllm", "api_key_file": "/shared/key"})
    rc, _, err = launch(capsys, "slurm", config, "--nodes", 2, "--rollout-nodes", 1, "--dry-run")
    assert rc == 2 and "rollout.api_key_file: is set by the launcher" in err


def test_trainer_config_errors_are_refused_before_submission(tmp_path, tiny_moe, fake_sbatch, capsys):
    """The whole run config gets the trainer's own check, not only the sections the launcher reads."""
    config = write_config(tmp_path, tiny_moe)
    rc, _, err = launch(capsys, "slurm", config, "--nodes", 1, "--gpus-per-node", 1, "algorithm.objective=nope")
    assert rc == 2 and "algorithm.objective" in err and "nope" in err
    rc, _, err = launch(capsys, "local", config, "--nproc", 1, "train.stepz=3")
    assert rc == 2 and "train.stepz" in err and "did you mean 'steps'" in err
    assert not fake_sbatch.exists()


def test_shipped_config_with_a_tiny_model_not_written_yet(tmp_path, capsys):
    """model.tiny: the trainer writes the model first, so the layout is checked against the tiny block."""
    cfg = yaml.safe_load(SHIPPED.read_text())
    cfg["model"]["path"] = str(tmp_path / "not_yet")
    cfg["train"]["output_dir"] = str(tmp_path / "out")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    rc, script, err = launch(capsys, "slurm", config, "--nodes", 2, "--gpus-per-node", 0, "--procs-per-node", 1,
                             "--dry-run", "parallel.dp=2")
    assert rc == 0, err
    assert bash_array(script, "OVERRIDES") == ["parallel.dp=2"]
    rc, _, err = launch(capsys, "slurm", config, "--nodes", 1, "--gpus-per-node", 3, "--dry-run", "parallel.tp=3",
                        "parallel.dp=1")
    assert rc == 2 and "num_attention_heads=4" in err  # heads: 4 in the shipped tiny block
    assert not (tmp_path / "not_yet").exists()


def test_overrides_are_applied_before_the_check(tmp_path, tiny_moe, capsys):
    """parallel.tp=3 given on the command line (after options) is what gets checked."""
    config = write_config(tmp_path, tiny_moe, parallel={"tp": 1})
    rc, _, err = launch(capsys, "slurm", config, "--nodes", 1, "--gpus-per-node", 3, "--dry-run", "parallel.tp=3")
    assert rc == 2 and "tp=3 does not divide num_attention_heads=4" in err


# ----------------------------------------------------------------------------- rendered scripts


def bash_array(script: str, name: str) -> list[str]:
    """The items of the bash array `name=(...)` in `script`, as bash itself reads them."""
    line = next(line for line in script.splitlines() if line.startswith(f"{name}=("))
    out = subprocess.run(["bash", "-c", f'{line}\nprintf "%s\\0" "${{{name}[@]}}"'], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\0")[:-1]


def sbatch_lines(script: str) -> list[str]:
    return [line[len("#SBATCH "):] for line in script.splitlines() if line.startswith("#SBATCH ")]


def bash_n(script: str, tmp_path: Path) -> None:
    path = tmp_path / "check.sbatch"
    path.write_text(script)
    out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_colocated_script(tmp_path, tiny_moe, capsys):
    config = write_config(tmp_path, tiny_moe, parallel={"tp": 2, "ep": 2})
    rc, script, err = launch(
        capsys, "slurm", config, "--nodes", 2, "--gpus-per-node", 4, "--partition", "gpu", "--time", "1-00:00:00",
        "--dry-run", "data.prompt_key=it's a b", "--sbatch-arg=--account=rl", "train.steps=7",
    )
    assert rc == 0, err
    bash_n(script, tmp_path)
    assert "{{" not in script
    lines = sbatch_lines(script)
    for expected in ("--nodes=2", "--ntasks-per-node=1", "--requeue", "--partition=gpu", "--time=1-00:00:00",
                     "--gpus-per-node=4", "--account=rl", f"--output={tmp_path / 'out'}/logs/slurm-%j.out"):
        assert expected in lines, (expected, lines)
    # 2 nodes x 4 GPUs = 8 ranks at tp=2, pp=1: dp = 8 / 2 = 4, passed on to every rank
    assert bash_array(script, "OVERRIDES") == ["data.prompt_key=it's a b", "train.steps=7", "parallel.dp=4"]
    assert bash_array(script, "TRAIN_ENTRY") == ["-m", "megapo.cli", "train"]
    assert re.search(r"^PROCS_PER_NODE=4$", script, re.M)
    assert "rollout.servers" not in script and "srun" in script
    assert not (tmp_path / "out").exists(), "--dry-run must not create anything"


def test_disaggregated_script(tmp_path, tiny_moe, capsys):
    config = write_config(tmp_path, tiny_moe, parallel={"tp": 2, "pp": 2, "ep": 2},
                          rollout={"engine": "vllm", "weight_sync": "disk"})
    rc, script, err = launch(capsys, "slurm", config, "--nodes", 3, "--rollout-nodes", 1, "--gpus-per-node", 8,
                             "--engine-port", 31000, "--dry-run", "algorithm.routing_replay=r2")
    assert rc == 0, err
    bash_n(script, tmp_path)
    assert "--nodes=3" in sbatch_lines(script)
    # 2 learner nodes x 8 GPUs = 16 ranks at tp=2, pp=2: dp = 16 / 4 = 4
    assert bash_array(script, "OVERRIDES") == ["algorithm.routing_replay=r2", "parallel.dp=4"]
    assert re.search(r"^LEARNER_NODES=2$", script, re.M) and re.search(r"^ENGINE_PORT=31000$", script, re.M)
    assert bash_array(script, "SERVE_ENTRY") == ["-m", "megapo.cli", "serve"]
    assert "rollout.servers=" in script
    # the servers bind every interface only with --allow-remote and the run's key; the learner gets the same key
    [serve_line] = [line for line in script.splitlines() if '"${SERVE_ENTRY[@]}"' in line]
    assert "--host 0.0.0.0 --allow-remote" in serve_line
    assert re.search(r'"\$\{TRAIN_ENTRY\[@\]\}".*"\$KEY_OVERRIDE"', script)
    assert re.search(r'"\$\{OVERRIDES\[@\]\}" "\$KEY_OVERRIDE" &$', script, re.M)  # the serve command's end


def test_disaggregated_script_writes_a_private_key_per_run(tmp_path, tiny_moe, capsys):
    """The key-writing lines of the rendered script, run by bash: a new 64-hex-digit key, mode 600, per run."""
    config = write_config(tmp_path, tiny_moe, rollout={"engine": "vllm", "weight_sync": "disk"})
    rc, script, err = launch(capsys, "slurm", config, "--nodes", 2, "--rollout-nodes", 1, "--gpus-per-node", 0,
                             "--procs-per-node", 1, "--dry-run", "algorithm.routing_replay=r2")
    assert rc == 0, err
    lines = script.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("KEY_FILE="))
    end = next(i for i, line in enumerate(lines) if line.startswith("KEY_OVERRIDE="))
    snippet = "\n".join(["log() { echo \"$*\"; }"] + lines[start:end + 1] + ['echo "$KEY_OVERRIDE"'])
    keys = []
    for run in ("run0", "run1"):
        (tmp_path / run).mkdir()
        out = subprocess.run(["bash", "-c", snippet], env={**os.environ, "RUN_LOG": str(tmp_path / run)},
                             capture_output=True, text=True, check=True).stdout
        key_file = tmp_path / run / "engine-api-key"
        assert out.strip() == f"rollout.api_key_file={key_file}"
        assert key_file.stat().st_mode & 0o777 == 0o600
        keys.append(key_file.read_text())
        assert re.fullmatch(r"[0-9a-f]{64}", keys[-1])
        assert read_key_file(key_file) == keys[-1]  # what megapo serve and the trainer accept
    assert keys[0] != keys[1]


def test_submit_writes_the_dry_run_script_and_calls_sbatch(tmp_path, tiny_moe, fake_sbatch, capsys):
    config = write_config(tmp_path, tiny_moe)
    args = ["slurm", config, "--nodes", 2, "--gpus-per-node", 0, "--procs-per-node", 2]
    rc, dry, _ = launch(capsys, *args, "--dry-run")
    assert rc == 0
    rc, out, err = launch(capsys, *args)
    assert rc == 0, err
    assert "submitted job 4242" in out
    call = fake_sbatch.read_text().split()
    assert call[0] == "--parsable"
    assert Path(call[1]).read_text() == dry
    assert Path(call[1]).parent == tmp_path / "out" / "logs"


def test_launch_local_dry_run(tmp_path, tiny_moe, capsys):
    config = write_config(tmp_path, tiny_moe, parallel={"tp": 2})
    rc, out, err = launch(capsys, "local", config, "--nproc", 4, "--dry-run", "train.steps=3")
    assert rc == 0, err
    assert "--nproc-per-node 4" in out and "-m megapo.cli train" in out
    assert out.rstrip().endswith("train.steps=3 parallel.dp=2")  # 4 processes at tp=2: dp = 2
    rc, _, err = launch(capsys, "local", config, "--nproc", 3, "--dry-run")
    assert rc == 2 and "3 learner processes" in err
