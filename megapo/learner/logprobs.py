"""Log-probs and entropy of given tokens from vocabulary-parallel logits.

Each TP rank holds logits for its slice of the vocabulary. Only per-token scalars cross ranks
(max, sum of exp, the target's logit, sum p*logit): the full vocabulary is never gathered on one rank.
Unlike Megatron's vocab_parallel_cross_entropy this does not modify the logits in place (the caller
may still need them) and also returns the entropy. Differentiable (used by the train step).
"""

from __future__ import annotations

import torch

_NEG = -1e30  # logit of a padded vocabulary entry (finite, so 0 * _NEG stays 0 in the entropy)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int,
                            with_entropy: bool = False, entropy_grad: bool = True, group=None):
    """logits [..., V_local] (this rank's vocabulary slice), targets [...] global token ids.
    Returns (logp [...], entropy [...] or None), identical on every TP rank. entropy_grad=False: the
    entropy is only a metric (no graph kept for it)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    if group is None:
        group = parallel_state.get_tensor_model_parallel_group()
    rank, size = group.rank(), group.size()
    part = logits.shape[-1]
    start = rank * part
    logits = logits.float()
    if start + part > vocab_size:  # mask vocabulary padding (added so the vocab splits evenly over TP)
        ids = torch.arange(start, start + part, device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, _NEG)

    def all_reduce(x):
        return reduce_from_tensor_model_parallel_region(x) if size > 1 else x

    with torch.no_grad():
        peak = logits.max(dim=-1).values
        if size > 1:
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = logits - peak.unsqueeze(-1)
    exp = shifted.exp()
    local = targets - start
    inside = (local >= 0) & (local < part)
    picked = shifted.gather(-1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1)
    entropy_graph = entropy_grad and torch.is_grad_enabled()
    parts = [exp.sum(dim=-1), torch.where(inside, picked, torch.zeros_like(picked))]
    if with_entropy:
        with torch.set_grad_enabled(entropy_graph):
            parts.append((exp * shifted).sum(dim=-1))
    sums = all_reduce(torch.stack(parts))  # one collective for every per-token sum
    log_z = sums[0].log()
    logp = sums[1] - log_z
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_graph):
            entropy = log_z - sums[2] / sums[0]
    return logp, entropy
