"""`megapo sft --model HF_DIR --out DIR [--task T ...]`: the supervised warm start (megapo/trainer/sft.py) on its own."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from megapo.trainer.config import SFTConfig
from megapo.trainer.sft import train_sft

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF folder to start from")
    parser.add_argument("--out", required=True, help="where to write the warm-started HF folder")
    parser.add_argument("--task", default="addition", help="a task of megapo.tasks.registry (built-in: "
                        "addition, addition_cot) or module:function")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="response limit of the validation decode")
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--threshold", type=float, default=0.2, help="stop at this validation exact-match")
    parser.add_argument("--check-every", type=int, default=20)
    parser.add_argument("--max-steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from megapo.config import ConfigError, check_fields

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = SFTConfig(enabled=True, examples=args.examples, lr=args.lr, batch_size=args.batch_size,
                    threshold=args.threshold, check_every=args.check_every, max_steps=args.max_steps, seed=args.seed)
    try:
        check_fields(cfg)  # the ranges SFTConfig declares (sft.* of a run config), NaN/inf refused
    except ConfigError as err:  # named as the flag that set the field
        raise ConfigError(f"--{err.field.replace('_', '-')}", err.message) from None
    if args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", f"must be >= 1, got {args.max_new_tokens}")
    if not (Path(args.model) / "config.json").is_file():
        raise ConfigError("--model", f"{args.model} has no config.json")
    from megapo.tasks.registry import get_task

    task = get_task(args.task, field="--task")
    result = train_sft(args.model, args.out, cfg, task, max_new_tokens=args.max_new_tokens)
    state = "reached" if result.reached else "did NOT reach"
    print(f"sft: {state} validation exact-match {result.val_accuracy:.3f} (threshold {cfg.threshold}) "
          f"after {result.steps} steps in {result.seconds:.1f} s; wrote {args.out}")
    return 0 if result.reached else 1
