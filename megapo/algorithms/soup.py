"""SOUP's token-level mix-policy samples (stage soup): off-policy prefixes from historical policies, on-policy
continuations.

Yang, Bi, Sun, Jin, Xiong 2026, SOUP: Token-level Single-sample Mix-policy Reinforcement Learning for Large Language
Models (Single-sample Mix-pOlicy Unified Paradigm, arXiv:2601.21476). Within one sample, the prefix y_<L was drawn
by a historical policy μ and the continuation y_≥L by the current policy behind x ⊕ y_<L; the loss weighs each
token by its own importance ratio:

    r_t = π_θ(y_t | x, y_<t) / μ(y_t | x, y_<t)        t < L  (prefix: the historical policy's stored log-prob)
    r_t = π_θ(y_t | x, y_<t) / π_old(y_t | x, y_<t)    t ≥ L  (continuation: the usual ratio)

and the objective's clip acts on r_t as on any ratio. Rank 0 draws the mixed samples (megapo/trainer/soup.py: the
prefix buffer, one engine call per step); this stage sets π_old := μ on each mixed sample's prefix tokens after the
old-log-prob pass, so every objective's ratio (and a mismatch correction's π_old/μ, then 1 there) reads it.

Assumptions (the public abstract does not pin these; ours): the historical policy is the policy of the step that
last drew the same prompt (a prefix buffer keyed by the prompt's place in the pool, kept in the checkpoint), so SOUP
mixes only where the prompt source repeats prompts (data epochs, a small pool); k = `mix` of a group's n samples
(its last k slots) are mixed when the buffer holds responses of that prompt from an earlier step, slot j taking
stored response j (cycling); the prefix is a fraction drawn uniformly in [prefix_min, prefix_max] of the stored
response (its end-of-sequence token excluded), at least one token and at most rollout.max_new_tokens − 1, drawn from
(train.seed, step, prompt) so a resumed run draws the same; the mixed sample's reward is its own (the verifier on
prefix ⊕ continuation) and the group's estimator treats it as any sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from megapo.algorithms.registry import register

STAGE = "soup"
DRAW_STREAM = 0x50  # the prefix-length draws' own random stream beside train.seed, the step and the prompt


@dataclass
class SoupOptions:
    option_field: ClassVar[bool] = True  # its refusals name algorithm.stages[i].<option> (pipeline._parse_one)

    mix: int = 2  # k: samples of each group (its last k) mixed when the buffer holds its prompt
    prefix_min: float = 0.2  # the prefix's share of the stored response, drawn uniformly in [prefix_min, prefix_max]
    prefix_max: float = 0.8

    def __post_init__(self):
        if isinstance(self.mix, bool) or not isinstance(self.mix, int) or self.mix < 1:
            raise ValueError(f"mix: must be an int >= 1 (samples mixed per group), got {self.mix!r}")
        for name in ("prefix_min", "prefix_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
                raise ValueError(f"{name}: must be a number in (0, 1] (a share of the stored response), got {v!r}")
        if self.prefix_min > self.prefix_max:
            raise ValueError(f"prefix_min: {self.prefix_min} exceeds prefix_max={self.prefix_max}")


def mixed_slots(n: int, mix: int) -> list[int]:
    """The slots of a group of n samples that get a historical prefix: its last min(mix, n − 1) (slot 0 stays on
    policy, so every group refills the buffer with a response of the current policy)."""
    k = max(0, min(mix, n - 1))
    return list(range(n - k, n))


def prefix_fractions(seed: int, step: int, prompt_index: int, k: int, lo: float, hi: float) -> list[float]:
    """The k prefix shares of one group at trainer step `step`: uniform in [lo, hi], seeded by
    (train.seed, step, prompt)."""
    rng = np.random.default_rng([int(seed), int(step), int(prompt_index), DRAW_STREAM])
    return [float(f) for f in rng.uniform(lo, hi, size=k)]


def prefix_length(response_len: int, stopped: bool, fraction: float, max_new_tokens: int) -> int:
    """The prefix cut from a stored response of `response_len` tokens (its end-of-sequence excluded when it
    `stopped`): round(fraction · usable), at least 1, at most usable and max_new_tokens − 1 (the continuation has at
    least one token to draw); 0 when nothing is usable."""
    usable = min(response_len - (1 if stopped else 0), max_new_tokens - 1)
    if usable < 1:
        return 0
    return max(1, min(usable, int(round(fraction * usable))))


@register(
    STAGE, "token_weight", "token",
    "Yang, Bi, Sun, Jin, Xiong 2026, SOUP: Token-level Single-sample Mix-policy Reinforcement Learning for Large "
    "Language Models (arXiv:2601.21476)",
    SoupOptions,
)
def soup_old_logp(old_logp: list[float], mu: list[float], prefix: int) -> list[float]:
    """Token-level mix-policy ratio: on a mixed sample's prefix y_<L (drawn by a historical policy μ, its stored
    log-probs) π_old := μ, so the objective's ratio there is r_t = π_θ/μ (clipped as the objective clips); on the
    continuation (drawn by the current policy behind x ⊕ y_<L) r_t = π_θ/π_old as usual. Assumption (ours): the
    historical policy is the one of the step that last drew the same prompt (a prefix buffer by prompt); the last
    `mix` samples of a group whose prompt the buffer holds are mixed, each prefix a share uniform in
    [prefix_min, prefix_max] of a stored response."""
    if prefix > len(old_logp) or prefix > len(mu):
        raise ValueError(f"soup: a prefix of {prefix} tokens in a response of {len(old_logp)} (μ: {len(mu)})")
    return [float(m) for m in mu[:prefix]] + [float(v) for v in old_logp[prefix:]]


def run_soup_stage(batch: list, s, ctx) -> dict:
    """The stage `soup` (its runner, pipeline._soup, returns these metrics and no advantages): π_old := μ
    (sample.rollout_logp, the historical policy's log-probs there) on each mixed sample's prefix (ctx.soup_prefix,
    tokens); soup/prefix_frac, the share of the batch's response tokens that are historical prefixes, and
    soup/prefix_log_ratio, the mean log π_old − log μ over them (how far the historical policy is from π_old, before
    the replacement). When the step mixed a sample, every sample's mismatch_mask (0 on its prefix, 1 after) keeps
    the learner's train/mismatch_* to the tokens this step's engine sampled: with π_old := μ there a prefix token
    would add ρ = 1, diluting them; otherwise it stays None."""
    if ctx.soup_prefix is None or len(ctx.soup_prefix) != len(batch):
        raise ValueError("soup: stage soup needs each sample's prefix length (update.advantage_stages)")
    mixed = any(ctx.soup_prefix)
    prefix_tokens, total, gap = 0, 0, 0.0
    for x, L in zip(batch, ctx.soup_prefix):
        n = len(x.tokens) - x.prompt_len
        total += n
        if mixed:  # every sample of the batch has one or none does (TrainSample's optional fields)
            x.mismatch_mask = [0] * int(L) + [1] * (n - int(L))
        if not L:
            continue
        if x.rollout_logp is None or x.old_logp is None:
            raise ValueError("soup: a mixed sample without its log-probs μ or π_old")
        gap += sum(float(o) - float(m) for o, m in zip(x.old_logp[:L], x.rollout_logp[:L]))
        x.old_logp = soup_old_logp(list(x.old_logp), list(x.rollout_logp), int(L))
        prefix_tokens += int(L)
    return {"soup/prefix_frac": prefix_tokens / max(total, 1),
            "soup/prefix_log_ratio": gap / prefix_tokens if prefix_tokens else 0.0}
