"""The `megapo` console script.

Each subcommand is a module of megapo/commands/ (library packages import no command code); this file only
lists them. A command
module exposes `add_arguments(parser)` and `run(args) -> int`, and is imported only when its
command runs, so `megapo objectives` does not pay for importing Megatron. A ConfigError a command
raises (bad config field, input file, layout) ends as `megapo <command>: <message>` and exit code 2
(`report_errors`; commands do not catch their own). A module whose command has subcommands names their
argparse dest in `SUBCOMMAND`, so the message says which one (`megapo bench scaling: ...`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megapo import worker_errors
from megapo.config import ConfigError
from megapo.worker_errors import EXIT_BAD_INPUT  # noqa: F401  a config or input error (docs/CONTRACTS.md)

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "objectives": ("megapo.commands.objectives", "list every objective, estimator and correction"),
    "tiny-model": ("megapo.commands.tiny_model", "write a tiny random-weight HF model with its own tokenizer"),
    "logprobs": ("megapo.commands.logprobs", "log-probs of given tokens from the Megatron learner"),
    "score": ("megapo.commands.score", "reward-model scores of given tokens (HF *ForSequenceClassification)"),
    "rm-train": ("megapo.commands.rm_train", "train a Bradley-Terry reward model on preference pairs"),
    "sft": ("megapo.commands.sft", "supervised warm start on a built-in task"),
    "train": ("megapo.commands.train", "RL training: megapo train CONFIG.yaml [dotted.overrides=...]"),
    "config": ("megapo.commands.config", "show a run config: every field's value, default, range and doc"),
    "plot": ("megapo.commands.plot", "draw reward/length/KL curves of a run to PNG"),
    "convert": ("megapo.commands.convert", "HF <-> Megatron checkpoint conversion"),
    "launch": ("megapo.commands.launch", "launch a run (local or Slurm)"),
    "plan": ("megapo.commands.plan", "per-GPU memory of a run's layout, and whether it fits the GPU"),
    "bench": ("megapo.commands.bench", "benchmarks (train step, packing, weight sync, scaling)"),
    "serve": ("megapo.commands.serve", "start an inference server megapo can use as an engine"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megapo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = build_parser()
        if argv and argv[0] not in ("-h", "--help"):
            parser.error(f"unknown command {argv[0]!r}; choose from: {', '.join(COMMANDS)}")
        parser.print_help()
        return 0
    name = argv[0]
    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"megapo {name}", description=help_text)
    module.add_arguments(parser)
    # INTERMIXED_ARGS: positionals may follow options (`megapo serve CONFIG --port P key=value ...`)
    parse = parser.parse_intermixed_args if getattr(module, "INTERMIXED_ARGS", False) else parser.parse_args
    return run_command(name, parse(argv[1:]))


def run_command(name: str, args: argparse.Namespace) -> int:
    """Command `name` on its parsed `args`, behind the one error surface."""
    module = importlib.import_module(COMMANDS[name][0])
    dest = getattr(module, "SUBCOMMAND", None)
    sub = getattr(args, dest, None) if dest else None
    return report_errors(f"megapo {name} {sub}" if sub else f"megapo {name}", module.run, args)


def module_main(prog: str, add_arguments, run) -> int:
    """A command module run on its own (torchrun's worker processes): its arguments parsed, run under report_errors."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog)
    add_arguments(parser)
    return report_errors(prog, run, parser.parse_args())


def report_errors(prog: str, run, args) -> int:
    """run(args); a ConfigError (LayoutError, InputError, CheckpointError too) ends as `prog: <message>` on
    stderr and exit code 2, no traceback. Also for modules run on their own (python -m tools.bench.scaling).
    Worker processes (megapo.worker_errors): the command that started them ends with the first failing rank's
    one line and exit code (WorkersFailed); in a worker, any exception is recorded for it, without a traceback."""
    try:
        return int(run(args) or 0)
    except worker_errors.WorkersFailed as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return err.code
    except ConfigError as err:
        return worker_errors.report(prog, err)
    except Exception as err:
        if not worker_errors.in_worker():
            raise  # a bug in a single process: its traceback
        return worker_errors.report(prog, err)


if __name__ == "__main__":
    sys.exit(main())
