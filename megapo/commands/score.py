"""`megapo score`: reward-model scores of given tokens from a Megatron score model.

    megapo score --model RM_DIR --input IN.jsonl --output OUT.jsonl [--tp N --pp N --ep N --dp N
                 --dispatcher alltoall|allgather] [--precision fp32|bf16|fp16]

RM_DIR: an HF *ForSequenceClassification folder with one label (`megapo tiny-model --head score`, `megapo
rm-train`). IN lines: {"tokens": [...]}; OUT lines: {"score": x}, the score head on the final hidden state at the
sequence's last token (transformers' rule: the last token that is not pad_token_id). The folder, the layout and
the input are checked first (an error naming the field, before any process starts); a layout with more than one
process is started with torchrun (megapo/launch/local.py), as `megapo logprobs` does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megapo.config import ConfigError, ParallelConfig
from megapo.layout import check_layout, read_hf_config
from megapo.learner.precision import precision_named


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF *ForSequenceClassification folder (one label)")
    parser.add_argument("--input", required=True, help='JSONL, one {"tokens": [...]} per line')
    parser.add_argument("--output", required=True, help='JSONL written, one {"score": x} per line')
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--dispatcher", default="alltoall", choices=("alltoall", "allgather"))
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--precision", default="fp32", help="the model's parameters and activations: fp32 | bf16 | fp16")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before the processes are killed")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set for torchrun's processes


def read_token_lists(path: str | Path, vocab: int, field: str = "--input") -> list[list[int]]:
    """The token lists of a jsonl file of {"tokens": [>= 1 integer in [0, vocab)]}; ConfigError(field) naming
    `path:line` for any other line, or a file with none."""
    from megapo.commands.logprobs import _is_token_id
    from megapo.trainer.data import read_jsonl

    path = Path(path)
    if not path.is_file():
        raise ConfigError(field, f"{path} does not exist")
    sequences = []
    for n, row in read_jsonl(path, field):
        tokens = row.get("tokens") if isinstance(row, dict) else None
        if not isinstance(tokens, list) or not tokens or not all(_is_token_id(t) for t in tokens):
            raise ConfigError(field, f'{path}:{n}: expected {{"tokens": [one or more integers]}}')
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise ConfigError(field, f"{path}:{n}: token ids must be in [0, {vocab})")
        sequences.append(tokens)
    if not sequences:
        raise ConfigError(field, f"{path} holds no sequences")
    return sequences


def check_model(model_dir, parallel: ParallelConfig, field: str = "--model") -> dict:
    """config.json of a reward-model folder that fits `parallel`; ConfigError naming `field` or the layout's."""
    from megapo.learner.score import check_score_folder
    from megapo.models.family import family_for

    hf = read_hf_config(model_dir, field)
    check_layout(parallel, hf)
    check_score_folder(model_dir, hf, family_for(hf), field)
    return hf


def run(args: argparse.Namespace) -> int:
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, dp=args.dp, dispatcher=args.dispatcher)
    hf = check_model(args.model, parallel)
    sequences = read_token_lists(args.input, hf["vocab_size"])
    if args.micro_batch_tokens < 1:
        raise ConfigError("--micro-batch-tokens", f"must be >= 1, got {args.micro_batch_tokens}")
    precision_named(args.precision)
    if args.worker or parallel.world_size == 1:
        return _work(args, parallel, sequences)
    from megapo.launch.local import run_workers  # a worker's failure: WorkersFailed, its one line

    return run_workers(["-m", "megapo.commands.score", "--worker", *_to_argv(args)], parallel.world_size,
                       timeout_s=args.timeout)


def _to_argv(args) -> list[str]:
    return ["--model", str(args.model), "--input", str(args.input), "--output", str(args.output),
            "--tp", str(args.tp), "--pp", str(args.pp), "--ep", str(args.ep), "--dp", str(args.dp),
            "--dispatcher", args.dispatcher, "--micro-batch-tokens", str(args.micro_batch_tokens),
            "--precision", args.precision]


def _work(args, parallel: ParallelConfig, sequences: list[list[int]]) -> int:
    import torch

    from megapo.learner.score import ScoreModel

    model = ScoreModel(args.model, parallel, micro_batch_tokens=args.micro_batch_tokens,
                       precision=precision_named(args.precision))
    scores = model.scores(sequences)
    if torch.distributed.get_rank() == 0:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps({"score": s}) + "\n" for s in scores))
    model.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


def main() -> int:  # torchrun's processes (--worker)
    from megapo.cli import module_main

    return module_main("megapo score", add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
