"""Commands that run worker processes end a worker's failure with its one line, exit 1 or 2, no traceback
(megapo.worker_errors, megapo/launch/local.py, megapo/launch/quiet_torchrun.py).

One test per command, each on a failure only the workers meet (the parent's checks pass): `megapo convert
megatron-to-hf` of a checkpoint with a NaN weight, `megapo logprobs` with 2 processes on a model folder whose
safetensors lacks a tensor, `megapo launch local` (2 x `megapo train`) with a reward that fails in the run. Each
runs the real command line in a subprocess and reads its combined output. Then the pieces without a model: which
rank's failure is first, exit 2 for a worker's ConfigError, MEGAPO_DEBUG=1; and `megapo convert` refusing a
trainer checkpoint whose files differ from its manifest, before any process starts.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megapo import worker_errors

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "megapo/configs/tiny_moe_addition.yaml"


def _env(**extra) -> dict:
    ours = (worker_errors.ERROR_DIR, worker_errors.LAUNCHER_PID, worker_errors.DEBUG)
    env = {k: v for k, v in os.environ.items() if k not in ours}
    env.update({"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, **extra)
    return env


def _megapo(args: list[str], env: dict | None = None, timeout: int = 300) -> tuple[int, str]:
    """Exit code and combined stdout + stderr of `megapo ARGS` (the workers write into the same pipe)."""
    proc = subprocess.run([sys.executable, "-m", "megapo.cli", *args], cwd=ROOT, env=env or _env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, errors="replace")
    return proc.returncode, proc.stdout


def _last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def _assert_one_line(code: int, text: str, want_code: int, starts: str, *words: str) -> None:
    last = _last_line(text)
    assert code == want_code, text[-4000:]
    assert last.startswith(starts) and all(w in last for w in words), last
    assert "Traceback" not in text, text[-4000:]


# ----------------------------------------------------------------------------------------- the commands


@pytest.fixture(scope="module")
def megatron_ckpt(tiny_moe, tmp_path_factory) -> Path:
    """tiny_moe as a torch_dist checkpoint (hf-to-megatron, one process)."""
    out = tmp_path_factory.mktemp("worker_errors") / "ckpt"
    code, text = _megapo(["convert", "hf-to-megatron", "--hf", str(tiny_moe), "--out", str(out)])
    assert code == 0, text[-4000:]
    return out


def _poison(ckpt: Path, key: str) -> None:
    """Write NaN into the first element of tensor `key` of a torch_dist checkpoint, in place (each tensor is
    a torch.save record at an offset .metadata gives; the record is rewritten at the same length)."""
    from megapo.integrity import read_dist_metadata

    [info] = [s for i, s in read_dist_metadata(ckpt).storage_data.items() if i.fqn == key]
    path = ckpt / info.relative_path
    data = bytearray(path.read_bytes())
    tensor = torch.load(io.BytesIO(bytes(data[info.offset:info.offset + info.length])), weights_only=True)
    tensor.view(-1)[0] = float("nan")
    record = io.BytesIO()
    torch.save(tensor, record)
    assert len(record.getvalue()) == info.length
    data[info.offset:info.offset + info.length] = record.getvalue()
    path.write_bytes(bytes(data))


def test_convert_megatron_to_hf_names_the_nan_tensor(megatron_ckpt, tmp_path):
    ckpt = shutil.copytree(megatron_ckpt, tmp_path / "nan_ckpt")
    _poison(ckpt, "decoder.final_layernorm.weight")
    out = tmp_path / "hf"
    code, text = _megapo(["convert", "megatron-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--tp", "2"])
    _assert_one_line(code, text, 1, f"megapo convert megatron-to-hf: checkpoint {ckpt}: tensor "
                     "decoder.final_layernorm.weight holds 1 non-finite value(s)", f"nothing was written to {out}")
    assert not out.exists() and not list(tmp_path.glob("hf.tmp-*"))


def test_logprobs_two_processes_name_the_missing_tensor(tiny_moe, tmp_path):
    from safetensors.torch import load_file, save_file

    model = shutil.copytree(tiny_moe, tmp_path / "model")  # config.json fine: the parent's checks pass
    tensors = load_file(model / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "in.jsonl").write_text(json.dumps({"tokens": [1, 2, 3, 4]}) + "\n")
    out = tmp_path / "out.jsonl"
    code, text = _megapo(["logprobs", "--model", str(model), "--input", str(tmp_path / "in.jsonl"),
                          "--output", str(out), "--dp", "2"])
    _assert_one_line(code, text, 1, "megapo logprobs: KeyError: tensor 'model.norm.weight' not found",
                     f"{worker_errors.DEBUG}=1")
    assert not out.exists()


BAD_REWARD = '''CALLS = [0]


def reward(response, answer):
    CALLS[0] += 1
    if CALLS[0] > 1:  # the check when the config is loaded passes; the run's first call fails
        raise ValueError("the grader lost its answer key")
    return 0.0
'''


def test_launch_local_train_ends_with_the_failed_reward(tiny_moe, tmp_path):
    """2 x `megapo train` under torchrun (dp=2): rank 0 scores the samples and its reward raises
    (data.reward_errors=fail); rank 1 is stopped with it."""
    (tmp_path / "bad_reward.py").write_text(BAD_REWARD)
    overrides = [f"model.path={tiny_moe}", "sft.enabled=false", f"train.output_dir={tmp_path / 'run'}",
                 "train.steps=2", "train.eval_every=0", "train.ckpt_every=0", "train.log=[jsonl]",
                 "data.prompts_per_step=2", "rollout.n_samples=2", "rollout.max_new_tokens=4",
                 "data.dynamic_sampling=false", "data.truncated_reward=null", "data.reward=bad_reward:reward",
                 "parallel.dp=2"]
    code, text = _megapo(["launch", "local", str(CONFIG), "--nproc", "2", *overrides],
                         env=_env(PYTHONPATH=f"{tmp_path}:{ROOT}"), timeout=600)
    _assert_one_line(code, text, 1, "megapo launch local: reward 'bad_reward:reward' raised ValueError: "
                     "the grader lost its answer key")


# ----------------------------------------------------------------------------------------- the pieces

WORKER = '''import os, sys, time
from megapo.config import InputError
from megapo.worker_errors import guard


PRINTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank0_printed")


def body():
    rank = int(os.environ["RANK"])
    print(f"rank {rank} progress", file=sys.stderr, flush=True)
    if rank == 0:
        open(PRINTED, "w").close()
        time.sleep(60)  # torchrun stops this rank once rank 1 failed
    deadline = time.monotonic() + 60
    while not os.path.exists(PRINTED) and time.monotonic() < deadline:  # rank 0's line is out before rank 1 fails
        time.sleep(0.05)
    raise InputError("data.jsonl:3", "not JSON")


sys.exit(guard("megapo test", body))
'''


@pytest.mark.parametrize("debug", [False, True])
def test_a_worker_config_error_exits_2_with_its_line(tmp_path, debug, monkeypatch, capfd):
    """A worker's InputError: exit 2 and its line; the workers' other output stays; MEGAPO_DEBUG=1 adds the
    worker's traceback (on the workers' stderr, which the test captures as the file descriptor)."""
    from megapo.launch.local import run_workers

    (tmp_path / "worker.py").write_text(WORKER)
    monkeypatch.delenv(worker_errors.ERROR_DIR, raising=False)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    if debug:
        monkeypatch.setenv(worker_errors.DEBUG, "1")
    else:
        monkeypatch.delenv(worker_errors.DEBUG, raising=False)
    with pytest.raises(worker_errors.WorkersFailed) as failed:
        run_workers([str(tmp_path / "worker.py")], 2, timeout_s=120)
    assert failed.value.code == 2
    assert str(failed.value) == "data.jsonl:3: not JSON" and failed.value.failure.rank == 1
    err = capfd.readouterr().err
    assert "rank 0 progress" in err and "rank 1 progress" in err
    assert ("Traceback" in err) == debug and ("InputError: data.jsonl:3: not JSON" in err) == debug, err


def test_the_first_failure_is_the_one_naming_the_cause(tmp_path, monkeypatch):
    from megapo.integrity import NonFiniteError

    monkeypatch.setenv(worker_errors.ERROR_DIR, str(tmp_path))
    monkeypatch.setenv(worker_errors.LAUNCHER_PID, str(os.getppid()))  # as if this process were a worker
    monkeypatch.delenv(worker_errors.DEBUG, raising=False)
    monkeypatch.setenv("RANK", "0")
    other = NonFiniteError("ckpt: another rank holds non-finite weights")
    other.other_rank = True
    assert worker_errors.report("megapo x", other) == 1  # rank 0 raised first, but only because rank 1 did
    monkeypatch.setenv("RANK", "1")
    assert worker_errors.report("megapo x", NonFiniteError("ckpt: tensor w holds 1 non-finite value(s)")) == 1
    monkeypatch.setenv("RANK", "2")
    assert worker_errors.report("megapo x", RuntimeError("Connection closed\nby peer")) == 1  # later, a consequence
    first = worker_errors.first_failure(tmp_path)
    assert (first.rank, first.message, first.code) == (1, "ckpt: tensor w holds 1 non-finite value(s)", 1)
    later = json.loads((tmp_path / "rank2.json").read_text())
    assert later["message"] == ("RuntimeError: Connection closed by peer (rank 2; MEGAPO_DEBUG=1 prints the "
                                "traceback)")
    (tmp_path / "rank1.json").unlink()
    (tmp_path / "rank0.json").unlink()
    assert worker_errors.first_failure(tmp_path).rank == 2
    monkeypatch.setenv(worker_errors.LAUNCHER_PID, str(os.getppid() + 1))  # a process a worker started
    assert not worker_errors.in_worker()


def test_outside_a_worker_errors_print_as_before(capsys, monkeypatch):
    from megapo.cli import report_errors
    from megapo.config import ConfigError

    monkeypatch.delenv(worker_errors.ERROR_DIR, raising=False)

    def bad_input(_):
        raise ConfigError("--input", "x.jsonl:2: expected  {...}")

    def bug(_):
        raise ZeroDivisionError("a bug")

    assert report_errors("megapo x", bad_input, None) == 2
    assert capsys.readouterr().err == "megapo x: --input: x.jsonl:2: expected  {...}\n"
    with pytest.raises(ZeroDivisionError):  # a single process keeps a bug's traceback
        report_errors("megapo x", bug, None)


# ----------------------------------------------------------------------------------------- the manifest


def _trainer_checkpoint(ckpt: Path, root: Path) -> Path:
    """A trainer checkpoint (step_00000001/ with manifest.json) whose learner/ is `ckpt`."""
    from megapo.trainer.checkpoint import TrainerState, save_checkpoint

    def save_learner(folder: Path) -> None:
        shutil.copytree(ckpt, folder, dirs_exist_ok=True)

    return save_checkpoint(root, TrainerState(step=1, data_cursor={}, weight_version=1), save_learner)


def test_convert_refuses_a_checkpoint_that_differs_from_its_manifest(megatron_ckpt, tiny_moe, tmp_path, capsys,
                                                                     monkeypatch):
    """Before any process starts, step_N/ or step_N/learner/ is checked against step_N/manifest.json: a changed
    byte (sha256) or a truncated shard exits 2 naming the file."""
    import megapo.launch.local
    from megapo.cli import main
    from megapo.commands import convert

    def refuse(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(megapo.launch.local, "run_workers", refuse)
    step = _trainer_checkpoint(megatron_ckpt, tmp_path / "run")
    for given in (step, step / "learner"):
        convert._check_manifest(given, "--ckpt")  # intact: passes
    shard = step / "learner" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    for given in (step, step / "learner"):
        out = tmp_path / "hf"
        code = main(["convert", "megatron-to-hf", "--ckpt", str(given), "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.startswith(f"megapo convert megatron-to-hf: --ckpt: {step} does not match its manifest.json: "
                              "learner/__0_0.distcp differs from the manifest's sha256"), err
        assert not out.exists()
    shard.write_bytes(bytes(data[:-10]))
    code = main(["convert", "verify", "--hf", str(tiny_moe), "--ckpt", str(step)])
    err = capsys.readouterr().err
    assert code == 2 and "learner/__0_0.distcp has" in err and "truncated" in err, err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
