"""Ctrl-C (SIGINT) stops `megapo train` as SIGTERM does: checkpoint after the step in flight, exit 75, and
`--resume` continues at the next step (it used to lose all progress with a KeyboardInterrupt traceback).

- StopFlag level: SIGINT sets the flag instead of raising KeyboardInterrupt, says so on stderr, and a second
  Ctrl-C is ignored (it would kill the checkpoint writer's helpers, which share the terminal's process group).
- End to end: a tiny run gets SIGINT on its whole process group (what a terminal sends) once step 1 is logged;
  expected: exit code 75, a complete checkpoint of the last logged step, no traceback. (Every step saves a
  checkpoint, so the run is still going when the signal comes. That such a checkpoint resumes exactly is
  tests/test_trainer_resume.py's SIGTERM test: the stop after the signal is the same code.)
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "megapo/configs/tiny_moe_addition.yaml"
REWARD = "def parity(response, answer):\n    return float(sum(map(ord, response)) % 2)\n"

FLAG_SCRIPT = r"""
import json, os, signal, time
from megapo.trainer.stop import StopFlag

before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN when started as a background job
flag = StopFlag()
flag.install()
interrupted = False
try:
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again, while the checkpoint would be written
    time.sleep(0.2)
except KeyboardInterrupt:
    interrupted = True
ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
flag.uninstall()
print(json.dumps({"requested": flag.requested, "signals": flag.signals, "interrupted": interrupted,
                  "ignored_after_first": ignored, "restored": signal.getsignal(signal.SIGINT) is before}))
"""


def _env(tmp_path):
    return {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def test_sigint_sets_the_stop_flag_and_a_second_one_is_ignored(tmp_path):
    (tmp_path / "flag.py").write_text(FLAG_SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "flag.py")], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=_env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r == {"requested": True, "signals": [int(signal.SIGINT)], "interrupted": False,
                 "ignored_after_first": True, "restored": True}
    assert proc.stderr.count("SIGINT: stopping after the current step with a checkpoint (exit 75)") == 1


def _cmd(model, out, *extra):
    return [sys.executable, "-m", "megapo.cli", "train", str(CONFIG), f"model.path={model}", "sft.enabled=false",
            f"train.output_dir={out}", "train.steps=3", "train.ckpt_every=1", "train.keep_last=5", "train.eval_every=0",
            "train.log=[jsonl]", "data.prompts_per_step=2", "rollout.n_samples=4", "rollout.max_new_tokens=6",
            "data.dynamic_sampling=false", "data.reward=stop_rewards:parity", "algorithm.routing_replay=off",
            "data.truncated_reward=null", *extra]


def _steps(out):
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


MANY_STEPS = 100_000


def test_ctrl_c_checkpoints_and_exits_75(tmp_path, tiny_moe):
    (tmp_path / "stop_rewards.py").write_text(REWARD)
    env, out = _env(tmp_path), tmp_path / "run"
    # steps the run cannot finish before the signal (a tiny step can take 50 ms: with 3 steps a loaded machine let
    # the test see step 1 only after the last step had begun, and the run ended normally)
    run = subprocess.Popen(_cmd(tiny_moe, out, f"train.steps={MANY_STEPS}"), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)  # its own process group, as a terminal's job
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").is_file() and '"step": 1' in (out / "metrics.jsonl").read_text()):
            assert run.poll() is None, run.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the run never logged step 1"
            time.sleep(0.05)
        os.killpg(run.pid, signal.SIGINT)
        _, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 75, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    stopped_at = max(_steps(out))
    assert stopped_at < MANY_STEPS  # it stopped early ...
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert f"step_{stopped_at:08d}" in saved and not any(n.endswith(".tmp") for n in saved)  # ... with its checkpoint
    state = json.loads((out / "checkpoints" / f"step_{stopped_at:08d}" / "trainer_state.json").read_text())
    assert state["step"] == stopped_at and state["weight_version"] == stopped_at  # every logged step was trained


CHILD = "import sys; print('ready', flush=True); sys.stdin.readline(); print('alive', flush=True)"


def _child_after_sigterm(hold: bool) -> tuple[str, int]:
    """Start a child (inside signals_held when `hold`), SIGTERM it once it is up, then ask it to answer."""
    from megapo.trainer.stop import signals_held

    with signals_held() if hold else contextlib.nullcontext():
        child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate("go\n", timeout=60)
    except BrokenPipeError:  # it died before reading
        out = ""
        child.wait(60)
    return out.strip(), child.returncode


def test_a_process_started_while_signals_are_held_survives_a_stop_signal():
    """A helper a checkpoint save starts (Megatron's writer spawns one) while a stop signal is on its way: started
    inside signals_held it keeps SIGTERM blocked and answers; started outside, SIGTERM ends it (the control)."""
    assert _child_after_sigterm(hold=True) == ("alive", 0)
    assert _child_after_sigterm(hold=False)[1] == -signal.SIGTERM


def test_signals_held_restores_the_mask():
    from megapo.trainer.stop import signals_held

    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with signals_held():
        assert signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
