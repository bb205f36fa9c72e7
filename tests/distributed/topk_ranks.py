"""Run by tests/test_topk_distill.py under torchrun (2 processes, gloo): megapo.learner.logprobs' vocabulary-parallel
top-k and K-target log-probs with each rank holding its slice of the same float64 logits (the padded vocabulary split
evenly), and the gradient of Σ w · log p(targets) on each slice, gathered. Rank 0 saves what rank 0 got (every rank
gets the same values) and the full gradient; the test compares them with log_softmax over the unsharded logits."""

from __future__ import annotations

import torch

from megapo.learner.logprobs import vocab_parallel_logprobs_at, vocab_parallel_topk
from spec_io import finish, read_spec  # this script's folder is on sys.path


def inputs(spec: dict):
    """The full logits [rows, padded vocabulary], targets [rows, K] and weights, the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(spec["seed"])
    logits = torch.randn(spec["rows"], spec["padded"], generator=gen, dtype=torch.float64) * 3
    targets = torch.randint(0, spec["vocab"], (spec["rows"], spec["K"]), generator=gen)
    weights = torch.randn(spec["rows"], spec["K"], generator=gen, dtype=torch.float64)
    return logits, targets, weights


def main() -> None:
    spec, out_path = read_spec()
    torch.distributed.init_process_group("gloo")
    group = torch.distributed.group.WORLD
    rank, size = group.rank(), group.size()
    logits, targets, weights = inputs(spec)
    part = spec["padded"] // size
    mine = logits[:, rank * part:(rank + 1) * part].clone().requires_grad_(True)
    ids, logp = vocab_parallel_topk(mine, spec["k"], vocab_size=spec["vocab"], group=group)
    at = vocab_parallel_logprobs_at(mine, targets, vocab_size=spec["vocab"], group=group)
    (weights * at).sum().backward()
    grads = [torch.empty_like(mine.grad) for _ in range(size)]
    torch.distributed.all_gather(grads, mine.grad, group=group)
    same = [torch.empty_like(logp) for _ in range(size)]
    torch.distributed.all_gather(same, logp, group=group)
    finish({"ids": ids, "logp": logp, "at": at.detach(), "grad": torch.cat(grads, dim=-1),
            "ranks_agree": all(torch.equal(s, logp) for s in same)}, out_path)


if __name__ == "__main__":
    main()
