"""`megapo train` end to end in a subprocess: the Megatron learner, the embedded engine, R3 routing replay.

Independent checks: at step 2 the learner's old log-probs (Megatron, replaying the engine's routes)
match the engine's sampling log-probs (plain PyTorch) on the same tokens, which holds only if step 1's
weights reached the engine intact and the routes were replayed; every replayed route was used as given.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_megapo_train_r3_two_steps(tmp_path, tiny_moe):
    (tmp_path / "e2e_parity_reward.py").write_text(
        "def parity(response, answer):\n    return float(sum(map(ord, response)) % 2)\n")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megapo.cli", "train", str(ROOT / "megapo/configs/tiny_moe_addition.yaml"),
           f"model.path={tiny_moe}", "sft.enabled=false", f"train.output_dir={out}", "train.steps=2",
           "train.eval_every=2", "train.eval_prompts=50", "train.ckpt_every=0", "train.log=[jsonl]",
           "data.prompts_per_step=4", "rollout.n_samples=4", "data.dynamic_sampling=false",
           "data.reward=e2e_parity_reward:parity", "data.truncated_reward=null", "algorithm.routing_replay=r3",
           "optim.lr=0.01", "optim.warmup_steps=0"]  # a visible update, so a lost weight sync would show
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert 0 <= rows[0]["eval/accuracy"] <= 1 and "eval/accuracy" in rows[2]
    for r in rows[1:]:
        assert r["train/replay/disagree_post"] == 0.0  # routes used == routes given
        assert r["train/replay/fallback_frac"] == 0.0  # the engine gave a route for every position
        assert 0.0 <= r["reward"] <= 1.0 and r["response_len"] > 0
    # step 2 samples come from the weights step 1 wrote: learner and engine agree token by token
    assert rows[2]["train/mismatch_max_abs_dlogp"] < 1e-3
    assert rows[2]["train/mismatch_k3"] < 1e-6
    # on eval steps the log also holds the mismatch KL with the engine's routes replayed and with free routing
    assert "replay/kl_k3" not in rows[1]
    assert rows[2]["replay/kl_k3"] < 1e-6
    assert 0.0 <= rows[2]["replay/kl_k3_free"] < float("inf")
    assert (out / "checkpoints" / "step_00000002" / "trainer_state.json").is_file()
    assert json.loads((out / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())["weight_version"] == 2
