"""NAT's Random Prefix Cutting with the compute saved: the response tokens after each cut leave the train batch.

Sang et al. 2026, Not all tokens are needed (NAT): token efficient reinforcement learning (arXiv:2603.06619). The
stage nat_prefix (megapo/algorithms/stages.py) draws a cut c_i per response and weighs the tokens t ≤ c_i by
Horvitz–Thompson's L_i/(L_i − t + 1), the tokens after it by 0. With its option cut (the default) the trainer then
ends every sample at prompt + c_i before the train steps (megapo.trainer.update.update_policy), so the learner packs,
runs forward and backward on fewer tokens; a causal model's log-probs at the kept tokens do not read the later
ones, so π_old from the train forward (on-policy) is unchanged there.

Dropping the tokens changes the loss normalisers, which count every policy token of the train step's batch; the
kept tokens' weights absorb that, so the policy loss (and its gradient) equal those of the uncut batch with the cut
tokens at weight 0:
    token-mean           w · N_kept / N_full, N the policy tokens of each train step's mini-batch
    seq-mean-token-mean  w · c_i / L_i per sample, c_i and L_i its kept and full policy tokens
    seq-mean-token-sum(-norm)  w unchanged (no token count in the normaliser)
A sample keeps at least its first policy token (loss_mask 1; at weight 0 past the cut), so the sequence count
global_seqs does not change either. Sequence-level objectives (their loss at a token reads the whole response),
objectives that read sentence_end (a sentence cut in two) and the other aggregations are refused at config time
(cut: false keeps the cut tokens at weight 0 instead). Assumption: the KL and entropy terms, which token weights do
not scale, average over the kept tokens.

The trainer draws the cuts once per step (draw_cut, from (train.seed, step) as stages.nat_prefix draws them) before
any pass reads the batch; the stage's weights then come from that draw (PrefixCut.weights), so the stage and the cut
see the same positions. Where nothing else needs the cut tokens (early_cut_blocker) the batch is cut right away, so
the old-log-prob pass, the reference pass and the stability pass (r3's free routing) run on the kept tokens only:
exact there, a causal model's log-probs (and routes) at a kept token reading only the tokens before it; the
engine-vs-learner mismatch metrics (mismatch/*) then measure the kept tokens. Where another token stage, a
batch-wide statistic of π_old (lp_reg's low_prob, hapo's entropy_score), the critic's GAE, a dense reward model or
a teacher reads the batch, those passes keep the full responses and the cut comes after the token stages.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from megapo.algorithms.sample import TOKEN_FIELDS, TOPK_FIELDS, MappingSample, TrainSample, as_train_samples

_STAGE = "nat_prefix"
# the aggregations whose normalisers the weights can absorb exactly (module docstring)
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ROUTE_FIELDS = ("routes", "engine_routes", "own_routes")  # one row per position fed to the model: [m <= tokens - 1]
# what a cut does to each TrainSample field: every field must be in one of these (tests/test_nat.py checks)
CUT_FIELDS = ("tokens",) + TOKEN_FIELDS + TOPK_FIELDS + ROUTE_FIELDS
KEPT_FIELDS = ("prompt_len",)


def cut_stage(stages: list):
    """The pipeline's nat_prefix stage when it cuts the batch (option cut), else None."""
    return next((s for s in stages if s.name == _STAGE and s.options.cut), None)


def cut_refusal(objective: str, loss_agg: str, objective_options: dict | None = None) -> str | None:
    """Why nat_prefix cannot drop the cut tokens under this loss (None: it can, exactly)."""
    from megapo.algorithms.aggregation import resolve
    from megapo.algorithms.loss import token_inputs
    from megapo.algorithms.registry import get

    if get("objective", objective).granularity != "token":
        return (f"objective {objective!r} is sequence-level (its loss at a kept token reads the cut ones); set cut: "
                "false to keep the cut tokens at weight 0")
    if "sentence_end" in token_inputs(objective, objective_options or {}):
        return f"objective {objective!r} reads sentence_end (a cut splits a sentence); set cut: false"
    agg = resolve(loss_agg, objective)
    if agg not in AGGREGATIONS:
        return (f"loss_agg {agg!r}: the weights absorb the normalisers of {', '.join(AGGREGATIONS)} only; set cut: "
                "false")
    return None


def kept_lengths(batch: list[TrainSample], cuts: list[int]) -> list[int]:
    """Response tokens each sample keeps: its cut, or up to its first policy token when the cut is before it."""
    out = []
    for s, c in zip(as_train_samples(batch), cuts):
        mask = s.loss_mask
        first = next((t + 1 for t, m in enumerate(mask) if m), c) if mask is not None else c
        out.append(max(int(c), first))
    return out


def policy_counts(batch: list[TrainSample], lengths: list[int]) -> list[int]:
    """Policy tokens (loss_mask 1; every token without one) among each sample's first `lengths` response tokens."""
    return [n if s.loss_mask is None else int(sum(1 for m in s.loss_mask[:n] if m))
            for s, n in zip(as_train_samples(batch), lengths)]


def normaliser_factors(full: list[int], kept: list[int], bounds: list[tuple[int, int]], agg: str) -> list[float]:
    """Per sample, the factor on its kept weights that keeps aggregation `agg`'s normalisers those of the uncut
    batch (module docstring); `full` / `kept`: its policy tokens before / after the cut, `bounds`: the [lo, hi)
    samples of each train step."""
    factors = [1.0] * len(full)
    if agg == "token-mean":
        for lo, hi in bounds:
            n_full = sum(full[lo:hi])
            factors[lo:hi] = [sum(kept[lo:hi]) / n_full if n_full else 1.0] * (hi - lo)
    elif agg == "seq-mean-token-mean":
        factors = [k / n if n else 1.0 for k, n in zip(kept, full)]
    elif agg not in AGGREGATIONS:
        raise ValueError(f"loss_agg: stage nat_prefix's cut keeps the normalisers of {', '.join(AGGREGATIONS)} "
                         f"only, got {agg!r}")
    return factors


def truncated(sample: TrainSample, keep: int, factor: float = 1.0) -> TrainSample:
    """A copy of `sample` ending at prompt + `keep` response tokens: every per-token field cut to `keep` values,
    the routes to the positions fed, token_weight times `factor`."""
    changes = {"tokens": list(sample.tokens[:sample.prompt_len + keep])}
    for name in TOKEN_FIELDS + TOPK_FIELDS:
        value = getattr(sample, name)
        if value is not None and not (name == "advantage" and isinstance(value, (int, float))):
            changes[name] = value[:keep]
    for name in ROUTE_FIELDS:
        value = getattr(sample, name)
        if value is not None:
            changes[name] = value[:sample.prompt_len + keep - 1]
    if sample.token_weight is not None:
        changes["token_weight"] = [float(w) * factor for w in sample.token_weight[:keep]]
    if isinstance(sample, MappingSample):
        return MappingSample({**sample.data, **changes})  # type: ignore[return-value]
    return dataclasses.replace(sample, **changes)


def kept_and_factors(batch: list[TrainSample], cuts: list[int], bounds: list[tuple[int, int]],
                     agg: str) -> tuple[list[int], list[float]]:
    """The response tokens each sample keeps after `cuts` (kept_lengths) and the factor on its kept weights for
    aggregation `agg` over the train steps' `bounds` (normaliser_factors)."""
    batch = as_train_samples(batch)
    keep = kept_lengths(batch, cuts)
    full = policy_counts(batch, [len(s.tokens) - s.prompt_len for s in batch])
    return keep, normaliser_factors(full, policy_counts(batch, keep), bounds, agg)


def cut_batch(batch: list[TrainSample], cuts: list[int], bounds: list[tuple[int, int]],
              agg: str) -> tuple[list[TrainSample], list[int]]:
    """`batch` cut after `cuts` response tokens per sample, the weights rescaled (kept_and_factors); and the
    response tokens each kept."""
    batch = as_train_samples(batch)
    keep, factors = kept_and_factors(batch, cuts, bounds, agg)
    return [truncated(s, k, f) for s, k, f in zip(batch, keep, factors)], keep


@dataclasses.dataclass(frozen=True)
class PrefixCut:
    """One step's draw of nat_prefix's cuts (draw_cut) and what follows from it, for every consumer: the stage's
    weights, the cut batch, the normaliser factors."""

    lengths: list[int]  # each sample's full response tokens
    cuts: list[int]  # c_i ~ Uniform{1, …, L_i} (stages.nat_prefix_cuts)
    keep: list[int]  # response tokens each sample keeps (kept_lengths)
    factors: list[float]  # per sample, the factor on its kept weights (normaliser_factors)
    early: bool  # the batch is cut before the old-log-prob pass (early_cut_blocker found nothing against it)

    def weights(self, lengths: list[int]) -> list[torch.Tensor]:
        """nat_prefix's Horvitz–Thompson weights of the drawn cuts (stages.nat_prefix_weights, over the full
        responses), each cut to the sample's `lengths` now: its full or its kept response tokens."""
        from megapo.algorithms.stages import nat_prefix_weights

        if len(lengths) != len(self.lengths) or any(n not in (full, k) for n, full, k in
                                                    zip(lengths, self.lengths, self.keep)):
            raise ValueError(f"nat_prefix: a batch of {list(lengths)} response tokens, not the drawn batch's "
                             f"{self.lengths} (kept: {self.keep})")
        return [w[:n] for w, n in zip(nat_prefix_weights(self.lengths, self.cuts), lengths)]

    def kept_frac(self) -> float:
        """The stage's metric nat_prefix/kept_frac: the response tokens at a weight above 0 (t <= c_i), of all."""
        return sum(self.cuts) / max(sum(self.lengths), 1)

    def metrics(self) -> dict:
        """nat_prefix/kept_tokens_frac: the response tokens the train steps see, of all."""
        return {f"{_STAGE}/kept_tokens_frac": sum(self.keep) / max(sum(self.lengths), 1)}


def early_cut_blocker(cfg) -> str | None:
    """What in the run (a RunConfig) reads the cut tokens before the train steps, so that the old-log-prob, reference
    and stability passes keep the full responses (None: nothing does, the batch is cut before them): another token
    stage (its value at a kept token may read the whole response or the whole batch), a batch-wide quantile of π_old
    (lp_reg's low_prob, hapo's entropy_score), the critic's GAE (its return at a token reads the values to the
    response's end), a dense reward model's process advantages or a teacher (per response token of the full
    batch)."""
    from megapo.algorithms.loss import token_inputs

    a = cfg.algorithm
    other = next((s.name for s in a.pipeline() if s.kind == "token" and s.name != _STAGE), None)
    if other is not None:
        return f"token stage {other}"
    read = {"low_prob", "entropy_score"} & set(token_inputs(a.objective, a.objective_options))
    if read:
        return f"objective {a.objective!r} reads {sorted(read)[0]}"
    if a.critic.enabled:
        return "algorithm.critic"
    if cfg.data.reward_model.enabled and cfg.data.reward_model.dense_mode() != "off":
        return "data.reward_model.dense"
    if a.distill.enabled:
        return "algorithm.distill"
    return None


def draw_cut(batch: list[TrainSample], seed: int, step: int, loss, bounds: list[tuple[int, int]],
             early: bool) -> PrefixCut:
    """nat_prefix's cuts at (seed, step), drawn once per step (stages.nat_prefix_cuts on numpy's
    default_rng([seed, step]), the uncut `batch` in order), with the kept lengths and the normaliser factors for
    `loss` (the run's LossSpec) over the train steps' `bounds`."""
    from megapo.algorithms import stages
    from megapo.algorithms.aggregation import resolve

    batch = as_train_samples(batch)
    lengths = [len(s.tokens) - s.prompt_len for s in batch]
    cuts = stages.nat_prefix_cuts(lengths, np.random.default_rng([int(seed), int(step)]))
    keep, factors = kept_and_factors(batch, cuts, bounds, resolve(loss.loss_agg, loss.objective))
    return PrefixCut(lengths, cuts, keep, factors, early)


def shorten(batch: list[TrainSample], cut: PrefixCut, free: list | None = None) -> tuple[list[TrainSample],
                                                                                          list | None]:
    """`batch` ended at prompt + cut.keep response tokens (truncated, weights as they are), and r3's free-routing
    log-probs `free` (per sample, one per response token) alike."""
    batch = as_train_samples(batch)
    out = [truncated(s, k) for s, k in zip(batch, cut.keep)]
    return out, None if free is None else [f[:k] for f, k in zip(free, cut.keep)]


def rescale(batch: list[TrainSample], cut: PrefixCut) -> None:
    """Each cut sample's token_weight (the stages' product, nat_prefix's among them) times its normaliser factor,
    in place: after the token stages, before the train steps."""
    for s, f in zip(as_train_samples(batch), cut.factors):
        n = len(s.tokens) - s.prompt_len
        weights = s.token_weight if s.token_weight is not None else [1.0] * n
        s.token_weight = [float(w) * f for w in weights]
