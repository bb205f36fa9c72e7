"""`megapo launch slurm` on a real Slurm: the local test cluster of .ci/slurm_up.sh (nodes n1, n2
on 127.0.0.1). Most jobs are tests/slurm_standin.py, which keeps the trainer's launch contract
(slurm/README.md): ranks under torchrun (gloo), checkpoint on SIGTERM and exit, resume with --resume.
The last test runs the real tiny `megapo train` job through the same stop / requeue / resume path.

These tests fail (never skip) when the cluster is not up: run .ci/slurm_up.sh first.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from megapo.trainer.stop import EXIT_CHECKPOINTED
from megapo.cli import main
from megapo.net import free_port

REPO = Path(__file__).resolve().parents[1]
STANDIN = REPO / "tests" / "slurm_standin.py"


def _cluster_problem() -> str | None:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "the Slurm client (sbatch, sinfo) is not installed"
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %T"], capture_output=True, text=True,
                             timeout=15)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 15 s (slurmctld down?)"
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()}"
    usable = [line.split()[0] for line in out.stdout.splitlines() if line.split()[1].rstrip("*") in ("idle", "mixed")]
    if len(usable) < 2:
        return f"partition 'debug' needs 2 idle nodes, sinfo shows: {out.stdout.strip() or 'nothing'}"
    return None


@pytest.fixture(scope="module")
def cluster():
    problem = _cluster_problem()
    if problem:
        pytest.fail(f"Slurm test cluster not usable ({problem}). Start it with .ci/slurm_up.sh (as root).")


@pytest.fixture
def jobs():
    """Job ids submitted by a test; whatever still runs at its end is cancelled."""
    submitted: list[str] = []
    yield submitted
    for job in submitted:
        subprocess.run(["scancel", job], capture_output=True)


# ----------------------------------------------------------------------------- helpers


def submit(tmp_path: Path, capsys, jobs: list, *, train: dict, cli: list, rollout: dict | None = None) -> tuple[str, Path]:
    out_dir = tmp_path / "out"
    cfg = {"model": {"path": str(tmp_path / "model")}, "train": {"output_dir": str(out_dir), **train}}
    if rollout:
        cfg["rollout"] = rollout
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    argv = ["launch", "slurm", str(config), "--gpus-per-node", "0", "--partition", "debug",
            "--entry-script", str(STANDIN), "--grace", "30", *map(str, cli)]
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, err
    job = re.search(r"submitted job (\d+)", out).group(1)
    jobs.append(job)
    return job, out_dir


def job_info(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def wait_for(condition, timeout: float, what: str, job: str, out_dir: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.3)
    log = out_dir / "logs" / f"slurm-{job}.out"
    pytest.fail(f"timed out after {timeout} s waiting for {what}; job: {job_info(job)}\n"
                f"batch log:\n{log.read_text() if log.exists() else '(none)'}")


def wait_done(job: str, out_dir: Path, timeout: float = 120) -> dict:
    def done():
        info = job_info(job)
        return info if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") else None
    return wait_for(done, timeout, "the job to end", job, out_dir)


def progress(out_dir: Path) -> int:
    try:
        return int((out_dir / "progress").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def runs(out_dir: Path) -> list[dict]:
    path = out_dir / "runs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def hostnames(nodelist: str) -> list[str]:
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True).stdout.split()


def node_addr(node: str) -> str:
    out = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True).stdout
    return re.search(r"NodeAddr=(\S+)", out).group(1)


@pytest.fixture
def model(tmp_path, tiny_moe):
    link = tmp_path / "model"
    link.symlink_to(tiny_moe)
    return link


# ----------------------------------------------------------------------------- tests


def test_colocated_job_runs_every_rank_and_resumes_an_existing_checkpoint(cluster, model, tmp_path, capsys, jobs):
    """A resubmission into an output dir that holds a checkpoint continues from it (--resume)."""
    checkpoint = tmp_path / "out" / "checkpoints" / "latest.json"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_text(json.dumps({"step": 2}))
    job, out_dir = submit(tmp_path, capsys, jobs, train={"steps": 4, "step_seconds": 0.05},
                          cli=["--nodes", 2, "--procs-per-node", 2])
    info = wait_done(job, out_dir)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0")
    nodes = hostnames(info["NodeList"])
    [record] = runs(out_dir)
    # torchrun's static rendezvous: node rank i holds global ranks 2i, 2i+1
    assert record["rank_nodes"] == [nodes[0], nodes[0], nodes[1], nodes[1]]
    assert record["world_size"] == 4 and record["overrides"] == ["parallel.dp=4"]
    assert (record["resume_flag"], record["start"], record["end"], record["exit"]) == (True, 2, 4, 0)
    for i in range(2):
        log = (out_dir / "logs" / f"slurm-{job}" / "run0" / f"learner-node{i}.log").read_text()
        assert f"[node {i} {nodes[i]}]" in log and "exit 0" in log


def test_disaggregated_learner_reaches_engine_on_rollout_node(cluster, model, tmp_path, capsys, jobs):
    port = free_port()
    job, out_dir = submit(tmp_path, capsys, jobs, train={"steps": 2, "step_seconds": 0.05},
                          rollout={"engine": "vllm"},
                          cli=["--nodes", 2, "--rollout-nodes", 1, "--procs-per-node", 2, "--engine-port", port])
    info = wait_done(job, out_dir)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0")
    learner_node, rollout_node = hostnames(info["NodeList"])
    [record] = runs(out_dir)
    assert record["rank_nodes"] == [learner_node, learner_node]
    server = f"{node_addr(rollout_node)}:{port}"
    key_file = out_dir / "logs" / f"slurm-{job}" / "run0" / "engine-api-key"
    assert record["overrides"] == ["parallel.dp=2", f'rollout.servers=["{server}"]',
                                   f"rollout.api_key_file={key_file}", f"rollout.sync_host={node_addr(learner_node)}"]
    # the engine got the same per-run key file, readable by this user only
    assert record["servers"] == [{"server": server, "node": rollout_node, "port": port, "api_key_file": str(key_file)}]
    assert key_file.stat().st_mode & 0o777 == 0o600 and len(key_file.read_text()) == 64
    engine_log = (out_dir / "logs" / f"slurm-{job}" / "run0" / "engine-node0.log").read_text()
    assert "GET /health" in engine_log and "got SIGTERM" in engine_log  # stopped gently at the end


def test_crash_on_one_node_fails_the_job_without_requeue(cluster, model, tmp_path, capsys, jobs):
    """Rank 1 (node 1) fails; Slurm then stops node 0 (--kill-on-bad-exit) with SIGTERM, which must
    not be mistaken for a checkpoint-and-requeue: the job fails once and is not requeued."""
    job, out_dir = submit(tmp_path, capsys, jobs, train={"steps": 1000, "step_seconds": 0.05, "crash_rank": 1,
                                                          "crash_step": 3},
                          cli=["--nodes", 2, "--procs-per-node", 1])
    info = wait_done(job, out_dir)
    log = out_dir / "logs" / f"slurm-{job}.out"
    wait_for(lambda: "learner exit" in log.read_text(), 30, "the batch script to end", job, out_dir)
    info = job_info(job)
    assert (info["JobState"], info["Restarts"]) == ("FAILED", "0"), info
    assert "a learner node failed (exit 1): not requeueing" in log.read_text()  # the script did not requeue
    status = out_dir / "logs" / f"slurm-{job}" / "run0" / "status.learner.node1"
    assert status.read_text().split()[0] == "exit" and status.read_text().split()[1] != "0"


def test_stopped_job_checkpoints_requeues_resumes_and_cancel_is_final(cluster, model, tmp_path, capsys, jobs):
    """Each way a run is stopped, one after the other on one job. The stand-in checkpoints on
    SIGTERM every time; the first three bring the job back, resuming where it stopped:
      run 0: `scancel --signal=TERM JOB` (SIGTERM to the steps)      -> the batch script requeues
      run 1: preemption by a job in the higher-priority partition    -> Slurm requeues
      run 2: `scancel --batch --signal=USR1` (the time-limit warning) -> the batch script requeues
      run 3: plain `scancel`                                          -> checkpoint, stays cancelled
    """
    job, out_dir = submit(tmp_path, capsys, jobs, train={"steps": 1000, "step_seconds": 0.1},
                          cli=["--nodes", 2, "--procs-per-node", 1])
    preempt = ["sbatch", "--parsable", "-p", "urgent", "-N", "2", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 1"]
    stops = [["scancel", "--signal=TERM", job], preempt, ["scancel", "--batch", "--signal=USR1", job], ["scancel", job]]
    ends = []
    for restart, stop in enumerate(stops):
        start = ends[-1] if ends else 0
        wait_for(lambda: progress(out_dir) >= start + 2, 120, f"run {restart} to make progress", job, out_dir)
        assert job_info(job)["Restarts"] == str(restart)
        out = subprocess.run(stop, check=True, capture_output=True, text=True)
        if stop is preempt:
            jobs.append(out.stdout.strip())
        wait_for(lambda: len(runs(out_dir)) == restart + 1, 60, f"run {restart} to checkpoint", job, out_dir)
        ends.append(runs(out_dir)[-1]["end"])

    info = wait_done(job, out_dir)
    log = out_dir / "logs" / f"slurm-{job}.out"
    wait_for(lambda: "learner exit" in log.read_text().split(f"job {job} restart 3")[-1], 30,
             "the batch script to end", job, out_dir)
    info = job_info(job)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "3")
    last_run = log.read_text().split(f"job {job} restart 3")[-1]
    assert "Slurm decides" in last_run and "requeueing" not in last_run  # the script did not requeue

    records = runs(out_dir)
    assert [r["restart"] for r in records] == [0, 1, 2, 3]
    assert [r["resume_flag"] for r in records] == [False, True, True, True]
    assert [r["start"] for r in records] == [0, *ends[:-1]]  # each run starts where the last one stopped
    assert [r["exit"] for r in records] == [EXIT_CHECKPOINTED] * 4
    assert all(a < b for a, b in zip([0, *ends], ends)), ends
    assert json.loads((out_dir / "checkpoints" / "latest.json").read_text()) == {"step": ends[-1]}


TRAINER_JOB_STEPS = 30  # the stop lands mid-run: a fresh-clone run had done 5 of 6 tiny steps when SIGTERM came


def test_real_trainer_job_is_stopped_requeued_and_resumes_from_its_checkpoint(cluster, model, tmp_path, capsys, jobs):
    """The tiny main job itself (`megapo train`, Megatron learner, embedded engine) under sbatch:
    SIGTERM once step 2 is logged -> checkpoint after the current step -> requeue -> the rerun resumes at the next
    step and completes."""
    cfg = yaml.safe_load((REPO / "megapo" / "configs" / "tiny_moe_addition.yaml").read_text())
    out_dir = tmp_path / "out"
    cfg["model"] = {"path": str(model)}
    cfg["sft"]["enabled"] = False
    cfg["data"].update(prompts_per_step=4, dynamic_sampling=False)
    cfg["rollout"]["n_samples"] = 4
    cfg["train"].update(steps=TRAINER_JOB_STEPS, eval_every=0, ckpt_every=100, keep_last=2, output_dir=str(out_dir),
                        log=["jsonl"])
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    rc = main(["launch", "slurm", str(config), "--gpus-per-node", "0", "--procs-per-node", "1", "--nodes", "1",
               "--partition", "debug", "--grace", "60"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    job = re.search(r"submitted job (\d+)", out).group(1)
    jobs.append(job)

    def steps_logged() -> list[int]:
        path = out_dir / "metrics.jsonl"
        return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []

    wait_for(lambda: 2 in steps_logged(), 240, "step 2 of the first run", job, out_dir)
    subprocess.run(["scancel", "--signal=TERM", job], check=True)
    info = wait_done(job, out_dir, timeout=300)
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), info
    steps = steps_logged()
    # every step was trained and logged exactly once: the rerun started after the checkpoint of the stop
    assert sorted(steps) == list(range(1, TRAINER_JOB_STEPS + 1)), steps
    assert (out_dir / "checkpoints" / f"step_{TRAINER_JOB_STEPS:08d}" / "trainer_state.json").is_file()
    log = (out_dir / "logs" / f"slurm-{job}.out").read_text()
    assert "requeue" in log.lower()
