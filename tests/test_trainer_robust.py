"""The trainer survives bad numbers and does not hang on a dead peer.

- A NaN loss (here: the objective's loss times NaN, through the learner's loss_fn hook) skips the optimizer step: every weight, the LR schedule and
  the learner's step counter stay as they were, and the step reports `skipped_nonfinite: 1`; the next
  finite step updates normally (reference: the weights before the step, compared tensor by tensor).
- A collective whose peer never arrives ends with a timeout error and a non-zero exit of the whole
  torchrun group instead of hanging (2 gloo processes, rank 1 asleep, 5 s process-group timeout).
Both run in subprocesses so torch.distributed state does not leak into other tests.
"""

import json
import subprocess
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NAN_SCRIPT = r"""
import json, math, sys
import torch
from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner

poison = {"on": False}

def loss_fn(*args, **kwargs):  # policy_loss, made NaN while poison is on (as a diverged loss would be)
    from megapo.algorithms import policy_loss
    loss, metrics = policy_loss(*args, **kwargs)
    return (loss * float("nan") if poison["on"] else loss), metrics

if __name__ == "__main__":
    learner = Learner(sys.argv[1], ParallelConfig(), OptimConfig(lr=0.01, warmup_steps=0), total_steps=4,
                      loss_fn=loss_fn)
    def sample(adv):
        tokens = [5, 6, 7, 8, 9, 10]
        return {"tokens": tokens, "prompt_len": 3, "advantage": adv, "old_logp": [-6.0] * 3,
                "rollout_logp": [-6.0] * 3}
    def weights():
        return {n: p.detach().clone() for n, p in learner.module.named_parameters()}
    before, sched_before = weights(), learner.scheduler.num_steps
    poison["on"] = True
    bad = learner.train_step([sample(-1.0), sample(1.0)], "ppo")
    poison["on"] = False
    after_bad, sched_after_bad = weights(), learner.scheduler.num_steps
    good = learner.train_step([sample(1.0), sample(-1.0)], "ppo")
    after_good = weights()
    print(json.dumps({
        "bad_loss_finite": math.isfinite(bad["loss"]), "bad_skipped": bad["skipped_nonfinite"],
        "bad_changed": sum(not torch.equal(before[n], after_bad[n]) for n in before),
        "good_skipped": good["skipped_nonfinite"], "good_changed": sum(not torch.equal(after_bad[n], after_good[n]) for n in before),
        "params": len(before), "step_after_bad_then_good": learner.step, "sched_moved": sched_after_bad != sched_before,
        "any_nonfinite_weight": any(not torch.isfinite(p).all() for p in after_good.values())}))
"""

HANG_SCRIPT = r"""
import os, sys, time
import torch
from megapo.config import ParallelConfig
from megapo.learner import model as model_lib
from megapo.trainer.stop import StopFlag

if __name__ == "__main__":
    # start together (a file per rank), so the 5 s timeout cannot already fire in init on import skew
    sync = sys.argv[1]
    open(os.path.join(sync, os.environ["RANK"]), "w").close()
    while len(os.listdir(sync)) < 2:
        time.sleep(0.05)
    model_lib.init_distributed(ParallelConfig(dp=2), model_lib.detect_backend(), 0, timeout_s=5)
    torch.distributed.barrier()
    print(f"rank {torch.distributed.get_rank()} initialised", flush=True)
    if torch.distributed.get_rank() == 1:
        time.sleep(3600)  # a dead peer: never joins the next collective
    StopFlag().agreed()  # the trainer's per-step all-reduce
    print("rank 0 passed the collective")
"""


def test_nan_loss_skips_the_update(tmp_path, tiny_dense):
    (tmp_path / "nan_step.py").write_text(NAN_SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "nan_step.py"), str(tiny_dense)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["bad_loss_finite"] is False and r["bad_skipped"] == 1
    assert r["bad_changed"] == 0 and not r["sched_moved"]  # not one weight moved, nor the LR schedule
    assert r["good_skipped"] == 0 and r["good_changed"] > 0 and not r["any_nonfinite_weight"]
    assert r["step_after_bad_then_good"] == 1  # only the finite step counted


def test_hung_collective_times_out(tmp_path):
    from megapo.launch.local import torchrun_command

    (tmp_path / "hang.py").write_text(HANG_SCRIPT)
    start = time.monotonic()
    (tmp_path / "sync").mkdir()
    proc = subprocess.run(torchrun_command([str(tmp_path / "hang.py"), str(tmp_path / "sync")], 2), cwd=ROOT, capture_output=True,
                          text=True, timeout=240,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert "rank 0 initialised" in proc.stdout and "rank 1 initialised" in proc.stdout  # it hung later, not in init
    assert "rank 0 passed" not in proc.stdout
    assert "timed out" in proc.stderr.lower() or "timeout" in proc.stderr.lower(), proc.stderr[-3000:]
    assert time.monotonic() - start < 200  # bounded by the 5 s timeout plus start-up, not by the sleep


REPEATED_STOP_SCRIPT = r"""
import json, multiprocessing, os, signal, time
from megapo.trainer.stop import StopFlag

if __name__ == "__main__":
    flag = StopFlag()
    flag.install()
    os.kill(os.getpid(), signal.SIGTERM)  # Slurm's: a stop request
    time.sleep(0.2)
    # the save starts a helper as Megatron's checkpoint writer does (a spawned multiprocessing Manager) ...
    queue = multiprocessing.get_context("spawn").Manager().Queue()
    os.killpg(0, signal.SIGTERM)  # ... and torchrun's SIGTERM to the worker's whole process group arrives
    time.sleep(0.5)
    try:
        queue.put("written")
        helper = queue.get(timeout=10)
    except Exception as exc:  # the helper died: the save would fail here
        helper = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"requested": flag.requested, "signals": flag.signals, "helper": helper}))
"""


def test_a_repeated_stop_signal_does_not_kill_the_saves_helpers(tmp_path):
    """After the first SIGTERM the trainer checkpoints; a second SIGTERM to the process group (torchrun does
    that) must not kill the helper process the checkpoint writer starts (seen in CI: EOFError in the save, no
    checkpoint, the requeued run started over at step 1)."""
    (tmp_path / "stop.py").write_text(REPEATED_STOP_SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "stop.py")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, start_new_session=True,  # its own process group: killpg stays inside
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["helper"] == "written", r["helper"]
    assert r["requested"] and r["signals"] == [signal.SIGTERM]  # the second one was ignored


AGREE_SCRIPT = r"""
import json, os, sys
from datetime import timedelta
import torch
from megapo.trainer.stop import StopFlag

if __name__ == "__main__":
    torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = torch.distributed.get_rank()
    asked, quiet = StopFlag(), StopFlag()
    asked.requested = rank == 1  # only rank 1 got the signal
    row = {"rank": rank, "asked": asked.agreed(), "quiet": quiet.agreed()}
    # one file per rank: two ranks printing to one pipe can share a line
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    torch.distributed.destroy_process_group()
"""


def test_a_stop_on_one_rank_is_agreed_by_every_rank(tmp_path):
    """StopFlag.agreed over 2 gloo ranks (megapo.dist.any_rank): a stop only rank 1 was asked for is True on both
    ranks; no stop anywhere is False on both."""
    from megapo.launch.local import torchrun_command

    (tmp_path / "agree.py").write_text(AGREE_SCRIPT)
    proc = subprocess.run(torchrun_command([str(tmp_path / "agree.py"), str(tmp_path)], 2), cwd=ROOT, capture_output=True,
                          text=True, timeout=240,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert rows == [{"rank": 0, "asked": True, "quiet": False}, {"rank": 1, "asked": True, "quiet": False}]
