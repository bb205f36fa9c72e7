"""Attention-entropy token reweighting (Li, Wu, Bao and Wu 2026, Not All Tokens Learn Alike: Attention Entropy Reveals
Heterogeneous Signals in RL Reasoning, arXiv:2605.07660).

The paper reads each response token's attention entropy (how diffuse the contextual support of the query predicting
it is, at one layer, over the head-averaged attention, normalised) and finds two ends of a spectrum: low-entropy
"anchors" give stable gradients aligned with the full-token update but plateau on hard problems; high-entropy
"explorers" give larger, more volatile gradients that hold hard-reasoning signal when optimisation stays stable. Its
intervention is a dynamic entropy-aware soft reweighting of the token-level objective. We found no released code and
the weighting rule is not in the abstract; the rule here is ours (Assumption, in attention_entropy_weights' formula):
a soft weight from each token's entropy rank in the batch, mean 1, whose tilt moves from the anchors to the explorers
over the run.

The stage attention_entropy (algorithm.stages) runs it after the old-log-prob pass with one more learner forward
for the entropies (Learner.response_attention_entropy, megapo.trainer.update.old_attention_entropy), and multiplies
each token's advantage by its weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.registry import register


@dataclass
class AttentionEntropyOptions:
    layer: int = -1  # the layer whose attention is read (0-based; negative from the end). Assumption: the last
    normalize: bool = True  # divide H by log(keys the query sees), the paper's normalised entropy
    beta_start: float = -0.5  # the tilt at step 0: < 0 weighs the anchors (low entropy) up
    beta_end: float = 0.5  # the tilt after anneal_steps: > 0 weighs the explorers (high entropy) up
    anneal_steps: int = 100  # trainer steps from beta_start to beta_end (linear); 0: beta_end throughout

    option_field = True  # refusals name the option's field (pipeline.parse_stages)

    def __post_init__(self):
        for name in ("layer", "anneal_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: must be an integer, got {value!r}")
        if self.anneal_steps < 0:
            raise ValueError(f"anneal_steps: must be >= 0, got {self.anneal_steps!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize: must be true or false, got {self.normalize!r}")
        for name in ("beta_start", "beta_end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not -1 <= value <= 1:
                raise ValueError(f"{name}: must be a number in [-1, 1] (weights 1 ± beta stay >= 0), got {value!r}")


def tilt(step: int, o: AttentionEntropyOptions) -> float:
    """β(step) = beta_start + (beta_end − beta_start)·min(step / anneal_steps, 1) (beta_end when anneal_steps is 0)."""
    if o.anneal_steps == 0:
        return float(o.beta_end)
    return o.beta_start + (o.beta_end - o.beta_start) * min(step / o.anneal_steps, 1.0)


def _centred_ranks(x: Tensor) -> Tensor:
    """u = (2r − T − 1)/(T − 1) in [−1, 1], r the 1-based rank of each of the T values (ties: their mean rank, so
    Σu = 0 exactly and equal entropies weigh alike); 0 for T <= 1."""
    n = x.numel()
    if n <= 1:
        return torch.zeros_like(x)
    _, inverse, counts = torch.unique(x, sorted=True, return_inverse=True, return_counts=True)
    last = counts.cumsum(0).to(torch.float64)  # the 1-based rank of each distinct value's last copy
    rank = (last - (counts.to(torch.float64) - 1) / 2)[inverse]
    return (2 * rank - n - 1) / (n - 1)


@register(
    "attention_entropy", "advantage_stage", "batch",
    "Li, Wu, Bao and Wu 2026, Not All Tokens Learn Alike: Attention Entropy Reveals Heterogeneous Signals in RL "
    "Reasoning (arXiv:2605.07660) (the stage attention_entropy: one more learner forward for the attention entropies)",
    AttentionEntropyOptions,
)
def attention_entropy_weights(entropies: list[Tensor], prompt_lens: list[int], masks: list | None, step: int,
                              o: AttentionEntropyOptions) -> tuple[list[Tensor], dict]:
    """Per response token t (0-based) of sample i, H_t = −Σ_j ā_j log ā_j, ā the attention distribution of the query
    predicting it at layer `layer`, averaged over the heads, over the n_t = prompt_len_i + t keys it sees; with
    `normalize`, h_t = H_t / log n_t (0 where n_t = 1), else h_t = H_t. Over the batch's policy tokens (T of them):
    u_t = (2·rank(h_t) − T − 1)/(T − 1) ∈ [−1, 1] (ties share their mean rank; u = 0 when T = 1), and
    w_t = 1 + β(step)·u_t, β(step) = beta_start + (beta_end − beta_start)·min(step/anneal_steps, 1) (step: the
    trainer step, 1 for the first; beta_end throughout when anneal_steps is 0), so the weights
    average exactly 1 over the policy tokens; a token outside the loss mask weighs 1. The stage multiplies each
    token's advantage by w_t. Assumption: the paper's "dynamic entropy-aware soft-reweighting" rule is not given in
    its abstract and we found no released code: the rank-based soft weights, their mean 1, the linear tilt from the
    anchors (β < 0: low entropy weighs more) toward the explorers (β > 0) and the defaults (β from −0.5 to 0.5 over
    100 steps) are ours; the paper's entropy is read at "a fixed layer", which layer is ours (default the last).
    `masks`: per sample, 1 on its policy tokens (None: all). The ranks are over the whole train batch on every rank,
    so the weights do not depend on mini-, micro-batches or DP ranks. Returns the weights (one float64 tensor per
    sample) and metrics: attention_entropy/beta, attention_entropy/mean (of h over the policy tokens) and
    attention_entropy/anchor_weight (the mean weight of the lower half of h)."""
    n = len(entropies)
    if len(prompt_lens) != n or (masks is not None and len(masks) != n):
        raise ValueError(f"prompt_lens: one per sample ({n}), got {len(prompt_lens)}"
                         + ("" if masks is None else f" and {len(masks)} masks"))
    scores, keeps = [], []
    for i, (h, p) in enumerate(zip(entropies, prompt_lens)):
        h = torch.as_tensor(h, dtype=torch.float64).reshape(-1)
        keep = torch.ones(h.numel(), dtype=torch.bool) if masks is None or masks[i] is None \
            else torch.as_tensor(masks[i]).reshape(-1).bool()
        if keep.numel() != h.numel():
            raise ValueError(f"loss_mask[{i}]: expected {h.numel()} values, got {keep.numel()}")
        if o.normalize:
            keys = torch.arange(h.numel(), dtype=torch.float64) + p
            h = torch.where(keys > 1, h / keys.log().clamp(min=1e-300), torch.zeros_like(h))
        scores.append(h)
        keeps.append(keep)
    flat = torch.cat([h[k] for h, k in zip(scores, keeps)]) if scores else torch.zeros(0, dtype=torch.float64)
    beta = tilt(step, o)
    weight = 1 + beta * _centred_ranks(flat)
    out, start = [], 0
    for h, keep in zip(scores, keeps):
        w = torch.ones(h.numel(), dtype=torch.float64)
        count = int(keep.sum())
        w[keep] = weight[start:start + count]
        out.append(w)
        start += count
    low = flat <= flat.median() if flat.numel() else flat.bool()
    return out, {"attention_entropy/beta": beta,
                 "attention_entropy/mean": float(flat.mean()) if flat.numel() else 0.0,
                 "attention_entropy/anchor_weight": float(weight[low].mean()) if low.any() else 1.0}
