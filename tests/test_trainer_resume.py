"""`megapo train` stopped by SIGTERM and resumed gives the same run as one never stopped.

Reference: an uninterrupted run with the same seeds (run A). Run B gets a real SIGTERM once step 1 is
logged; by the Slurm contract (slurm/README.md) it saves a checkpoint after the step in flight and
exits 75; `--resume` continues at the next step. Every later step's metrics (reward, response length,
loss, grad norm, engine-vs-learner mismatch...) must equal run A's: any state not saved (weights,
Adam moments, LR schedule, data cursor, the engine's sampling RNG, the synced weight version, the length
stage's state) would
change them. Also: a checkpoint saved before any optimizer step (every group had equal rewards, so
every update was skipped) resumes (it used to fail with KeyError: optimizer.state.exp_avg).
"""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "megapo/configs/tiny_moe_addition.yaml"
REWARDS = ("def parity(response, answer):\n    return float(sum(map(ord, response)) % 2)\n\n"
           "def constant(response, answer):\n    return 0.5\n")
# values that are not deterministic functions of the run's state
UNTIMED = ("time/", "tokens_per_s", "train/step_time_s", "train/tokens_per_s")


def _cmd(model, out, *extra, resume=False):
    return [sys.executable, "-m", "megapo.cli", "train", *(["--resume"] if resume else []), str(CONFIG),
            f"model.path={model}", "sft.enabled=false", f"train.output_dir={out}", "train.steps=5",
            "train.ckpt_every=2", "train.keep_last=5", "train.eval_every=0", "train.log=[jsonl]",
            "data.prompts_per_step=2", "rollout.n_samples=4", "rollout.max_new_tokens=6",
            "data.dynamic_sampling=false", "data.reward=resume_rewards:parity", "data.truncated_reward=null", "algorithm.routing_replay=off",
            "optim.lr=0.01", "optim.warmup_steps=2", "optim.lr_schedule=cosine", *extra]


# a length reward with state (its dual variable, logged as length/lambda), which --resume must restore
LACONIC = ("data.length_reward=laconic", "data.length_reward_options={target: 3, dual_lr: 0.5}")


def _env(tmp_path):
    (tmp_path / "resume_rewards.py").write_text(REWARDS)
    return {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1"}


def _rows(out):
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _deterministic(row):
    return {k: v for k, v in row.items() if k != "step" and not any(k.startswith(u) or k == u for u in UNTIMED)}


def test_sigterm_then_resume_matches_an_uninterrupted_run(tmp_path, tiny_moe):
    env = _env(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    run_a = subprocess.Popen(_cmd(tiny_moe, a, *LACONIC), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    run_b = subprocess.Popen(_cmd(tiny_moe, b, *LACONIC), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ((b / "metrics.jsonl").is_file() and '"step": 1' in (b / "metrics.jsonl").read_text()):
            assert run_b.poll() is None, run_b.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "run B never logged step 1"
            time.sleep(0.1)
        run_b.send_signal(signal.SIGTERM)
        run_b.send_signal(signal.SIGTERM)  # Slurm and torchrun may both deliver it: still one clean stop
        _, err_b = run_b.communicate(timeout=300)
        _, err_a = run_a.communicate(timeout=300)
    finally:
        for p in (run_a, run_b):
            if p.poll() is None:
                p.kill()
    assert run_a.returncode == 0, err_a[-3000:]
    assert run_b.returncode == 75, err_b[-3000:]
    saved = sorted(p.name for p in (b / "checkpoints").iterdir())
    stopped_at = max(_rows(b))
    assert stopped_at in (1, 2, 3), saved  # the step in flight when the signal came was finished
    assert f"step_{stopped_at:08d}" in saved and not any(n.endswith(".tmp") for n in saved)

    resumed = subprocess.run(_cmd(tiny_moe, b, *LACONIC, resume=True), cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows_a, rows_b = _rows(a), _rows(b)
    assert rows_a[stopped_at]["length/lambda"] > 0  # the stage had state to lose when run B stopped
    assert sorted(rows_b) == [1, 2, 3, 4, 5]  # resumed at the next step, nothing repeated or lost
    for step in range(stopped_at + 1, 6):
        want, got = _deterministic(rows_a[step]), _deterministic(rows_b[step])
        assert set(got) == set(want)
        assert {"reward", "reward/shaped", "length/lambda", "train/loss", "train/grad_norm", "train/lr",
                "response_len"} <= set(got)
        for k in want:
            assert abs(got[k] - want[k]) <= 1e-6 * (1 + abs(want[k])), (step, k, got[k], want[k])
    # the weights moved between the resumed steps (a frozen learner would also "agree")
    assert rows_a[5]["train/grad_norm"] > 0 and rows_a[4]["train/lr"] != rows_a[5]["train/lr"]


@pytest.fixture(scope="module")
def unupdated_run(tmp_path_factory, tiny_moe):
    """A 2-step run checkpointing every step with equal rewards in every group: dynamic sampling keeps none, every
    update is skipped. Its folder (tests copy it) and stderr; it serves the two tests below, which each resume a copy
    (one launch fewer than a run each)."""
    tmp = tmp_path_factory.mktemp("unupdated")
    out = tmp / "run"
    skipped = subprocess.run(_cmd(tiny_moe, out, "train.steps=2", "train.ckpt_every=1", "data.dynamic_sampling=true",
                                  "data.max_sampling_rounds=1", "data.reward=resume_rewards:constant"),
                             cwd=ROOT, env=_env(tmp), capture_output=True, text=True, timeout=300)
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    return out, skipped.stderr


def test_resume_from_a_checkpoint_saved_before_any_update(tmp_path, tiny_moe, unupdated_run):
    """Equal rewards in every group: dynamic sampling keeps none, every update is skipped, so Adam has
    no state when step 2 is saved. Resuming with an informative reward must load it and train."""
    env = _env(tmp_path)
    out = tmp_path / "run"
    shutil.copytree(unupdated_run[0], out)
    assert "no informative group" in unupdated_run[1]
    assert all("train/loss" not in r for r in _rows(out).values())  # no update happened
    resumed = subprocess.run(_cmd(tiny_moe, out, "train.steps=3", "rollout.n_samples=8", resume=True),
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_00000002" in resumed.stderr  # resumed from the newest
    rows = _rows(out)
    assert sorted(rows) == [1, 2, 3]
    assert rows[3]["train/grad_norm"] > 0


class _Payload:
    """A pickle that writes a marker file when loaded (what a hostile rng.pt would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def test_hostile_old_format_checkpoint_exits_2_and_names_the_earlier_one_that_resumes(tmp_path, tiny_moe,
                                                                                      unupdated_run):
    """The newest checkpoint made a pre-manifest one whose rng.pt carries a payload: `--resume` exits 2
    without a traceback, naming rng.pt and offering step 1; the payload never runs; after moving the
    named folder aside as told, `--resume` continues from step 1."""
    import pickle

    env = _env(tmp_path)
    out = tmp_path / "run"
    shutil.copytree(unupdated_run[0], out)  # a finished 2-step run with checkpoints at steps 1 and 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    newest = out / "checkpoints" / "step_00000002"
    (newest / "manifest.json").unlink()
    (newest / "rng.safetensors").unlink()
    marker = tmp_path / "payload_ran"
    (newest / "rng.pt").write_bytes(pickle.dumps(_Payload(marker)))

    refused = subprocess.run(_cmd(tiny_moe, out, "train.steps=3", "train.ckpt_every=1", resume=True), cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert f"{newest}" in refused.stderr and "rng.pt" in refused.stderr, refused.stderr[-3000:]
    assert f"earlier checkpoint that verifies is {out / 'checkpoints' / 'step_00000001'}" in refused.stderr
    assert not marker.exists()

    newest.rename(newest.with_name(newest.name + ".damaged"))  # what the message says to do
    resumed = subprocess.run(_cmd(tiny_moe, out, "train.steps=3", "train.ckpt_every=1", resume=True), cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_00000001" in resumed.stderr  # resumed from it
    assert sorted(_rows(out)) == [1, 2, 3] and not marker.exists()
