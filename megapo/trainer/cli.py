"""`megapo train CONFIG.yaml [section.field=value ...] [--resume]`."""

from __future__ import annotations

import argparse
import logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config (YAML), e.g. megapo/configs/tiny_moe_addition.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10 parallel.tp=2")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")


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
    train(cfg, resume=args.resume)
    return 0
