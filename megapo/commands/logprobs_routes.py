"""`megapo logprobs --routes-in ROUTES.npz --routes-out ROUTES.npz`: replay / report routes.

ROUTES.npz has one int array per input line, key "0", "1", ...: [len(tokens)-1, num_moe_layers, topk]
(a key may be missing or an array partial: those positions use the router's own choice). --routes-out
writes the routes the learner actually routed with, in the same layout (complete for every line).
megapo/commands/logprobs.py calls these functions at marked call sites.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megapo.config import ConfigError
from megapo.replay.routes import RouteShape, check_routes, load_routes, save_routes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--routes-in", default=None,
                        help='replay these MoE routes: .npz, key "i" = int [len(tokens)-1, moe_layers, topk] of line i')
    parser.add_argument("--routes-out", default=None, help="write the MoE routes the learner used (.npz, same layout)")


def wanted(args) -> bool:
    return bool(getattr(args, "routes_in", None) or getattr(args, "routes_out", None))


def check(args, hf: dict, sequences: list[list[int]]) -> None:
    """Validate --routes-in / --routes-out against the model and the input (ConfigError naming the flag)."""
    if not wanted(args):
        return
    from megapo.models.family import family_for

    shape = RouteShape.from_spec(family_for(hf).spec(hf))
    flag = "--routes-in" if args.routes_in else "--routes-out"
    if shape.num_moe_layers == 0:
        raise ConfigError(flag, "the model has no MoE layers")
    if args.routes_out and Path(args.routes_out).suffix != ".npz":
        raise ConfigError("--routes-out", f"must end in .npz, got {args.routes_out}")
    if args.routes_in:
        try:
            routes = load_routes(args.routes_in, len(sequences))
            for i, (r, seq) in enumerate(zip(routes, sequences)):
                check_routes(r, len(seq), shape, f"line {i + 1} (key '{i}')")
        except (OSError, ValueError) as exc:
            raise ConfigError("--routes-in", str(exc)) from None


def argv(args) -> list[str]:
    out = []
    if args.routes_in:
        out += ["--routes-in", str(args.routes_in)]
    if args.routes_out:
        out += ["--routes-out", str(args.routes_out)]
    return out


def logprobs(learner, sequences: list[list[int]], args):
    """The learner's log-probs, replaying --routes-in and writing --routes-out (rank 0). Collective."""
    import torch

    if not wanted(args):
        return learner.logprobs(sequences)
    from megapo.replay.modes import logprobs_with_routes

    routes = load_routes(args.routes_in, len(sequences)) if args.routes_in else None
    logps, used, _ = logprobs_with_routes(learner, sequences, routes)
    if args.routes_out and torch.distributed.get_rank() == 0:
        save_routes(args.routes_out, used)
    return logps
