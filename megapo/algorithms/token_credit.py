"""Token credit from group statistics: the token stages tempo, ktae, gtpo_trajectory (per-token advantages) and
tw_grpo (a per-token weight) of algorithm.stages (megapo/algorithms/pipeline.py declares their inputs).

Per-token advantages and weights from statistics over a group's responses (the samples of one prompt): their
token ids (sample.tokens after prompt_len), their sequence advantages, π_old's per-token log-probs or entropy.
Each function takes one group (GroupTokens) and returns one float64 tensor per response; `group_token_stage`
runs it over a whole train batch, group by group, so a sample's result depends on its own group only (not on
the batch's order, its other groups, or how the learner later splits it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.options import check_number
from megapo.algorithms.registry import get, register
from megapo.algorithms.stages import _padded


@dataclass
class GroupTokens:
    """One group's responses: their token ids, sequence advantages and (where a stage reads them) π_old's
    per-token log-probs / entropies, each one float64 tensor per response."""

    responses: list[list[int]]
    advantages: list[float]
    old_logp: list[Tensor] | None = None
    entropy: list[Tensor] | None = None


@dataclass
class TempoOptions:
    coef: float = 1.0  # λ: weight of the tree's TD correction

    def __post_init__(self):
        check_number("coef", self.coef, low=0.0)


def _common_prefix_lengths(responses: list[list[int]]) -> Tensor:
    """[n, n]: the number of leading response tokens responses i and k share (|y_i| on the diagonal)."""
    lengths = torch.tensor([len(r) for r in responses])
    width = int(lengths.max()) if len(responses) else 0
    ids = torch.full((len(responses), width), -1, dtype=torch.long)
    for i, r in enumerate(responses):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    rows = []
    for i in range(len(responses)):  # row by row: [n, width] at a time, not [n, n, width]
        differ = ids != ids[i]
        first = torch.where(differ.any(1), differ.to(torch.uint8).argmax(1), torch.full_like(lengths, width))
        rows.append(torch.minimum(first, torch.minimum(lengths, lengths[i])))
    return torch.stack(rows) if rows else torch.zeros(0, 0, dtype=torch.long)


def _at_least(depths: Tensor, weights: Tensor, top: int) -> Tensor:
    """[n, top + 1]: Σ_k weights_k·1[depths_{i,k} ≥ t] for t = 0 … top (a histogram of the depths, summed from
    the deep end)."""
    hist = torch.zeros(depths.shape[0], top + 2, dtype=torch.float64)
    hist.scatter_add_(1, depths, weights.expand_as(depths).to(torch.float64).contiguous())
    return hist.flip(1).cumsum(1).flip(1)[:, : top + 1]


@register(
    "tempo", "advantage_stage", "group",
    "Tran, Yao, Yu 2025, Exploiting Tree Structure for Credit Assignment in RL Training of LLMs: TEMPO "
    "(Tree-Estimated Mean Prefix Value for Policy Optimization) on Prefix-to-Tree (P2T) prefix values",
    TempoOptions,
)
def tempo(g: GroupTokens, o: TempoOptions) -> list[Tensor]:
    """Ã_{i,t} = A_i + λ·(V(y_{i,≤t}) − V(y_{i,<t})), V(p) = mean_{k∈D(p)} A_k, D(p) the group's responses that
    start with the prefix p (P2T: the group's responses as a prefix tree, a node's value the mean of its
    descendants' outcomes). The TD term is branch-gated: 0 where the node y_{i,<t} has no other descendant than
    those of y_{i,≤t} (no other continuation, no response ending there), so there Ã = A (GRPO); at a branch it
    moves credit to the token whose subtree did better than its siblings. Along a response the terms telescope:
    Σ_t (Ã_{i,t} − A_i) = λ·(V(y_i) − mean_k A_k).
    Assumption: the outcome aggregated over descendants is the estimator's sequence advantage A_k, for grpo
    (r_k − μ)/σ (a summary of the paper: the mean normalised reward of the descendants), so the TD term is the
    reward TD in the advantage's units; λ = 1 by default (ours); "same prefix" = the same response token ids
    from the response's start."""
    lengths = [len(r) for r in g.responses]
    adv = torch.tensor(g.advantages, dtype=torch.float64)
    shared, top = _common_prefix_lengths(g.responses), max(lengths, default=0)
    count = _at_least(shared, torch.ones_like(adv)[None, :], top)  # |D(y_{i,<t})|: k shares y_i's first t tokens
    value = _at_least(shared, adv[None, :], top) / count.clamp(min=1)
    td = torch.where(count[:, 1:] < count[:, :-1], value[:, 1:] - value[:, :-1], torch.zeros_like(value[:, 1:]))
    return [adv[i] + o.coef * td[i, :n] for i, n in enumerate(lengths)]


@dataclass
class GtpoTrajectoryOptions:
    amplify: float = 2.0  # factor on a conflict token's positive advantage
    entropy_max: float | None = None  # nats: responses whose mean π_old entropy exceeds it get no update (null: off)

    def __post_init__(self):
        check_number("amplify", self.amplify, low=1.0)
        if self.entropy_max is not None:
            check_number("entropy_max", self.entropy_max, above=0.0)

    @property
    def token_inputs(self) -> tuple[str, ...]:
        """π_old's entropy only for the filter."""
        return ("old_entropy",) if self.entropy_max is not None else ()


@register(
    "gtpo_trajectory", "advantage_stage", "group",
    "Simoni, Fontana, Rossolini, Saracino 2025, GTPO: Trajectory-Based Policy Optimization in Large Language "
    "Models (Group-relative Trajectory-based PO: conflict tokens, entropy filter); not the entropy-shaping GTPO of "
    "stage gtpo",
    GtpoTrajectoryOptions,
)
def gtpo_trajectory(g: GroupTokens, o: GtpoTrajectoryOptions) -> list[Tensor]:
    """A conflict token is a token id v at response position t that the group has both in a response with
    A > 0 and in one with A < 0 (y_{j,t} = y_{k,t} = v, A_j > 0 > A_k). There Ã_{i,t} = 0 if A_i < 0 (its negative
    update skipped) and Ã_{i,t} = amplify·A_i if A_i > 0; elsewhere Ã_{i,t} = A_i. A response whose mean π_old
    entropy (1/|y_i|)·Σ_t H_{i,t} exceeds entropy_max is filtered out: Ã_{i,·} = 0.
    Assumptions: the abstract's "opposite rewards" are opposite signs of the estimator's advantage; every
    response position counts, as the abstract says (the authors' public implementation takes only the leading
    run of conflict positions from the start and, aligned from the end, the trailing run, and adds an entropy
    penalty to the advantage: neither is built); amplify = 2 by default, the implementation's factor; the
    entropy threshold is a number given as entropy_max (off by default; the implementation's is 0.7 nats), not
    the paper's provable threshold; "filtered out" means no gradient (the response's tokens still count in the
    loss's normaliser)."""
    seen = {1: set(), -1: set()}
    for response, a in zip(g.responses, g.advantages):
        if a != 0:
            seen[1 if a > 0 else -1].update(enumerate(int(v) for v in response))
    conflict = seen[1] & seen[-1]
    out = []
    for i, (response, a) in enumerate(zip(g.responses, g.advantages)):
        if o.entropy_max is not None and len(response) and float(g.entropy[i].mean()) > o.entropy_max:
            out.append(torch.zeros(len(response), dtype=torch.float64))
            continue
        on_conflict = [(t, int(v)) in conflict for t, v in enumerate(response)]
        scale = o.amplify if a > 0 else 0.0
        out.append(torch.tensor([a * scale if c else a for c in on_conflict], dtype=torch.float64))
    return out


@dataclass
class KtaeOptions:
    coef: float = 1.0  # the score's bound: s ∈ (−coef, coef)
    fisher: float = 1.0  # α: weight of the Fisher exact test's significance
    info_gain: float = 1.0  # β: weight of the information gain
    term_frequency: bool = True  # add the BM25-style term-frequency contrast to the effect size

    def __post_init__(self):
        for name in ("coef", "fisher", "info_gain"):
            check_number(name, getattr(self, name), low=0.0)
        if not self.fisher + self.info_gain > 0:
            raise ValueError(f"info_gain: fisher + info_gain must be > 0, got {self.fisher} + {self.info_gain}")
        if not isinstance(self.term_frequency, bool):
            raise ValueError(f"term_frequency: must be true or false, got {self.term_frequency!r}")


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def fisher_p_value(a: int, b: int, c: int, d: int) -> float:
    """Two-sided Fisher exact test of the 2×2 table [[a, b], [c, d]]: Σ P(k) over the tables with the same margins
    no likelier than the observed one, P(k) = C(a+c, k)·C(b+d, a+b−k)/C(n, a+b) hypergeometric."""
    n, row, col = a + b + c + d, a + b, a + c

    def prob(k: int) -> float:
        return math.exp(_log_comb(col, k) + _log_comb(n - col, row - k) - _log_comb(n, row))

    observed = prob(a)
    return min(1.0, sum(p for p in map(prob, range(max(0, row + col - n), min(row, col) + 1))
                        if p <= observed * (1 + 1e-7)))


def _bits(p: float) -> float:
    return -p * math.log2(p) if p > 0 else 0.0


def information_gain(a: int, b: int, c: int, d: int) -> float:
    """H(Y) − H(Y | X) in bits for the 2×2 table of X (contains the token: rows a, b | c, d) and Y (correct:
    columns a, c | b, d)."""
    n = a + b + c + d
    h_y = _bits((a + c) / n) + _bits((b + d) / n)
    h_given = sum((x + y) / n * (_bits(x / (x + y)) + _bits(y / (x + y))) for x, y in ((a, b), (c, d)) if x + y)
    return h_y - h_given


def _tf_saturation(count: int, total: int, other_total: int, k1: float = 2.0, b: float = 0.5) -> float:
    """BM25's saturated term frequency of a token seen `count` times in `total` tokens, the length norm against
    the mean of the two sides' token totals."""
    f = count / total
    return f * (k1 + 1) / (f + k1 * (1 - b + b * total / ((total + other_total) / 2)))


def key_token_scores(responses: list[list[int]], correct: list[bool], o: KtaeOptions) -> dict[int, float]:
    """s(v) = coef·(2σ(z_v) − 1) per token id v of the group, z_v = (α·F_v + β·IG_v)·x_v/(α + β): F_v =
    exp(−2·p_v) (0 where p_v = 1), p_v the two-sided Fisher exact p-value and IG_v the information gain (bits) of
    the table (a, b | c, d) = (correct, other responses containing v | not containing it); x_v the signed effect
    size, Cohen's h = asin√(a/n₊) − asin√(b/n₋), plus with term_frequency tf₊/(tf₋ + 1e-5) − tf₋/(tf₊ + 1e-5),
    tf± BM25's saturated frequency of v among all tokens of the correct / other responses (k1 = 2, b = 0.5).
    {} when n₊ or n₋ is 0."""
    n_pos = sum(correct)
    n_neg = len(correct) - n_pos
    if not (n_pos and n_neg):
        return {}
    present: dict[int, list[int]] = {}
    counts: dict[int, list[int]] = {}
    totals = [0, 0]
    for response, c in zip(responses, correct):
        side = 0 if c else 1
        totals[side] += len(response)
        for v in response:
            counts.setdefault(int(v), [0, 0])[side] += 1
        for v in {int(x) for x in response}:
            present.setdefault(v, [0, 0])[side] += 1
    scores = {}
    for v, (a, b) in present.items():
        table = (a, b, n_pos - a, n_neg - b)
        p = fisher_p_value(*table)
        significance = math.exp(-2 * p) if p < 1 - 1e-12 else 0.0
        x = math.asin(math.sqrt(a / n_pos)) - math.asin(math.sqrt(b / n_neg))
        if o.term_frequency:
            tf_pos = _tf_saturation(counts[v][0], totals[0], totals[1]) if totals[0] else 0.0
            tf_neg = _tf_saturation(counts[v][1], totals[1], totals[0]) if totals[1] else 0.0
            x += tf_pos / (tf_neg + 1e-5) - tf_neg / (tf_pos + 1e-5)
        z = (o.fisher * significance + o.info_gain * information_gain(*table)) * x / (o.fisher + o.info_gain)
        scores[v] = o.coef * math.tanh(z / 2)  # = coef·(2σ(z) − 1), without exp's overflow
    return scores


@register(
    "ktae", "advantage_stage", "group",
    "Sun et al. 2025, KTAE: A Model-Free Algorithm to Key-Tokens Advantage Estimation in Mathematical Reasoning "
    "(Key-token Advantage Estimation)",
    KtaeOptions,
)
def ktae(g: GroupTokens, o: KtaeOptions) -> list[Tensor]:
    """Ã_{i,t} = A_i + s(y_{i,t}), s the key-token score of the token id (key_token_scores): a bounded, signed
    measure of how strongly containing the token is associated with a response being correct in the group,
    from a 2×2 contingency table per token id (Fisher exact test and information gain for the strength, Cohen's h
    and a term-frequency contrast for the sign and size), + where the token is more frequent among the correct
    responses; a group all correct or all wrong gets s = 0.
    The abstract names only "statistical analysis" of the tokens against rollout correctness, combined with the
    rollout advantage; the statistic, its constants and the additive combination here are taken from the
    authors' public implementation, not the abstract. Assumption: correct = A_k > 0 (the stage sees advantages,
    not rewards; with 0/1 rewards and grpo, dr_grpo or rloo it is the verifier's verdict, the implementation's
    reward > 0); the implementation's exclusion of one padding token id is not carried over."""
    scores = key_token_scores(g.responses, [a > 0 for a in g.advantages], o)
    return [torch.tensor([a + scores.get(int(v), 0.0) for v in response], dtype=torch.float64)
            for response, a in zip(g.responses, g.advantages)]


@dataclass
class TwGrpoOptions:
    max_weight: float = 1.4  # the weight of the group's most divergent position (the least gets 1)

    def __post_init__(self):
        check_number("max_weight", self.max_weight, low=1.0)


def _position_variance(probs: list[Tensor], lengths: list[int]) -> list[float]:
    """Per position t of the group's longest response: the population variance of p_{k,t} over the responses k
    that reach t (0 where only one does)."""
    width = max(lengths, default=0)
    p = _padded(probs, width, torch.float64)
    alive = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(torch.float64)
    count = alive.sum(0)
    mean = (p * alive).sum(0) / count
    return (((p - mean) ** 2 * alive).sum(0) / count).tolist()


@register(
    "tw_grpo", "token_weight", "group",
    "Dang et al. 2025, Reinforcing Video Reasoning with Focused Thinking: TW-GRPO's token weighting by intra-group "
    "variance (its soft multi-choice rewards and question-answer inversion are task and data, not a stage)",
    TwGrpoOptions,
)
def tw_grpo(g: GroupTokens, o: TwGrpoOptions) -> list[Tensor]:
    """w_{i,t} = 1 + (max_weight − 1)·(v_t − min_s v_s)/(max_s v_s − min_s v_s + 1e-8), the same for every response
    of the group at position t, v_t = (1/|K_t|)·Σ_{k∈K_t}(p_{k,t} − p̄_t)² the population variance of
    p_{k,t} = π_old(y_{k,t}) over the responses K_t that reach t (0 where only one does), min and max over the
    positions of the group's longest response. Positions where the group's samples agree (generic prefixes) get
    1, those where they diverge most max_weight. The weight multiplies the per-token loss; the normaliser is
    unchanged. The min-max map to [1, max_weight] and max_weight = 1.4 are the authors' public implementation's.
    Assumption: the abstract's information density "estimated by intra-group variance" is measured on π_old's
    probability of each sampled token at the same position; the implementation measures the divergence of the
    samples' full next-token distributions from their mean, which needs the learner's top-K logits (a seam not
    built)."""
    lengths = [len(r) for r in g.responses]
    var = _position_variance([torch.exp(lp.to(torch.float64)) for lp in g.old_logp], lengths)
    if not var:
        return [torch.ones(0, dtype=torch.float64) for _ in lengths]
    lo, hi = min(var), max(var)
    weight = [1.0 + (o.max_weight - 1.0) * (v - lo) / (hi - lo + 1e-8) for v in var]
    return [torch.tensor(weight[:n], dtype=torch.float64) for n in lengths]


GROUP_TOKEN_STAGES = {"tempo": "advantage_stage", "gtpo_trajectory": "advantage_stage", "ktae": "advantage_stage",
                      "tw_grpo": "token_weight"}  # name -> registry kind
READS_OLD_LOGP = ("tw_grpo",)


def sequence_advantages(name: str, advantages: list) -> list[float]:
    """One number per sample; ValueError where an earlier token stage already made them per token."""
    out = []
    for i, a in enumerate(advantages):
        if isinstance(a, (list, tuple, Tensor)) and torch.as_tensor(a).numel() != 1:
            raise ValueError(f"advantages[{i}]: stage {name} reads one sequence advantage per sample; an earlier "
                             "token stage made it per token (list it first among the token stages)")
        out.append(float(torch.as_tensor(a, dtype=torch.float64).reshape(-1)[0]))
    return out


def _per_token(name: str, values: list | None, lengths: list[int]) -> list[Tensor]:
    """One float64 tensor per sample, as long as its response; ValueError naming `name` otherwise."""
    out = []
    for i, (v, n) in enumerate(zip(values or [None] * len(lengths), lengths)):
        if v is None or len(v) != n:
            raise ValueError(f"{name}[{i}]: expected {n} values (one per response token), got "
                             f"{None if v is None else len(v)}")
        out.append(torch.as_tensor(v, dtype=torch.float64).reshape(-1))
    return out


def group_token_stage(name: str, responses: list, *, group_size: int, advantages: list | None = None,
                      old_logp: list | None = None, entropy: list | None = None, **options) -> list[Tensor]:
    """Stage `name` (GROUP_TOKEN_STAGES) on a train batch of `responses` (token ids per sample, groups of
    `group_size` contiguous), group by group: per-token advantages (advantage_stage) or weights (token_weight),
    one float64 tensor per sample. `advantages` one per sample (the advantage stages), `old_logp` / `entropy`
    π_old's per response token where the stage reads them."""
    if name not in GROUP_TOKEN_STAGES:
        raise ValueError(f"stage: unknown {name!r}; choose from {', '.join(GROUP_TOKEN_STAGES)}")
    entry = get(GROUP_TOKEN_STAGES[name], name, argument="stage")
    opts = entry.make_options(options)
    responses = [[int(v) for v in r] for r in responses]
    lengths = [len(r) for r in responses]
    if group_size < 1 or len(responses) % group_size:
        raise ValueError(f"group_size: {len(responses)} samples are no whole groups of {group_size}")
    adv = sequence_advantages(name, advantages) if entry.kind == "advantage_stage" else [0.0] * len(responses)
    if len(adv) != len(responses):
        raise ValueError(f"advantages: {len(adv)} for {len(responses)} samples")
    lp = _per_token("old_logp", old_logp, lengths) if name in READS_OLD_LOGP else None
    ent = _per_token("entropy", entropy, lengths) if "old_entropy" in getattr(opts, "token_inputs", ()) else None
    out: list[Tensor] = []
    for lo in range(0, len(responses), group_size):
        part = slice(lo, lo + group_size)
        out += entry.fn(GroupTokens(responses[part], adv[part], None if lp is None else lp[part],
                                    None if ent is None else ent[part]), opts)
    return out
