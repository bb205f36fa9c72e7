"""`megapo launch`: start a run on this machine (torchrun) or on a Slurm cluster (sbatch).

    megapo launch local CONFIG [--nproc N] [--resume] [--dry-run] [overrides...]
    megapo launch slurm CONFIG --nodes N [--gpus-per-node G] [--rollout-nodes M] [--partition P]
                        [--time T] [--dry-run] [overrides...]

Both check the parallel layout against the processes they will start and the model's
config.json before anything starts; `--dry-run` prints the command / sbatch script instead.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from megapo.config import ConfigError
from megapo.launch import local, slurm

SUBCOMMAND = "where"  # megapo.cli names it in error messages: `megapo launch local: ...`


class _IntermixedParser(argparse.ArgumentParser):
    """Lets overrides and options mix (`CONFIG --nodes 2 a.b=1 --dry-run c.d=2`).

    Plain parse_args binds an optional positional list at its first chance and then rejects
    overrides that come after an option.
    """

    _intermixed = False

    def parse_known_args(self, args=None, namespace=None):
        if self._intermixed:
            return super().parse_known_args(args, namespace)
        self._intermixed = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixed = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="where", metavar="WHERE", required=True, parser_class=_IntermixedParser)

    local = sub.add_parser("local", help="run on this machine with torchrun")
    _common(local)
    local.add_argument("--nproc", type=int, default=None, help="processes (default: tp*pp*dp of the config)")
    local.add_argument("--gpu", default=None, choices=("h100", "h200", "b200"),
                       help="check the layout against this GPU kind's memory (`megapo plan`); default: no check")
    start = local.add_mutually_exclusive_group()  # passed to `megapo train` (its run-folder rules)
    start.add_argument("--resume", action="store_true", help="continue from the last checkpoint in train.output_dir")
    start.add_argument("--overwrite", action="store_true",
                       help="start over in a used train.output_dir (megapo train --overwrite)")

    s = sub.add_parser("slurm", help="submit an sbatch job (colocated, or disaggregated with --rollout-nodes)")
    _common(s)
    s.add_argument("--nodes", type=int, required=True, help="nodes in all (learner + rollout)")
    s.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (0: CPU run, needs --procs-per-node)")
    s.add_argument("--procs-per-node", type=int, default=None, help="learner processes per node (default: GPUs)")
    s.add_argument("--rollout-nodes", type=int, default=0, help="nodes that only run engine servers (disaggregated)")
    s.add_argument("--gpu", default="h100", choices=("h100", "h200", "b200"),
                   help="the GPU kind: the layout must fit its memory (`megapo plan` prints the table)")
    s.add_argument("--partition", default=None)
    s.add_argument("--time", default=None, help="time limit, Slurm syntax (e.g. 2-00:00:00)")
    s.add_argument("--job-name", default="megapo")
    s.add_argument("--cpus-per-node", type=int, default=None, help="CPUs per node (default: the whole node)")
    s.add_argument("--mem", default=None, help="memory per node, Slurm syntax (e.g. 400G)")
    s.add_argument("--grace", type=int, default=180, help="seconds the trainer gets to checkpoint after SIGTERM")
    s.add_argument("--engine-port", type=int, default=30000, help="port of the engine servers (disaggregated)")
    s.add_argument(
        "--sbatch-arg", action="append", default=[], metavar="--KEY=VALUE", help="extra #SBATCH line (repeatable)"
    )


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG", help="run config YAML (as for `megapo train`)")
    p.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="dotted overrides, e.g. parallel.tp=2")
    p.add_argument("--dry-run", action="store_true", help="check and print, start nothing")
    p.add_argument(
        "--entry-script",
        default=None,
        help="script taking megapo's `train`/`serve` subcommands, run instead of `python -m megapo.cli` "
        "(to test the launch with a stand-in)",
    )


def run(args: argparse.Namespace) -> int:
    return _run_local(args) if args.where == "local" else _run_slurm(args)


def _run_slurm(args: argparse.Namespace) -> int:
    job = slurm.SlurmJob(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        procs_per_node=args.procs_per_node,
        rollout_nodes=args.rollout_nodes,
        partition=args.partition,
        time=args.time,
        job_name=args.job_name,
        cpus_per_node=args.cpus_per_node,
        mem=args.mem,
        sbatch_args=args.sbatch_arg,
        grace_s=args.grace,
        engine_port=args.engine_port,
        entry_script=args.entry_script,
        gpu=args.gpu,
    )
    job.validate()  # the cheap checks first, before reading the model
    run_spec = slurm.read_run(args.config, args.overrides)
    script = slurm.render(run_spec, job)
    if args.dry_run:
        print(script, end="")
        return 0
    job_id = slurm.submit(script, run_spec, job)
    print(f"submitted job {job_id} ({slurm.template_name(job)}, {job.nodes} nodes)")
    print(f"logs: {run_spec.output_dir}/logs/slurm-{job_id}.out and {run_spec.output_dir}/logs/slurm-{job_id}/")
    return 0


def local_command(run_spec: slurm.RunSpec, nproc: int, resume: bool, entry_script: str | None,
                  overwrite: bool = False, gpu: str | None = None) -> list[str]:
    """The torchrun command line for `nproc` processes on this machine (checks the layout first)."""
    extra = slurm.resolve_layout(run_spec, nproc, f"--nproc {nproc}")
    if gpu is not None:  # the layout against one GPU's memory (megapo plan)
        from megapo.launch.plan import plan_run

        plan_run(run_spec, run_spec.data, nproc, gpu)
    if entry_script is None:
        slurm.check_trainer_config(run_spec, extra)
    entry = [str(Path(entry_script).resolve()), "train"] if entry_script else ["-m", "megapo.cli", "train"]
    torchrun_opts = ["--shutdown-timeout=180"] if slurm.torchrun_has("--shutdown-timeout") else []
    start = ["--resume"] * resume + ["--overwrite"] * overwrite
    args = [*entry, *start, str(run_spec.config_path), *run_spec.overrides, *extra]
    return local.torchrun_command([*torchrun_opts, *args], nproc)


def _run_local(args: argparse.Namespace) -> int:
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError("--nproc", f"must be >= 1, got {args.nproc}")
    if args.entry_script is not None and not Path(args.entry_script).is_file():
        raise ConfigError("--entry-script", f"{args.entry_script} does not exist")
    run_spec = slurm.read_run(args.config, args.overrides)
    p = run_spec.parallel
    nproc = args.nproc if args.nproc is not None else p.tp * p.pp * (p.dp if run_spec.dp_given else 1)
    cmd = local_command(run_spec, nproc, args.resume, args.entry_script, overwrite=args.overwrite, gpu=args.gpu)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    # SIGTERM reaches torchrun once (the trainer checkpoints); a failed rank's line ends the output (WorkersFailed)
    return local.run_launch(cmd, nproc)
