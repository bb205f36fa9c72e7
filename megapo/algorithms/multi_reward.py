"""Multi-reward advantages: GDPO's reward-decoupled normalisation and MRTPO's reward-specific token credit.

GDPO (Liu et al. 2026, Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL Optimization,
arXiv:2601.05242) normalises each reward component within the prompt's group on its own, sums them and normalises
the sum over the batch, so that different reward combinations keep distinct advantages; every token of a response
gets the same advantage. MRTPO (Each Reward to Its Relevant Tokens: Reward-Specific Token-Level Credit Assignment for
Multi-Reward RL; its arXiv id and code were not found) assigns each reward's advantage to the tokens relevant to it:
the policy replays its own response with and without that reward's verifier information in the prompt, and the
per-token Jensen-Shannon distance between the two next-token distributions weighs the reward's advantage over the
response's tokens.

The components and their verifier information come from the task (megapo.tasks.components, Task.components), per
sample at the update (megapo/trainer/multi_reward.py, the input reward_components); the distances from one learner
pass that packs each response with its variant per component (Learner.response_js_distances, the input
old_js_distance). The stages gdpo and mrtpo
(algorithm.stages) replace the estimator's advantages with theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.registry import register
from megapo.algorithms.self_distill import _check_template

EPS = 1e-4  # GDPO's released code: (r − mean) / (std + 1e-4), in the groups and over the batch
# Assumption (ours): where the verifier information goes; as the self-distillation stages' hint, before the prompt
DEFAULT_TEMPLATE = "Verifier: {hint}\n{prompt}"
GDPO_PAPER = ("Liu, Dong, Lu, Diao, Belcak, Liu, Chen, Yin, Wang, Cheng, Choi, Kautz and Molchanov 2026, GDPO: Group "
              "reward-Decoupled Normalization Policy Optimization for Multi-reward RL Optimization (arXiv:2601.05242); "
              "the normalisation as the authors' released code computes it (NVlabs/GDPO, trl grpo_trainer)")
MRTPO_PAPER = ("MRTPO: Each Reward to Its Relevant Tokens: Reward-Specific Token-Level Credit Assignment for "
               "Multi-Reward RL (2026; arXiv id and code not found: the weighting rule is an assumption, marked) on "
               "GDPO's per-reward advantages (arXiv:2601.05242) (the stage mrtpo: one more learner forward "
               "of each response beside its variant per reward component)")


@dataclass(frozen=True)
class ComponentRewards:
    """Each sample's reward components (the input reward_components), in batch order."""

    names: tuple[str, ...]
    values: Tensor  # [N, K] float64
    information: list[list[str]]  # [N][K]: the text each component's verifier checked that sample against

    def __post_init__(self):
        n = len(self.information)
        if self.values.shape != (n, len(self.names)) or any(len(row) != len(self.names) for row in self.information):
            raise ValueError(f"values: [{n}, {len(self.names)}] with one information text per sample and component, "
                             f"got {tuple(self.values.shape)}")


def group_normalised(values: Tensor, group_size: int) -> Tensor:
    """[N, K] -> [N, K]: each component k normalised within each prompt's group of `group_size` contiguous samples,
    (r_{i,k} − mean_g r_k) / (std_g r_k + ε), std the unbiased one (torch.std), ε = 1e-4 (a component the whole group
    agrees on gives 0)."""
    n, k = values.shape
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2 or n % group_size:
        raise ValueError(f"group_size: must be an integer >= 2 dividing the {n} samples, got {group_size!r}")
    v = values.double().reshape(n // group_size, group_size, k)
    return ((v - v.mean(1, keepdim=True)) / (v.std(1, keepdim=True) + EPS)).reshape(n, k)


def batch_statistics(summed: Tensor) -> tuple[float, float]:
    """GDPO's batch-wise normalisation of the summed advantages: (mean, std (unbiased) + ε) over the batch."""
    if summed.numel() < 2:
        raise ValueError(f"values: GDPO's batch normalisation needs at least 2 samples, got {summed.numel()}")
    return float(summed.mean()), float(summed.std()) + EPS


@register("gdpo", "advantage_stage", "group", GDPO_PAPER)
def gdpo_advantages(values: Tensor, group_size: int) -> Tensor:
    """Per sample i with reward components r_{i,1..K}: Â_{i,k} = (r_{i,k} − mean_g r_k) / (std_g r_k + ε) within its
    prompt's group g (each component on its own: group_normalised), S_i = Σ_k Â_{i,k}, and the advantage
    A_i = (S_i − mean_B S) / (std_B S + ε) over the train batch B (std unbiased, ε = 1e-4, the authors' code; their
    reward weights are 1 here), the same at every token of the response. Replaces the estimator's advantages; the
    components are the task's (input reward_components: Task.components)."""
    summed = group_normalised(values, group_size).sum(-1)
    mean, std = batch_statistics(summed)
    return (summed - mean) / std


@dataclass
class MRTPOOptions:
    # the prompt x ⊕ c_k each response is replayed behind: {hint} the component's verifier information
    template: str = DEFAULT_TEMPLATE

    option_field = True  # refusals name the option's field (pipeline.parse_stages)

    def __post_init__(self):
        _check_template(self.template)


def relevance_weights(distance: Tensor, mask: Tensor) -> Tensor:
    """[K, T] JS distances of one response -> [K, T] weights: w_{k,t} = T' · d_{k,t} / Σ_{s policy} d_{k,s} over the
    T' policy tokens (`mask`), 0 at the others; a component with Σ d = 0 (no token moved) spreads evenly (w = 1)."""
    d = distance.double() * mask
    total = d.sum(-1, keepdim=True)
    count = mask.double().sum()
    even = mask.double().expand_as(d)
    return torch.where(total > 0, count * d / torch.where(total > 0, total, torch.ones_like(total)), even)


@register("mrtpo", "advantage_stage", "token", MRTPO_PAPER, MRTPOOptions)
def mrtpo_advantages(rewards: ComponentRewards, distances: list[Tensor], group_size: int, masks: list | None,
                     o: MRTPOOptions) -> tuple[list[Tensor], dict]:
    """Per response i and token t: A_{i,t} = (Σ_k Â_{i,k}·w_{i,k,t} − mean_B S) / (std_B S + ε), Â_{i,k} GDPO's
    group-normalised advantage of reward k (gdpo), S_i = Σ_k Â_{i,k} its sum and mean_B, std_B GDPO's batch
    statistics of it; w_{i,k,t} = T'_i · d_{i,k,t} / Σ_s d_{i,k,s}, d_{i,k,t} = JSD(π_old(·| x ⊕ c_{i,k}, y_<t),
    π_old(·| x, y_<t))^½ the Jensen-Shannon distance (natural log) between the next-token distributions with and
    without reward k's verifier information c_{i,k} in the prompt (`template`), over the T'_i policy tokens.
    Assumptions, marked: the weighting rule (each reward's advantage spread over the response in proportion to its
    distances, its mean over the response kept: with equal distances A_{i,t} is GDPO's advantage exactly; a reward
    whose information moves no token spreads evenly), GDPO's batch statistics taken on the sequence sums S_i, and the
    template, "Verifier: {hint}" on a line before the prompt, are ours (the paper's exact rule is not at hand).
    Returns the advantages (one float64 tensor per sample) and the metrics mrtpo/js_mean/<k> (each component's mean
    distance over the policy tokens) and mrtpo/weight_max."""
    n, k = rewards.values.shape
    if len(distances) != n:
        raise ValueError(f"distances: one [{k}, tokens] tensor per sample ({n}), got {len(distances)}")
    keep = []
    for i, d in enumerate(distances):
        if d.dim() != 2 or d.shape[0] != k:
            raise ValueError(f"distances[{i}]: expected [{k}, tokens], got {tuple(d.shape)}")
        m = None if masks is None or masks[i] is None else torch.as_tensor(masks[i]).reshape(-1).bool()
        if m is not None and m.numel() != d.shape[1]:
            raise ValueError(f"distances[{i}]: {d.shape[1]} tokens for {m.numel()} mask values")
        keep.append(torch.ones(d.shape[1], dtype=torch.bool) if m is None else m)
    per_reward = group_normalised(rewards.values, group_size)
    mean, std = batch_statistics(per_reward.sum(-1))
    weights = [relevance_weights(d, m) for d, m in zip(distances, keep)]
    out = [((per_reward[i][:, None] * w).sum(0) - mean) / std for i, w in enumerate(weights)]
    flat = torch.cat([d.double()[:, m] for d, m in zip(distances, keep)], dim=1)
    metrics = {f"mrtpo/js_mean/{name}": float(flat[j].mean()) if flat.shape[1] else 0.0
               for j, name in enumerate(rewards.names)}
    metrics["mrtpo/weight_max"] = max((float(w.max()) for w in weights if w.numel()), default=0.0)
    return out, metrics


# ----------------------------------------------------------------------------- the stages (pipeline.STAGES)


def _components(stage: str, ctx, n: int) -> ComponentRewards:
    rewards = ctx.components
    if rewards is None or rewards.values.shape[0] != n:
        raise ValueError(f"reward_components: stage {stage} needs each sample's reward components "
                         "(update.advantage_stages, from Task.components)")
    return rewards


def run_gdpo_stage(batch: list, s, ctx) -> tuple[list[Tensor], dict]:
    """GDPO: every token of a response gets its gdpo_advantages value; metric gdpo/batch_std (the std of the summed
    group-normalised components over the batch, the last division)."""
    rewards = _components(s.name, ctx, len(batch))
    adv = gdpo_advantages(rewards.values, ctx.group_size)
    values = [torch.full((len(x.tokens) - x.prompt_len,), a, dtype=torch.float64)
              for x, a in zip(batch, adv.tolist())]
    summed = group_normalised(rewards.values, ctx.group_size).sum(-1)
    return values, {"gdpo/batch_std": batch_statistics(summed)[1] - EPS}


def run_mrtpo_stage(batch: list, s, ctx) -> tuple[list[Tensor], dict]:
    """MRTPO: per-token advantages from each reward's GDPO advantage and its JS-distance relevance."""
    rewards = _components(s.name, ctx, len(batch))
    if ctx.js_distance is None:
        raise ValueError(f"old_js_distance: stage {s.name} needs the JS distances of each response with and without "
                         "each reward's verifier information (update.advantage_stages)")
    values, metrics = mrtpo_advantages(rewards, ctx.js_distance, ctx.group_size, [x.loss_mask for x in batch],
                                       s.options)
    return values, metrics
