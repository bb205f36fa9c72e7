"""`megapo train CONFIG.yaml [section.field=value ...] [--resume | --overwrite]`.

A config or run-folder error raises ConfigError, which `megapo` reports as `megapo train: <field>: <message>`
with exit code 2 before anything is written (docs/CONTRACTS.md, "Error contract"). A runtime failure whose
message names its cause (a reward that failed under data.reward_errors=fail, non-finite weights) ends as one
line `megapo train: <message>` and exit code 1; any other exception keeps its traceback (a bug), except in the
processes `megapo launch local` starts: there every failure is recorded for the launcher, which ends with the
first failing rank's line and exit code, no traceback (megapo.worker_errors; MEGAPO_DEBUG=1 prints them)."""

from __future__ import annotations

import argparse
import logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config (YAML), e.g. megapo/configs/tiny_moe_addition.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10 parallel.tp=2 "
                        "(`megapo config show --defaults` lists every field with its doc)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in train.output_dir from its newest complete checkpoint")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in a used train.output_dir: remove the previous run's checkpoints, metrics "
                             "and config (not the model folders the config points at; see megapo/trainer/run_dir.py)")


def run(args: argparse.Namespace) -> int:
    from megapo.config import load_config
    from megapo.trainer.config import RunConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = load_config(RunConfig, args.config, args.overrides)  # every config error before any work

    from megapo.integrity import NonFiniteError
    from megapo.trainer.loop import train
    from megapo.trainer.rewards import RewardError
    from megapo.trainer.stop import EXIT_CHECKPOINTED, StopFlag, TrainingStopped
    from megapo.worker_errors import report

    stop = StopFlag()
    stop.install()  # SIGTERM/SIGUSR1/SIGINT: checkpoint after the current step, exit 75 (slurm/README.md)
    try:
        train(cfg, resume=args.resume, overwrite=args.overwrite, stop=stop)
    except TrainingStopped as exc:
        logging.getLogger(__name__).warning("megapo train: %s on signal %s; exit %d", exc, stop.signals,
                                            EXIT_CHECKPOINTED)
        return EXIT_CHECKPOINTED
    except (RewardError, NonFiniteError) as exc:  # the message says what failed and where; no checkpoint of it
        return report("megapo train", exc)  # exit 1; under `megapo launch local` its last line
    finally:
        stop.uninstall()
    return 0
