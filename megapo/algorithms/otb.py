"""OTB: the Optimal Token Baseline (Li et al. 2026, The Optimal Token Baseline: Variance Reduction for Long-Horizon
LLM-RL, arXiv:2602.07078), a per-token baseline within each prompt's group that weights every response by the
gradient energy it has accumulated up to the token, estimated forward-only by the Logit-Gradient Proxy.

The proxy needs one number per position beyond π_old(y_t): Σ_v π_old(v)², which megapo.learner.logprobs
.vocab_parallel_sum_p2 reduces over the TP ranks' vocabulary slices without gathering them (Learner.response_sum_p2
gives it per response token). This module holds the math on per-sample lists; the stage otb (algorithm.stages)
runs it after the old-log-prob pass, with one more learner forward for Σ_v π_old² (megapo.trainer.update
.old_sum_p2) on the routes the train steps replay. Its advantage replaces the estimator's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.registry import register


@dataclass
class OTBOptions:
    eps: float = 1e-8  # ε in the baseline's denominator (the authors' verl implementation)
    zero_tail: bool = True  # the group's single longest response gets B_t = 0 past the second-longest (verl's default)

    def __post_init__(self):
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not math.isfinite(self.eps) \
                or self.eps <= 0:
            raise ValueError(f"eps: must be a finite number > 0, got {self.eps!r}")
        if not isinstance(self.zero_tail, bool):
            raise ValueError(f"zero_tail: must be true or false, got {self.zero_tail!r}")


def realized_energy(old_logp: Tensor, sum_p2: Tensor) -> Tensor:
    """W_t = Σ_{j ≤ t} (1 − 2 π_old(y_j) + Σ_v π_old(v)²_j) along one response: the cumulative Logit-Gradient Proxy
    (‖e_{y_j} − π_j‖², the squared logit gradient of log π(y_j))."""
    return (1 - 2 * old_logp.exp() + sum_p2).cumsum(0)


def _group_baseline(returns: list[Tensor], energy: list[Tensor], o: OTBOptions) -> list[Tensor]:
    """B_t = Σ_i G_{i,t} W_{i,t} / (Σ_i W_{i,t} + ε) over the group's responses that reach t, per response's length;
    a group of one: B = 0."""
    lengths = [len(g) for g in returns]
    if len(returns) == 1:
        return [torch.zeros_like(returns[0])]
    width = max(lengths)
    num = torch.zeros(width, dtype=torch.float64)
    den = torch.zeros(width, dtype=torch.float64)
    for g, w in zip(returns, energy):
        num[:len(g)] += g.double() * w.double()
        den[:len(g)] += w.double()
    base = num / (den + o.eps)
    out = [base[:n].clone() for n in lengths]
    ordered = sorted(lengths)
    if o.zero_tail and ordered[-1] > ordered[-2]:  # one longest response: its lone tail gets no baseline
        out[lengths.index(ordered[-1])][ordered[-2]:] = 0.0
    return out


@register(
    "otb", "advantage_stage", "group",
    "Li et al. 2026, The Optimal Token Baseline: Variance Reduction for Long-Horizon LLM-RL (arXiv:2602.07078) "
    "(the stage otb: one more learner forward for Σ_v π_old(v)², reduced vocabulary-parallel)",
    OTBOptions,
)
def otb_advantages(returns: list[Tensor], old_logp: list[Tensor], sum_p2: list[Tensor], group_size: int,
                   o: OTBOptions) -> list[Tensor]:
    """A_{i,t} = G_{i,t} − B*_t, B*_t = Σ_i G_{i,t}·W_{i,t} / (Σ_i W_{i,t} + ε) over the responses i of a prompt's
    group that reach token t, W_{i,t} = Σ_{j ≤ t} (1 − 2 π_old(y_{i,j}) + Σ_v π_old(v)²_{i,j}) (the realized energy:
    the Logit-Gradient Proxy ‖e_y − π‖² of each earlier token, accumulated); G_{i,t} the return to go (an outcome
    reward: R_i at every token). Responses that have accumulated more gradient energy weigh more in the baseline
    (the paper's optimal baseline E[G·W]/E[W], the per-token form of the classic ‖∇log π‖²-weighted baseline).
    Samples of a prompt are contiguous, `group_size` each. zero_tail (the authors' verl default): where one response
    is longer than all others of its group, B = 0 on its tokens past the second-longest, so the lone tail keeps its
    return. Assumptions: no rollout importance weights (verl scales each w_j by ρ̄²_j when it has them); a group of one
    has B = 0 (verl's rule)."""
    n = len(returns)
    if not len(old_logp) == len(sum_p2) == n:
        raise ValueError(f"old_logp: one per sample ({n}), got {len(old_logp)} old_logp and {len(sum_p2)} sum_p2")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or n % group_size:
        raise ValueError(f"group_size: must be an integer >= 1 dividing the {n} samples, got {group_size!r}")
    for i, (g, lp, s2) in enumerate(zip(returns, old_logp, sum_p2)):
        if not g.shape == lp.shape == s2.shape or g.dim() != 1:
            raise ValueError(f"sum_p2: sample {i}'s returns, old_logp and sum_p2 must be 1-D of one length")
    energy = [realized_energy(lp.double(), s2.double()) for lp, s2 in zip(old_logp, sum_p2)]
    out: list[Tensor] = []
    for start in range(0, n, group_size):
        group = slice(start, start + group_size)
        base = _group_baseline(returns[group], energy[group], o)
        out.extend(g.double() - b for g, b in zip(returns[group], base))
    return out
