"""`megapo train` with more than one learner process (the path every GPU run takes).

`megapo launch local --nproc 2` runs the tiny main job with parallel.dp=2 × ep=2 (each rank holds half
of the experts and trains on half of the groups); rank 0 owns the embedded engine, the rewards and the
KL reference and broadcasts the batch. Reference: the same run in one process (dp=1, ep=1). The
objective's gradient does not depend on the DP split, so the weights after every step, hence the
next step's samples, rewards, loss, grad norm and KL, must match the single-process run. Also parallel.pp=2 under
r3, where rank 1 receives only its pipeline stage's route columns (megapo.trainer.handout).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "megapo/configs/tiny_moe_addition.yaml"
REWARDS = "def parity(response, answer):\n    return float(sum(map(ord, response)) % 2)\n"
COMPARED = ("reward", "response_len", "train/loss", "train/pg_loss", "train/grad_norm", "train/kl", "train/entropy",
            "train/response_tokens", "sync/bytes")


def _overrides(model, out):
    return [f"model.path={model}", "sft.enabled=false", f"train.output_dir={out}", "train.steps=3",
            "train.eval_every=0", "train.ckpt_every=0", "train.log=[jsonl]", "data.prompts_per_step=4",
            "rollout.n_samples=4", "rollout.max_new_tokens=6", "data.dynamic_sampling=false",
            "data.reward=dist_rewards:parity", "data.truncated_reward=null", "optim.lr=0.01", "optim.warmup_steps=0",
            "algorithm.kl_coef=0.01"]


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture()
def env(tmp_path):
    (tmp_path / "dist_rewards.py").write_text(REWARDS)
    return {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
            "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _one_and_two_processes(tmp_path, tiny_moe, env, extra: list[str], layout: list[str]):
    """The metrics rows of `megapo train` in one process and of `megapo launch local --nproc 2` with `layout`."""
    one, two = tmp_path / "one", tmp_path / "two"
    single = subprocess.run([sys.executable, "-m", "megapo.cli", "train", str(CONFIG), *_overrides(tiny_moe, one),
                             *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    multi = subprocess.run([sys.executable, "-m", "megapo.cli", "launch", "local", str(CONFIG), "--nproc", "2",
                            *_overrides(tiny_moe, two), *extra, *layout],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert multi.returncode == 0, multi.stderr[-3000:]
    a, b = _rows(one), _rows(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    return a, b


def test_dp2_ep2_train_matches_one_process(tmp_path, tiny_moe, env):
    a, b = _one_and_two_processes(tmp_path, tiny_moe, env, [], ["parallel.dp=2", "parallel.ep=2"])
    assert any(r["train/grad_norm"] > 0 for r in a)  # the runs really updated the weights
    for ra, rb in zip(a, b):
        for key in COMPARED:
            assert key in ra and key in rb, (ra["step"], key)
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-6), (ra["step"], key, ra[key], rb[key])


def test_pp2_r3_train_matches_one_process(tmp_path, tiny_moe, env):
    """parallel.pp=2 under r3: rank 1 (stage 1) receives its stage's route columns only (megapo.trainer.handout),
    rank 0 all of them; the replayed log-probs, the update and the router metrics rank 0 logs (engine vs learner
    routes of every MoE layer) match the single-process run."""
    a, b = _one_and_two_processes(tmp_path, tiny_moe, env,
                                  ["algorithm.routing_replay=r3", "train.stability_metrics_every=1"], ["parallel.pp=2"])
    routing = [k for k in a[0] if k.startswith(("router/", "mismatch/", "replay/"))]
    assert "router/disagree" in routing and "replay/disagree_post" in routing
    for ra, rb in zip(a, b):
        for key in (*COMPARED, *routing):
            assert key in rb, (ra["step"], key)
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-6), (ra["step"], key, ra[key], rb[key])
