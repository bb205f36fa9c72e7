"""The reference answer's likelihood after each response prefix, as token credit: IAPO and SPAE.

IAPO: token-wise advantages from each token's conditional mutual information with the final answer (He, Zhu, Shi,
Zheng, Su, Wang, Guo, Li 2026, IAPO: Information-Aware Policy Optimization for Token-Efficient Reasoning,
arXiv:2602.19049). Tokens that make the answer likelier gain credit, tokens that do not (low-utility exploration)
lose it, so the policy keeps the informative steps and drops the rest.

The information of token t of response i, estimated pointwise from π_old (ASSUMPTION: the abstract names the
conditional MI I(y_t; a | x, y_<t) but not its estimator; we take its single-sample value, the log-likelihood ratio
of the answer with and without the token):

    m_{i,t} = log π_old(a* | x, y_{i,≤t}) − log π_old(a* | x, y_{i,<t})          t = 1..|y_i|

a* the task's reference answer (Example.answer through the tokenizer, alone, no special tokens: the "final answer"
of a correct response; ASSUMPTION: the reference for every response, so an incorrect one's tokens are credited
for moving toward the right answer), appended directly after each prefix. Σ_t m_{i,t} telescopes to
log π_old(a* | x, y_i) − log π_old(a* | x): what the whole response told the model about the answer.

The advantage (ASSUMPTION: the abstract says the advantages are assigned from m, not how; we shift each sample's
advantage by its tokens' standardized information, scaled by |A_i| so that the sign of a clear verdict is kept for
every token when beta · clip < 1):

    z_{i,t} = clip((m_{i,t} − mean(m)) / (std(m) + 1e-8), −clip, clip)     mean, std over every response token
                                                                           of the batch
    A_{i,t} = A_i + beta · |A_i| · z_{i,t}

One more learner forward (megapo.trainer.update.answer_information), routing freely: Σ_i (|y_i| + 1) sequences
x ⊕ y_{i,<t} ⊕ a*, each scored on a*'s tokens only: O(|y|²) tokens per response. With `step_delimiter` the answer's
log-likelihood is taken only after each step (the token completing each delimiter, and the response's end:
process_rewards.step_ends) and a step's information is shared equally by its tokens (ASSUMPTION: the abstract speaks
of informative reasoning steps; per step the forward costs O(steps · |y|) tokens).

SPAE (Wu, Zhang, Chang, Zhang, Liu, Du 2026, Step Potential Advantage Estimation, arXiv:2601.03823) probes the
same forward after each step for a Step Potential Φ from the answer's correctness (Acc) and the model's confidence
(Conf), and shapes each step's tokens by Φ's differences and by a penalty once Φ has saturated (spae_advantages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from megapo.algorithms.registry import register


@dataclass
class IAPOOptions:
    option_field: ClassVar[bool] = True  # its refusals name algorithm.stages[i].<option> (pipeline._parse_one)

    beta: float = 0.5  # the weight of the standardized information in each token's advantage
    clip: float = 1.5  # |z| at most this (beta · clip < 1: a token never flips its sequence's sign)
    step_delimiter: str = ""  # "": the information of every token; else of every step, shared by its tokens

    def __post_init__(self):
        for name in ("beta", "clip"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name}: must be a finite number > 0, got {v!r}")
        if not isinstance(self.step_delimiter, str):
            raise ValueError(f"step_delimiter: must be a string, got {self.step_delimiter!r}")


@dataclass(frozen=True)
class AnswerProbe:
    """One response's probe: the prefix lengths `cuts`, and at each the log-probs of a*'s tokens after x ⊕ y_<t (and
    their next-token entropies where a stage reads them, else None)."""

    cuts: list[int]
    logp: list[Tensor]
    entropy: list[Tensor] | None = None


def prefix_cuts(length: int, step_ends: list[int] | None = None) -> list[int]:
    """The prefix lengths after which the answer's log-likelihood is taken: 0..length (every token), or 0 and one
    past each step's last token (`step_ends`, process_rewards.step_ends: the last is the response's end)."""
    if step_ends is None:
        return list(range(length + 1))
    return [0, *(e + 1 for e in step_ends)]


def prefix_answer_sequences(prompt: list[int], response: list[int], answer: list[int],
                            cuts: list[int]) -> list[list[int]]:
    """x ⊕ y_<t ⊕ a* for each prefix length t in `cuts`."""
    return [list(prompt) + list(response[:t]) + list(answer) for t in cuts]


def step_spans(cuts: list[int]) -> Tensor:
    """The token count of each step between consecutive prefix lengths of `cuts`."""
    return torch.as_tensor(cuts, dtype=torch.long).diff()


def token_information(answer_logps: list[float], cuts: list[int]) -> Tensor:
    """Per response token: (L_j − L_{j−1}) / (t_j − t_{j−1}) for the tokens t_{j−1} ≤ t < t_j, L_j =
    log π(a* | x, y_<t_j) at the prefix lengths t_j of `cuts` (every token: m_t = L_t − L_{t−1})."""
    spans = step_spans(cuts)
    return (torch.as_tensor(answer_logps, dtype=torch.float64).diff() / spans).repeat_interleave(spans)


def information_stats(information: list[Tensor]) -> tuple[Tensor, Tensor]:
    """The mean and (population) standard deviation of m over every response token of the batch; 0 where undefined."""
    flat = torch.cat(information) if information else torch.zeros(0, dtype=torch.float64)
    mean = flat.mean() if flat.numel() else flat.new_tensor(0.0)
    return mean, (flat.std(unbiased=False) if flat.numel() > 1 else flat.new_tensor(0.0))


@register(
    "iapo", "advantage_stage", "token",
    "He, Zhu, Shi, Zheng, Su, Wang, Guo, Li 2026, IAPO: Information-Aware Policy Optimization for Token-Efficient "
    "Reasoning (arXiv:2602.19049)",
    IAPOOptions,
)
def iapo_advantages(advantages: list, information: list[Tensor], o: IAPOOptions) -> list[Tensor]:
    """A_{i,t} = A_i + beta · |A_i| · clip((m_{i,t} − mean m) / (std m + 1e-8), −clip, clip), m_{i,t} =
    log π_old(a* | x, y_≤t) − log π_old(a* | x, y_<t), mean and std over every response token of the batch. A_i a
    number per sample, or per token where an earlier stage made it so (then A_{i,t} in its place)."""
    if len(advantages) != len(information):
        raise ValueError(f"information: {len(information)} samples for {len(advantages)} advantages")
    info = [torch.as_tensor(m, dtype=torch.float64) for m in information]
    mean, std = information_stats(info)
    out = []
    for a, m in zip(advantages, info):
        adv = torch.as_tensor(a, dtype=torch.float64).expand(m.shape)
        z = ((m - mean) / (std + 1e-8)).clamp(-o.clip, o.clip)
        out.append(adv + o.beta * adv.abs() * z)
    return out


def run_iapo_stage(batch: list, s, ctx) -> tuple[list[Tensor], dict]:
    """pipeline.STAGES' runner for `iapo`: per sample its per-token advantages; iapo/info_mean, the mean m over the
    batch's response tokens, and iapo/info_std."""
    if ctx.answer_information is None:
        raise ValueError("answer_information: stage iapo needs each response token's information about the answer "
                         "(update.advantage_stages)")
    info = [torch.as_tensor(m, dtype=torch.float64) for m in ctx.answer_information]
    for x, m in zip(batch, info):
        if m.numel() != len(x.tokens) - x.prompt_len:
            raise ValueError(f"answer_information: {m.numel()} values for a response of "
                             f"{len(x.tokens) - x.prompt_len} tokens")
    values = iapo_advantages([x.advantage for x in batch], info, s.options)
    mean, std = information_stats(info)
    return values, {"iapo/info_mean": float(mean), "iapo/info_std": float(std)}


# ----------------------------------------------------------------------------- SPAE


@dataclass
class SPAEOptions:
    option_field: ClassVar[bool] = True  # its refusals name algorithm.stages[i].<option> (pipeline._parse_one)

    step_delimiter: str = "\n"  # a step ends with the token completing each occurrence (and at the response's end)
    alpha: float = 0.5  # the weight of a step's potential difference in its tokens' advantage
    tau: float = 0.9  # the potential (in [−1, 1]) at which the reasoning state counts as saturated (the authors' 0.9)
    penalty: float = 0.5  # the share of outcome credit taken off (A > 0) or added (A < 0) after saturation

    def __post_init__(self):
        if not isinstance(self.step_delimiter, str) or not self.step_delimiter:
            raise ValueError(f"step_delimiter: must be a non-empty string, got {self.step_delimiter!r}")
        for name in ("alpha", "penalty", "tau"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name}: must be a finite number, got {v!r}")
        for name in ("alpha", "penalty"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")
        if self.penalty > 1:
            raise ValueError(f"penalty: must be at most 1 (a share of the outcome credit), got {self.penalty!r}")


def step_potential(answer_logp: Tensor, answer_entropy: Tensor) -> float:
    """Φ = 1.5·Acc·Conf + 0.5·Acc − Conf (the authors' code), Acc = the mean probability of a*'s tokens after the
    prefix (teacher-forced), Conf = exp(−their mean next-token entropy) (ASSUMPTION: along a* itself, where the
    paper averages both over N sampled probe continuations after a probe prompt)."""
    acc = float(torch.as_tensor(answer_logp, dtype=torch.float64).exp().mean())
    conf = math.exp(-float(torch.as_tensor(answer_entropy, dtype=torch.float64).mean()))
    return 1.5 * acc * conf + 0.5 * acc - conf


@register(
    "spae", "advantage_stage", "token",
    "Wu, Zhang, Chang, Zhang, Liu, Du 2026, Step Potential Advantage Estimation: Harnessing Intermediate Confidence "
    "and Correctness for Efficient Mathematical Reasoning (arXiv:2601.03823)",
    SPAEOptions,
)
def spae_advantages(advantages: list, potentials: list[Tensor], cuts: list[list[int]], o: SPAEOptions) -> list[Tensor]:
    """For the tokens t_{k−1} ≤ t < t_k of step k = 1..K (`cuts` [0, t_1, ..., t_K = |y|], `potentials` Φ at each cut,
    the prompt's unused): A_{i,t} = w_{i,k}·A_i + alpha·ΔΦ_k, ΔΦ_1 = 0 and ΔΦ_k = Φ_k − Φ_{k−1} (potential
    difference shaping, from the second step as the authors' code), w_{i,k} = 1 − penalty (A_i > 0) or 1 + penalty
    (A_i < 0) once Φ_j ≥ tau for some step j < k, else 1 (the saturation penalty; ASSUMPTION: the abstract's
    "penalty after the potential saturates" as a scaled outcome credit, less credit for checking after a solved state,
    more blame for steps that overturned one)."""
    if not len(advantages) == len(potentials) == len(cuts):
        raise ValueError(f"potentials: {len(potentials)} samples and {len(cuts)} cut lists for {len(advantages)} "
                         "advantages")
    out = []
    for a, phi, c in zip(advantages, potentials, cuts):
        phi = torch.as_tensor(phi, dtype=torch.float64)
        if phi.numel() != len(c):
            raise ValueError(f"potentials: {phi.numel()} values for {len(c)} cuts")
        spans = step_spans(c)
        after = phi[1:]  # Φ after steps 1..K
        delta = torch.cat([after.new_zeros(1), after.diff()])[:after.numel()]  # ΔΦ_1 = 0
        adv = torch.as_tensor(a, dtype=torch.float64).expand((int(spans.sum()),))
        scale = 1 - o.penalty * torch.sign(adv) * saturated_steps(after, o.tau).repeat_interleave(spans)
        out.append(scale * adv + o.alpha * delta.repeat_interleave(spans))
    return out


def saturated_steps(after: Tensor, tau: float) -> Tensor:
    """Per step k = 1..K (`after`: Φ after each), 1.0 where Φ_j >= tau at some step j < k, else 0.0."""
    reached = (after >= tau).to(torch.float64).cummax(0).values
    return torch.cat([after.new_zeros(1), reached])[:after.numel()]


def run_spae_stage(batch: list, s, ctx) -> tuple[list[Tensor], dict]:
    """pipeline.STAGES' runner for `spae`: per sample its per-token advantages; spae/saturated_frac, the share of
    response tokens in steps after the potential saturated, and spae/final_potential, the mean Φ at the end."""
    if ctx.answer_steps is None:
        raise ValueError("answer_steps: stage spae needs the reference answer's log-probs and entropies after each "
                         "step (update.advantage_stages)")
    potentials = [torch.tensor([step_potential(lp, h) for lp, h in zip(p.logp, p.entropy)], dtype=torch.float64)
                  for p in ctx.answer_steps]
    cuts = [p.cuts for p in ctx.answer_steps]
    values = spae_advantages([x.advantage for x in batch], potentials, cuts, s.options)
    tokens = sum(c[-1] for c in cuts)
    after = sum(float((step_spans(c) * saturated_steps(phi[1:], s.options.tau)).sum())
                for phi, c in zip(potentials, cuts))
    return values, {"spae/saturated_frac": after / tokens if tokens else 0.0,
            "spae/final_potential": float(torch.stack([p[-1] for p in potentials]).mean()) if potentials else 0.0}
