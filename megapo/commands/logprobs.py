"""`megapo logprobs`: log-probs of given tokens from the Megatron learner.

    megapo logprobs --model HF_DIR --input IN.jsonl --output OUT.jsonl [--tp N --pp N --ep N --dp N
                    --dispatcher alltoall|allgather] [--precision fp32|bf16|fp16]
                    [--routes-in ROUTES.npz] [--routes-out ROUTES.npz]

IN lines: {"tokens": [...]}; OUT lines: {"logprobs": [...]}, log p(tokens[t] | tokens[:t]) for
t = 1..len-1, from the learner computing in --precision (log-probs themselves in fp32 from its logits): the
learner side of a train-inference mismatch measurement. The layout is checked against the model first (an error naming the numbers, before
any process starts); a layout with more than one process is started with torchrun (megapo/launch/local.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megapo.config import ConfigError, ParallelConfig
from megapo.layout import check_layout, read_hf_config
from megapo.learner.precision import precision_named
from megapo.commands import logprobs_routes as route_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF model folder (config.json + safetensors)")
    parser.add_argument("--input", required=True, help='JSONL, one {"tokens": [...]} per line')
    parser.add_argument("--output", required=True, help='JSONL written, one {"logprobs": [...]} per line')
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--dispatcher", default="alltoall", choices=("alltoall", "allgather"))
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--precision", default="fp32", help="the learner's parameters and activations: fp32 | bf16 | fp16")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before the processes are killed")
    route_cli.add_arguments(parser)  # routing replay: --routes-in / --routes-out (megapo/commands/logprobs_routes.py)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set for torchrun's processes


def read_sequences(path: str | Path, vocab: int | None = None) -> list[list[int]]:
    """The token lists of an input file; ConfigError("--input") naming `path:line` for a line that is not
    UTF-8 / JSON / {"tokens": [>= 2 integers in [0, vocab)]} (JSON true/false are not token ids), or a
    file with none."""
    from megapo.trainer.data import read_jsonl

    path = Path(path)
    if not path.is_file():
        raise ConfigError("--input", f"{path} does not exist")
    sequences = []
    for n, row in read_jsonl(path, "--input"):
        tokens = row.get("tokens") if isinstance(row, dict) else None
        if tokens is None:
            raise ConfigError("--input", f'{path}:{n}: expected {{"tokens": [...]}}')
        if not isinstance(tokens, list) or len(tokens) < 2 or not all(_is_token_id(t) for t in tokens):
            raise ConfigError("--input", f"{path}:{n}: tokens must be a list of at least 2 integers"
                              + ("; true/false are not token ids" if any(isinstance(t, bool) for t in tokens) else ""))
        if vocab is not None and (min(tokens) < 0 or max(tokens) >= vocab):
            raise ConfigError("--input", f"{path}:{n}: token ids must be in [0, {vocab})")
        sequences.append(tokens)
    if not sequences:
        raise ConfigError("--input", f"{path} holds no sequences")
    return sequences


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is a Python int subclass


def parallel_from_args(args) -> ParallelConfig:
    return ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, dp=args.dp, dispatcher=args.dispatcher)


def run(args: argparse.Namespace) -> int:
    parallel = parallel_from_args(args)
    hf = read_hf_config(args.model)
    check_layout(parallel, hf)
    sequences = read_sequences(args.input, hf["vocab_size"])
    if args.micro_batch_tokens < 1:
        raise ConfigError("--micro-batch-tokens", f"must be >= 1, got {args.micro_batch_tokens}")
    route_cli.check(args, hf, sequences)  # routing replay flags
    precision_named(args.precision)
    if args.worker or parallel.world_size == 1:
        return _work(args, parallel, sequences)
    from megapo.launch.local import run_workers  # a worker's failure: WorkersFailed, its one line

    argv = _to_argv(args)
    return run_workers(["-m", "megapo.commands.logprobs", "--worker", *argv], parallel.world_size,
                       timeout_s=args.timeout)


def _to_argv(args) -> list[str]:
    return ["--model", str(args.model), "--input", str(args.input), "--output", str(args.output),
            "--tp", str(args.tp), "--pp", str(args.pp), "--ep", str(args.ep), "--dp", str(args.dp),
            "--dispatcher", args.dispatcher, "--micro-batch-tokens", str(args.micro_batch_tokens),
            "--precision", args.precision,
            *route_cli.argv(args)]


def _work(args, parallel: ParallelConfig, sequences: list[list[int]]) -> int:
    import torch

    from megapo.learner.learner import Learner

    learner = Learner(args.model, parallel, micro_batch_tokens=args.micro_batch_tokens,
                      routing_replay=route_cli.wanted(args), precision=precision_named(args.precision))
    logprobs = route_cli.logprobs(learner, sequences, args)  # replays --routes-in, writes --routes-out
    if torch.distributed.get_rank() == 0:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w") as f:
            for lp in logprobs:
                f.write(json.dumps({"logprobs": [float(x) for x in lp]}) + "\n")
    learner.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


def main() -> int:  # torchrun's processes (--worker)
    from megapo.cli import module_main

    return module_main("megapo logprobs", add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
