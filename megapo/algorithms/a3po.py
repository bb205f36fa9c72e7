"""A3PO: the token stage a3po of algorithm.stages (megapo/algorithms/pipeline.py declares its inputs), the adaptive
and asymmetric token-level advantage shaping of Tang et al. 2025, Rethinking Sample Polarity in Reinforcement
Learning with Verifiable Rewards (arXiv:2512.21625):

    A'_{i,t} = A_{i,t}·w_{i,t},  w = s₊(step) on a positive response's lowest-probability tokens,
                                  w = s₋(step) on a negative response's highest-probability tokens, 1 elsewhere

The probabilities are π_old's (sample.old_logp, the old-log-prob pass's); the selected tokens are the bottom
(positive) / top (negative) share ρ of each polarity's tokens over the whole train batch, taken once before any
mini-, micro-batch or DP split, so the result does not depend on how the learner splits the batch. The sample-level
half of the paper's study (scaling whole positive / negative responses) is the stage polarity (stages.py): list
{name: polarity, ...} before {name: a3po} for both. `a3po_advantages` at the end runs the stage on a train batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from megapo.algorithms.options import check_number
from megapo.algorithms.registry import get, register
from megapo.algorithms.stages import _annealed
from megapo.algorithms.token_tensors import per_token_advantages, per_token_values

NAME = "a3po"


@dataclass
class A3poOptions:
    frac: float = 0.2  # ρ: the share of each polarity's tokens (over the batch) whose advantage is scaled
    pos_scale: float = 2.0  # s₊ at step 1: the factor on a positive response's lowest-probability tokens
    neg_scale: float = 2.0  # s₋ at step 1: the factor on a negative response's highest-probability tokens
    scale_end: float | None = 1.0  # both factors move linearly to this over anneal_steps (null: constant)
    anneal_steps: int = 100  # trainer steps of the schedule (0 with scale_end null: no schedule)
    option_field: ClassVar[bool] = True  # its refusals name algorithm.stages[i].<option> (pipeline._parse_one)

    def __post_init__(self):
        check_number("frac", self.frac, above=0, high=1)
        check_number("pos_scale", self.pos_scale, low=0)
        check_number("neg_scale", self.neg_scale, low=0)
        check_number("anneal_steps", self.anneal_steps, low=0, integer=True)
        if self.scale_end is not None:
            check_number("scale_end", self.scale_end, low=0)
            if self.anneal_steps == 0:
                raise ValueError("anneal_steps: must be > 0 with scale_end set (scale_end: null keeps the factors "
                                 "constant)")
        elif self.anneal_steps:
            raise ValueError("scale_end: give the factors' end value with anneal_steps > 0 (or anneal_steps: 0)")

    def scales_at(self, step: int) -> tuple[float, float]:
        """(s₊, s₋) at trainer step `step` (1-based)."""
        return (_annealed(float(self.pos_scale), self.scale_end, self.anneal_steps, step),
                _annealed(float(self.neg_scale), self.scale_end, self.anneal_steps, step))


def _kth(values: Tensor, frac: float, largest: bool) -> float:
    """The k-th largest (largest) or smallest value of `values`, k = max(1, ⌈ρ·N⌉); ±inf when there is none."""
    n = values.numel()
    if n == 0:
        return -math.inf if largest else math.inf
    k = max(1, math.ceil(frac * n - 1e-9))  # 0.3·20 is 6.000000000000001 in floats
    return float(torch.topk(values, k, largest=largest).values[-1])


@register(
    NAME, "advantage_stage", "batch",
    "Tang et al. 2025, Rethinking Sample Polarity in Reinforcement Learning with Verifiable Rewards "
    "(arXiv:2512.21625), A3PO: Adaptive and Asymmetric token-level Advantage shaping for Policy Optimization",
    A3poOptions,
)
def a3po(adv: list[Tensor], logp: list[Tensor], positive: Tensor, negative: Tensor, step: int,
         o: A3poOptions) -> list[Tensor]:
    """A'_{i,t} = A_{i,t}·w_{i,t}. Response i is positive when Σ_t A_{i,t} > 0, negative when < 0 (a response with
    advantage 0 is left as it is). w_{i,t} = s₊ if i is positive and p_{i,t} ≤ τ₊, s₋ if i is negative and
    p_{i,t} ≥ τ₋, else 1; p = π_old(y_t) = exp(old_logp); τ₊ = the k₊-th smallest p over every token of the batch's
    positive responses, k₊ = ⌈ρ·N₊⌉ of their N₊ tokens; τ₋ = the k₋-th largest over the negative responses' N₋ tokens
    (ties at τ all scaled). s₊ and s₋ move linearly from pos_scale / neg_scale at step 1 to scale_end over
    anneal_steps trainer steps. Asymmetric: a correct response's credit goes to its rare tokens (the paper: positive
    samples sharpen existing reasoning, so credit on their low-probability tokens keeps them from collapsing onto the
    already likely ones), a wrong response's blame to its confident tokens (pushing probability mass off the
    confident wrong path, the negative samples' exploration). Assumption: the method section was not at hand; the
    abstract and published summaries of the paper give the targets (low-probability tokens of positive samples,
    high-probability tokens of negative samples) and a training-time schedule, not their numbers: the batch-wide
    share ρ = 0.2 per polarity, the factors 2, their linear decay to 1 (plain GRPO) over 100 steps as the adaptive
    part, and the sign of Σ_t A_t as the polarity are ours; no renormalisation (a response's mean factor is above 1 when it has selected
    tokens); π_old's probability, not its entropy, picks the tokens."""
    flat = torch.cat(logp) if logp else torch.zeros(0, dtype=torch.float64)
    owner = torch.repeat_interleave(torch.arange(len(logp)), torch.tensor([len(x) for x in logp], dtype=torch.long))
    prob = torch.exp(flat)
    tau_pos = _kth(prob[positive[owner]], o.frac, largest=False)
    tau_neg = _kth(prob[negative[owner]], o.frac, largest=True)
    s_pos, s_neg = o.scales_at(step)
    out = []
    for a, lp, pos, neg in zip(adv, logp, positive.tolist(), negative.tolist()):
        p = torch.exp(lp)
        w = torch.ones_like(p)
        if pos:
            w = torch.where(p <= tau_pos, torch.full_like(p, s_pos), w)
        elif neg:
            w = torch.where(p >= tau_neg, torch.full_like(p, s_neg), w)
        out.append(a * w)
    return out


def a3po_advantages(*, advantages: list, old_logp: list, step: int = 1, **options) -> list[Tensor]:
    """Stage a3po on a train batch: `advantages` per sample (a number, or an earlier stage's one per response token),
    π_old's `old_logp` per response token, `step` the trainer step (1-based). One float64 tensor per sample."""
    entry = get("advantage_stage", NAME, argument="stage")
    o = entry.make_options(options)
    if old_logp is None:
        raise ValueError("old_logp: stage a3po needs π_old's per-token log-probs (sample.old_logp)")
    lengths = [len(v) if v is not None else 0 for v in old_logp]
    if len(advantages) != len(lengths):
        raise ValueError(f"advantages: {len(advantages)} for {len(lengths)} samples")
    logp = per_token_values("old_logp", old_logp, lengths)
    adv = per_token_advantages(advantages, lengths)
    total = torch.tensor([float(a.sum()) if a.numel() else 0.0 for a in adv], dtype=torch.float64)
    # a response of no tokens has no polarity here: its scalar advantage decides nothing
    return entry.fn(adv, logp, total > 0, total < 0, int(step), o)


def a3po_selected(advantages: list[Tensor], shaped: list[Tensor]) -> float:
    """The share of the batch's tokens whose advantage the stage changed (a3po/scaled_frac)."""
    flat_a = torch.cat(advantages) if advantages else torch.zeros(0, dtype=torch.float64)
    flat_s = torch.cat(shaped) if shaped else torch.zeros(0, dtype=torch.float64)
    return float(flat_a.ne(flat_s).double().mean()) if flat_a.numel() else 0.0


def run_a3po_stage(batch: list, s, ctx) -> tuple[list[Tensor], dict]:
    """pipeline.STAGES' runner for `a3po`: per sample its per-token advantages; a3po/scaled_frac, the share of the
    batch's tokens whose advantage it changed, and a3po/pos_scale, s₊ at this step (s₋ follows the same line)."""
    before = per_token_advantages([x.advantage for x in batch], [len(x.tokens) - x.prompt_len for x in batch])
    values = a3po_advantages(advantages=before, old_logp=[x.old_logp for x in batch], step=ctx.step, **s.given)
    return values, {"a3po/scaled_frac": a3po_selected(before, values),
                    "a3po/pos_scale": s.options.scales_at(ctx.step)[0]}
