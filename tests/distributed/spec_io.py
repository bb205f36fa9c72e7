"""What the torchrun scripts in this folder share: the command line `--spec SPEC.json --out RESULTS.pt`, and the end.

The test writes the spec (what to run: models, layouts, cases) and reads the results rank 0 saved."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def read_spec() -> tuple[dict, str]:
    """(the spec, the path results go to)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="JSON written by the test")
    parser.add_argument("--out", required=True, help="results file (torch.save) rank 0 writes")
    args = parser.parse_args()
    return json.loads(Path(args.spec).read_text()), args.out


def finish(results, out_path: str) -> None:
    """Rank 0 saves the results; then every rank leaves the process group together."""
    if torch.distributed.get_rank() == 0:
        torch.save(results, out_path)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def hf_grads(learner) -> dict:
    """The last step's gradients (Megatron's main_grad, reduced over DP), gathered to HF names like the
    weights: each parameter shows its gradient while hf_state_dict runs."""
    params = list(learner.module.parameters())
    data = [p.data for p in params]
    for p in params:
        p.data = p.main_grad.detach().view_as(p).to(p.dtype)
    try:
        return dict(learner.hf_state_dict())
    finally:
        for p, d in zip(params, data):
            p.data = d
