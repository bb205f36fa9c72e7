"""Slurm launch: check a run's layout against the allocation, render an sbatch script, submit it.

    run = read_run("run.yaml", ["parallel.tp=2"])
    job = SlurmJob(nodes=4, gpus_per_node=8, rollout_nodes=1)
    script = render(run, job)         # raises ConfigError/LayoutError before anything is submitted
    job_id = submit(script, run, job)

The launcher reads the sections it needs (`model`, `parallel`, `rollout`, `train.output_dir`) as plain
YAML plus dotted overrides; in addition the trainer's own check of the whole config (RunConfig)
runs before submission, unless an --entry-script (a test stand-in) replaces the trainer; before it, the
memory planner (megapo/launch/plan.py) checks that the layout fits one GPU of kind SlurmJob.gpu. The templates are slurm/colocated.sbatch and slurm/disaggregated.sbatch (plus slurm/common.sh,
pasted into both); slurm/README.md describes the flow and the trainer's signal contract.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megapo.config import ConfigError, ParallelConfig, apply_override, from_dict, load_config
from megapo.layout import LayoutError, check_layout, read_hf_config
# The trainer's side of the contract (slurm/README.md): on SIGTERM it saves a checkpoint under
# <train.output_dir>/<megapo.trainer.run_dir.CHECKPOINTS> and exits with EXIT_CHECKPOINTED (EX_TEMPFAIL, "try again").
from megapo.trainer.stop import EXIT_CHECKPOINTED

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "slurm"
_PLACEHOLDER = re.compile(r"\{\{([A-Z_]+)\}\}")
# Slurm --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2})$")


@dataclass
class RunSpec:
    """What the launcher needs to know about a run, read from its YAML config plus overrides."""

    config_path: Path  # absolute
    overrides: list[str]  # as given, passed on unchanged to every rank
    model_path: Path
    output_dir: Path  # absolute
    parallel: ParallelConfig
    dp_given: bool  # False: dp is inferred from the world size (and passed on as an override)
    hf_config: dict[str, Any]
    rollout: dict[str, Any]  # the config's rollout section, as plain data
    data: dict[str, Any] = field(default_factory=dict)  # the whole config with the overrides, as plain data


@dataclass
class SlurmJob:
    """The allocation and how processes are laid out on it."""

    nodes: int
    gpus_per_node: int = 8
    procs_per_node: int | None = None  # learner processes per node; default gpus_per_node
    rollout_nodes: int = 0  # > 0: disaggregated, the last M nodes run engine servers
    partition: str | None = None
    time: str | None = None
    job_name: str = "megapo"
    cpus_per_node: int | None = None
    mem: str | None = None  # per node, Slurm syntax (e.g. 400G); None: the partition's default
    sbatch_args: list[str] = field(default_factory=list)  # extra "--key=value" #SBATCH lines
    grace_s: int = 180  # seconds the trainer has to checkpoint after SIGTERM
    engine_port: int = 30000
    engine_start_timeout_s: int = 1800
    entry_script: str | None = None  # run "SCRIPT train|serve" instead of "python -m megapo.cli ..."
    python: str = field(default_factory=lambda: sys.executable)
    gpu: str = "h100"  # the GPU kind whose memory the layout must fit (megapo/launch/plan.py)

    @property
    def procs(self) -> int:
        return self.procs_per_node if self.procs_per_node is not None else self.gpus_per_node

    @property
    def learner_nodes(self) -> int:
        return self.nodes - self.rollout_nodes

    @property
    def world_size(self) -> int:
        return self.learner_nodes * self.procs

    def validate(self) -> None:
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise ConfigError("--nodes", f"must be >= 1, got {self.nodes!r}")
        if self.gpus_per_node < 0:
            raise ConfigError("--gpus-per-node", f"must be >= 0, got {self.gpus_per_node}")
        if self.procs_per_node is None and self.gpus_per_node == 0:
            raise ConfigError("--procs-per-node", "is required with --gpus-per-node 0 (CPU processes per node)")
        if self.procs < 1:
            raise ConfigError("--procs-per-node", f"must be >= 1, got {self.procs}")
        if self.gpus_per_node and self.procs > self.gpus_per_node:
            raise ConfigError(
                "--procs-per-node", f"{self.procs} processes per node but only {self.gpus_per_node} GPUs per node"
            )
        if self.rollout_nodes < 0:
            raise ConfigError("--rollout-nodes", f"must be >= 0, got {self.rollout_nodes}")
        if self.rollout_nodes >= self.nodes:
            raise ConfigError(
                "--rollout-nodes",
                f"{self.rollout_nodes} rollout nodes leave no learner node out of --nodes {self.nodes} "
                f"(--nodes counts learner and rollout nodes together)",
            )
        if self.time is not None and not _TIME.match(self.time):
            raise ConfigError("--time", f"{self.time!r} is not a Slurm time (M, H:M:S, D-H:M:S, ...)")
        if self.partition is not None and not re.fullmatch(r"[\w.,-]+", self.partition):
            raise ConfigError("--partition", f"{self.partition!r} is not a partition name")
        if not re.fullmatch(r"[\w.-]+", self.job_name):
            raise ConfigError("--job-name", f"{self.job_name!r}: use letters, digits, '.', '_', '-'")
        for arg in self.sbatch_args:
            if not arg.startswith("--") or "\n" in arg:
                raise ConfigError("--sbatch-arg", f"{arg!r} must be one long option like --account=abc")
        if self.grace_s < 1:
            raise ConfigError("--grace", f"must be >= 1 second, got {self.grace_s}")
        if not 1 <= self.engine_port <= 65535:
            raise ConfigError("--engine-port", f"must be a TCP port, got {self.engine_port}")
        if self.entry_script is not None and not Path(self.entry_script).is_file():
            raise ConfigError("--entry-script", f"{self.entry_script} does not exist")


# ----------------------------------------------------------------------------- reading the run


def read_run(config_path: str | Path, overrides: list[str] | None = None) -> RunSpec:
    """Parse the run config's launcher-relevant sections; ConfigError/LayoutError name the field."""
    path = Path(config_path)
    if not path.is_file():
        raise ConfigError("CONFIG", f"config file {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError("CONFIG", f"{path} must hold a mapping at the top level")
    overrides = list(overrides or [])
    for item in overrides:
        apply_override(data, item)

    model = _section(data, "model")
    if not model.get("path"):
        raise ConfigError("model.path", "is required (the HF model folder with config.json)")
    model_path = Path(str(model["path"])).expanduser()
    if (model_path / "config.json").is_file():
        hf = read_hf_config(model_path)
    elif model.get("tiny") is not None:  # the trainer writes this tiny model first: check its shape
        from megapo.trainer.config import TinyModelConfig, tiny_hf_config

        hf = tiny_hf_config(from_dict(TinyModelConfig, model["tiny"] or {}, "model.tiny"))
    elif not model_path.is_dir():
        raise LayoutError("model.path", f"model folder {model_path} does not exist")
    else:
        raise LayoutError("model.path", f"no config.json in {model_path}")

    parallel_data = _section(data, "parallel")
    parallel = from_dict(ParallelConfig, parallel_data, "parallel")

    train = _section(data, "train")
    if not train.get("output_dir"):
        raise ConfigError("train.output_dir", "is required (checkpoints and logs go there)")
    output_dir = Path(str(train["output_dir"])).expanduser().resolve()

    return RunSpec(
        config_path=path.resolve(),
        overrides=overrides,
        model_path=model_path,
        output_dir=output_dir,
        parallel=parallel,
        dp_given="dp" in parallel_data,
        hf_config=hf,
        rollout=_section(data, "rollout"),
        data=data,
    )


def _section(data: dict, name: str) -> dict:
    value = data.get(name) or {}
    if not isinstance(value, dict):
        raise ConfigError(name, f"must be a mapping, got {value!r}")
    return value


def resolve_layout(run: RunSpec, world_size: int, where: str) -> list[str]:
    """Check run.parallel against the model and `world_size` processes; return extra overrides.

    Without `parallel.dp` in the config, dp is world_size / (tp * pp) and is passed on to the
    ranks as `parallel.dp=K`, so the trainer sees the same layout the launcher checked.
    """
    p = run.parallel
    extra: list[str] = []
    if not run.dp_given:
        if world_size % (p.tp * p.pp):
            raise LayoutError(
                "parallel",
                f"{where} gives {world_size} learner processes, not a multiple of tp*pp = {p.tp}*{p.pp} = {p.tp * p.pp}",
            )
        p = dataclasses.replace(p, dp=world_size // (p.tp * p.pp))
        extra.append(f"parallel.dp={p.dp}")
    check_layout(p, run.hf_config)  # heads, layers, experts
    if world_size != p.world_size:
        raise LayoutError(
            "parallel",
            f"{where} gives {world_size} learner processes but tp*pp*dp = {p.tp}*{p.pp}*{p.dp} = {p.world_size}",
        )
    return extra


def check_trainer_config(run: RunSpec, extra_overrides: list[str]) -> None:
    """The trainer's own checks of every section, so a typo fails here and not after the queue wait.

    Skipped when an --entry-script replaces the trainer (it has its own config)."""
    from megapo.trainer.config import RunConfig  # imports torch: only when a real run is launched

    load_config(RunConfig, run.config_path, run.overrides + extra_overrides)


# ----------------------------------------------------------------------------- rendering


def template_name(job: SlurmJob) -> str:
    return "disaggregated.sbatch" if job.rollout_nodes else "colocated.sbatch"


def render(run: RunSpec, job: SlurmJob) -> str:
    """The sbatch script for `run` on `job`; validates everything first."""
    job.validate()
    if " " in str(run.output_dir) or "%" in str(run.output_dir):
        # #SBATCH lines are not shell-parsed, and % starts a Slurm filename pattern
        raise ConfigError("train.output_dir", f"{run.output_dir}: no spaces or '%' allowed under Slurm")
    if job.rollout_nodes:
        engine = run.rollout.get("engine", "embedded")
        if engine == "embedded":
            raise ConfigError(
                "rollout.engine",
                f"--rollout-nodes {job.rollout_nodes} runs engine servers, but the embedded engine runs inside "
                "the trainer; use a server engine (vllm, sglang) or launch colocated (no --rollout-nodes)",
            )
        for name in ("servers", "api_key_file"):  # the job's engine addresses and its per-job key
            if run.rollout.get(name):
                raise ConfigError(f"rollout.{name}", "is set by the launcher with --rollout-nodes; remove it from "
                                  "the config")
    where = f"{job.learner_nodes} learner node(s) x {job.procs} processes"
    extra_overrides = resolve_layout(run, job.world_size, where)
    if job.gpus_per_node:  # the memory of one GPU against the layout (megapo plan), before the trainer's checks
        from megapo.launch.plan import plan_run

        plan_run(run, run.data, job.world_size, job.gpu, job.rollout_nodes)
    if job.entry_script is None:
        check_trainer_config(run, extra_overrides)

    sbatch_extra = []
    if job.partition:
        sbatch_extra.append(f"--partition={job.partition}")
    if job.time:
        sbatch_extra.append(f"--time={job.time}")
    if job.gpus_per_node:
        sbatch_extra.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.cpus_per_node:
        sbatch_extra.append(f"--cpus-per-task={job.cpus_per_node}")
    if job.mem:
        sbatch_extra.append(f"--mem={job.mem}")
    sbatch_extra += job.sbatch_args

    if job.entry_script:
        script = str(Path(job.entry_script).resolve())
        train_entry, serve_entry = [script, "train"], [script, "serve"]
    else:
        train_entry, serve_entry = ["-m", "megapo.cli", "train"], ["-m", "megapo.cli", "serve"]

    torchrun_extra = []
    if torchrun_has("--shutdown-timeout"):  # recent torch only; older torchrun kills it after 30 s
        torchrun_extra.append(f"--shutdown-timeout={job.grace_s}")

    values = {
        "JOB_NAME": job.job_name,
        "NODES": str(job.nodes),
        "LOG_DIR": str(run.output_dir / "logs"),
        "SIGNAL_LEAD_S": str(job.grace_s + 60),  # time-limit warning: grace plus a minute for requeue
        "SBATCH_EXTRA": "\n".join(f"#SBATCH {a}" for a in sbatch_extra),
        "PYTHON": shlex.quote(job.python),
        "CONFIG": shlex.quote(str(run.config_path)),
        "OUTPUT_DIR": shlex.quote(str(run.output_dir)),
        "CHECKPOINT_SUBDIR": _checkpoint_folder_name(),
        "EXIT_CHECKPOINTED": str(EXIT_CHECKPOINTED),
        "PROCS_PER_NODE": str(job.procs),
        "GPUS_PER_NODE": str(job.gpus_per_node),
        "GRACE_S": str(job.grace_s),
        "LEARNER_NODES": str(job.learner_nodes),
        "ENGINE_PORT": str(job.engine_port),
        "ENGINE_START_TIMEOUT_S": str(job.engine_start_timeout_s),
        "TRAIN_ENTRY": shlex.join(train_entry),
        "SERVE_ENTRY": shlex.join(serve_entry),
        "OVERRIDES": shlex.join(run.overrides + extra_overrides),
        "TORCHRUN_EXTRA": shlex.join(torchrun_extra),
        "COMMON": (TEMPLATE_DIR / "common.sh").read_text().rstrip("\n"),
    }
    text = (TEMPLATE_DIR / template_name(job)).read_text()
    text = _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)
    return text


def torchrun_has(option: str) -> bool:
    """Whether this Python's torchrun knows `option` (read from its source; torch is not imported)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    run_py = Path(list(spec.submodule_search_locations)[0]) / "distributed" / "run.py"
    return run_py.is_file() and f'"{option}"' in run_py.read_text()


# ----------------------------------------------------------------------------- submitting


def submit(script: str, run: RunSpec, job: SlurmJob) -> str:
    """Write the script next to the run's logs and sbatch it; return the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError("slurm", "sbatch not found on PATH (is this a Slurm login node?)")
    log_dir = run.output_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)  # Slurm does not create the --output folder
    path = log_dir / f"{job.job_name}-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    path.write_text(script)
    out = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"sbatch {path} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0]


def _checkpoint_folder_name() -> str:
    from megapo.trainer.run_dir import CHECKPOINTS  # imports torch: only when a script is rendered

    return CHECKPOINTS
