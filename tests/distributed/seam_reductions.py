"""Run by tests/test_topk_seam_methods.py under torchrun (2 processes, gloo): megapo.learner.logprobs' per-position
reductions over the whole distribution (OTB's Σ_v p_v², Lp-Reg's min-p proxy log-probs, relative and fixed) with each
rank holding its slice of the same float64 logits (the padded vocabulary split evenly), and the gradient of Σ w·Σp² on
each slice, gathered. Rank 0 saves what rank 0 got and whether every rank got the same; the test compares them with
softmax over the unsharded logits."""

from __future__ import annotations

import torch

from megapo.learner.logprobs import vocab_parallel_min_p_logprobs, vocab_parallel_sum_p2
from spec_io import finish, read_spec  # this script's folder is on sys.path


def inputs(spec: dict):
    """The full logits [rows, padded vocabulary], targets [rows] and weights [rows], the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(spec["seed"])
    logits = torch.randn(spec["rows"], spec["padded"], generator=gen, dtype=torch.float64) * 2
    targets = torch.randint(0, spec["vocab"], (spec["rows"],), generator=gen)
    weights = torch.randn(spec["rows"], generator=gen, dtype=torch.float64)
    return logits, targets, weights


def main() -> None:
    spec, out_path = read_spec()
    torch.distributed.init_process_group("gloo")
    group = torch.distributed.group.WORLD
    rank, size = group.rank(), group.size()
    logits, targets, weights = inputs(spec)
    part = spec["padded"] // size
    mine = logits[:, rank * part:(rank + 1) * part].clone().requires_grad_(True)
    sum_p2 = vocab_parallel_sum_p2(mine, vocab_size=spec["vocab"], group=group)
    (weights * sum_p2).sum().backward()
    grads = [torch.empty_like(mine.grad) for _ in range(size)]
    torch.distributed.all_gather(grads, mine.grad, group=group)
    out = {"sum_p2": sum_p2.detach(), "grad": torch.cat(grads, dim=-1)}
    for mode in ("relative", "fixed"):
        out[mode] = vocab_parallel_min_p_logprobs(mine.detach(), targets, min_p=spec["min_p"][mode], mode=mode,
                                                  vocab_size=spec["vocab"], group=group)
    agree = True
    for key in ("sum_p2", "relative", "fixed"):
        same = [torch.empty_like(out[key]) for _ in range(size)]
        torch.distributed.all_gather(same, out[key], group=group)
        agree = agree and all(torch.equal(s, out[key]) for s in same)
    finish({**out, "ranks_agree": agree}, out_path)


if __name__ == "__main__":
    main()
