"""`megapo train CONFIG.yaml [section.field=value ...] [--resume]`."""

from __future__ import annotations

import argparse
import logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config (YAML), e.g. megapo/configs/tiny_moe_addition.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10 parallel.tp=2")
    parser.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint in output_dir/checkpoints (none: start at step 0)")


def run(args: argparse.Namespace) -> int:
    from megapo.config import load_config
    from megapo.trainer.config import RunConfig
    from megapo.trainer.loop import train

    import sys

    from megapo.config import ConfigError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        cfg = load_config(RunConfig, args.config, args.overrides)  # every config error before any work
    except ConfigError as exc:
        print(f"megapo train: config error: {exc}", file=sys.stderr)
        return 2
    from megapo.trainer.stop import EXIT_CHECKPOINTED, StopFlag, TrainingStopped

    stop = StopFlag()
    stop.install()  # SIGTERM/SIGUSR1: checkpoint after the current step, exit 75 (slurm/README.md)
    try:
        train(cfg, resume=args.resume, stop=stop)
    except TrainingStopped as exc:
        logging.getLogger(__name__).warning("megapo train: %s on signal %s; exit %d", exc, stop.signals,
                                            EXIT_CHECKPOINTED)
        return EXIT_CHECKPOINTED
    return 0
