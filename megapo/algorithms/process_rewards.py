"""Dense rewards from a reward model (data.reward_model.dense: step | token): a process reward per step, turned into
a per-token process advantage added to the outcome advantage.

A causal score head gives a score at every position, so one forward of prompt + response yields the RM's score of
every prefix (megapo.learner.score.ScoreModel.prefix_scores). For sample i of a group g, response length L_i:

    s_i(t)   = RM(prompt_i + response_i[:t + 1])  for t = 0 .. L_i - 1;  s_i(-1) = RM(prompt_i)
    steps    = ends e_1 < ... < e_K = L_i - 1 (step: a token ends a step where the decoded response's text completes
               a `step_delimiter`; the last step ends at the last token. token: e_k = k - 1, K = L_i);  e_0 = -1
    r_{i,k}  = s_i(e_k) - s_i(e_{k-1})                                  the dense (process) reward of step k
    G_{i,t}  = Σ_{k: e_k >= t} r_{i,k} = s_i(L_i - 1) - s_i(e_{k(t)-1})   its return-to-go (γ = 1; k(t): t's step)
    Â_{i,t}  = (G_{i,t} - μ_g) / (σ_g + eps)      μ_g, σ_g: mean and population std of G over every response token
                                                   of every sample of g (eps = 1e-6)
    A_{i,t}  = A_{i,t}^outcome + coef · Â_{i,t}   (A^outcome: the estimator's advantage after algorithm.stages)

This follows PRIME (Cui et al. 2025, "Process Reinforcement through Implicit Rewards", arXiv:2502.01456): per-token
process rewards summed into a return-to-go (γ = 1) and whitened over tokens, the outcome term beside them. What
PRIME's public code does (verl's recipe/prime, compute_rloo_advantage_return): a leave-one-out baseline per group on
each reward source (each sample's mean process reward), the rewards summed, the return-to-go a reverse cumulative
sum, then whitened over the batch's response tokens. Here the rewards are Math-Shepherd-style per-step scores of a
classifier RM (the increment of its score over the step), and the baseline is the group's token mean instead of a
leave-one-out one.

assumption: the RM's score of a prefix estimates the value of having written it, so r_{i,k} is the step's change in
value and G_{i,t} telescopes to "final score minus the score before t's step": the same final score for every token
of a response, with the prefix before its step as the baseline.
assumption: with dense rewards the RM's score is not also added to the scalar reward (s_i(L_i - 1) is already in
every G_{i,t}); A^outcome is the verifier's (data.reward) alone.
assumption: a group's tokens are its baseline (GRPO's group, over tokens as OpenRLHF's token whitening), so a
group of identical process returns gives Â = 0.
Not built: PURE's min-form credit assignment (Cheng et al. 2025, "Stop Summation: Min-Form Credit Assignment Is All
Process Reward Model Needs for Reasoning": the value as the minimum of the future process rewards, not their sum),
which that paper finds harder for the policy to hack than the sum used here.
"""

from __future__ import annotations

import torch
from torch import Tensor

PAPER = ("Cui et al. 2025, Process Reinforcement through Implicit Rewards (PRIME), arXiv:2502.01456; "
         "Wang et al. 2024, Math-Shepherd (per-step rewards)")
DENSE_MODES = ("off", "step", "token")
EPS = 1e-6


# ----------------------------------------------------------------------------- steps


def token_texts(tokenizer, ids: list[int], cache: dict | None = None) -> list[str]:
    """The text each token adds to the decoded response, in order ("" for a token whose bytes end later, e.g. the
    first of a multi-byte character, and for special tokens). Fast path: each token decoded alone (`cache`: id ->
    text, shared across calls), used when those texts join to the whole response's decoding and none holds a
    partial character; else (a context-dependent decoding: a leading space, a character split over byte tokens)
    incremental_texts."""
    cache = {} if cache is None else cache
    alone = []
    for i in ids:
        if i not in cache:
            cache[i] = tokenizer.decode([i], skip_special_tokens=True)
        alone.append(cache[i])
    if not any("\ufffd" in t for t in alone) and "".join(alone) == tokenizer.decode(ids, skip_special_tokens=True):
        return alone
    return incremental_texts(tokenizer, ids)


def incremental_texts(tokenizer, ids: list[int]) -> list[str]:
    """token_texts decoded as streaming detokenizers do: each new token with the tokens of the text emitted just
    before it as context, held back while it ends in a partial character, in O(L) decode calls of bounded length."""
    texts: list[str] = []
    prefix, read = 0, 0  # decode window [prefix, end): [prefix, read) is the context, already emitted
    for end in range(1, len(ids) + 1):
        before = tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
        now = tokenizer.decode(ids[prefix:end], skip_special_tokens=True)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            texts.append("")  # nothing new yet, or an incomplete character: emitted with a later token
            continue
        texts.append(now[len(before):])
        prefix, read = read, end  # the chunk just emitted is the next token's context
    return texts


def step_ends(texts: list[str], delimiter: str) -> list[int]:
    """The token index that ends each step: the token whose text completes an occurrence of `delimiter` in the
    joined text (occurrences found left to right without overlap; several in one token end one step there), and
    always the last token (the last step ends at the response's end). `texts`: token_texts' output."""
    if not delimiter:
        raise ValueError("delimiter: must be a non-empty string")
    if not texts:
        return []
    return sorted(set(occurrence_ends(texts, delimiter)) | {len(texts) - 1})


def occurrence_ends(texts: list[str], text: str) -> list[int]:
    """The token index that completes each occurrence of `text` in the joined `texts` (token_texts' output), found
    left to right without overlap; [] for an empty `text`."""
    if not text:
        return []
    joined = "".join(texts)
    owner = [i for i, t in enumerate(texts) for _ in t]  # the token holding each character
    ends, at = [], joined.find(text)
    while at >= 0:
        ends.append(owner[at + len(text) - 1])
        at = joined.find(text, at + len(text))
    return ends


def block_ids(texts: list[str], delimiters: list[str]) -> list[int]:
    """Each token's block 0 .. len(delimiters): block k + 1 starts at the token after the one that completes the first
    occurrence of delimiters[k] after block k's own delimiter (as step_ends cuts steps); a delimiter not found leaves
    the rest of the response in the block before it. `texts`: token_texts' output."""
    if any(not (isinstance(d, str) and d) for d in delimiters):
        raise ValueError(f"delimiters: must be non-empty strings, got {delimiters!r}")
    joined = "".join(texts)
    owner = [i for i, t in enumerate(texts) for _ in t]  # the token holding each character
    ids, block, start, pos = [0] * len(texts), 0, 0, 0
    for d in delimiters:
        at = joined.find(d, pos)
        if at < 0:
            break
        end = owner[at + len(d) - 1]
        ids[start:end + 1] = [block] * (end + 1 - start)
        block, start, pos = block + 1, end + 1, at + len(d)
    ids[start:] = [block] * (len(texts) - start)
    return ids


def step_token_counts(ends: list[int]) -> list[int]:
    """Each step's token count from step_ends' output: e_1 + 1, e_2 - e_1, ..., e_K - e_{K-1}."""
    return [e - s for s, e in zip([-1] + list(ends), ends)]


def first_accepted_end(texts: list[str], ends: list[int], accept, delimiter: str = "") -> int:
    """The token count e_k + 1 through the first step whose prefix text `accept`s (a predicate on the text: e.g. the
    task's answer checker, reward >= data.correct_threshold); -1 when none. The prefix is the joined texts of tokens
    0 .. e_k less a `delimiter` it ends with (the answer before "\n" or ";" is read as a whole response's would be)."""
    for e in ends:
        text = "".join(texts[:e + 1])
        if accept(text[:-len(delimiter)] if delimiter and text.endswith(delimiter) else text):
            return e + 1
    return -1


# ----------------------------------------------------------------------------- rewards and advantages


def step_rewards(scores: Tensor, ends: list[int]) -> Tensor:
    """[K] r_k = s(e_k) - s(e_{k-1}) (module docstring); `scores`: [L + 1] float64, s(-1) (the prompt's) first, then
    s(0) .. s(L - 1); `ends`: the steps' last token indices, increasing, the last L - 1."""
    if len(scores) < 2 or not ends or ends[-1] != len(scores) - 2:
        raise ValueError(f"ends: the last step must end at the last response token ({len(scores) - 2}), got {ends}")
    at = torch.tensor([-1] + list(ends), dtype=torch.long) + 1  # indices into scores: s(-1) is scores[0]
    s = scores[at]
    return s[1:] - s[:-1]


def returns_to_go(rewards: Tensor, ends: list[int], length: int) -> Tensor:
    """[L] G_t = Σ_{k: e_k >= t} r_k: each token gets the sum of its own step's reward and every later one's."""
    suffix = torch.flip(torch.cumsum(torch.flip(rewards, [0]), 0), [0])  # suffix[k] = Σ_{k' >= k} r_k'
    step_of = torch.zeros(length, dtype=torch.long)
    start = 0
    for k, e in enumerate(ends):
        step_of[start:e + 1] = k
        start = e + 1
    return suffix[step_of]


def process_advantages(scores: list[Tensor], ends: list[list[int]], group_sizes: list[int],
                       eps: float = EPS) -> tuple[list[Tensor], list[Tensor]]:
    """Â_{i,t} (module docstring) of every sample, groups of `group_sizes` contiguous samples, and each sample's step
    rewards r_{i,k}: ([L_i] float64 each, [K_i] float64 each). `scores[i]`: [L_i + 1], s_i(-1) first."""
    if sum(group_sizes) != len(scores) or len(ends) != len(scores):
        raise ValueError(f"group_sizes: {sum(group_sizes)} samples in groups, {len(scores)} scores, "
                         f"{len(ends)} step lists")
    rewards = [step_rewards(s.double(), e) for s, e in zip(scores, ends)]
    returns = [returns_to_go(r, e, len(s) - 1) for r, s, e in zip(rewards, scores, ends)]
    out: list[Tensor] = []
    lo = 0
    for n in group_sizes:
        flat = torch.cat(returns[lo:lo + n])
        mean, std = flat.mean(), flat.std(unbiased=False)
        out.extend((g - mean) / (std + eps) for g in returns[lo:lo + n])
        lo += n
    return out, rewards


def add_to_advantages(advantages: list, process: list[Tensor], coef: float) -> list[list[float]]:
    """A_t + coef · Â_t per response token: a sequence advantage is repeated over its tokens, an earlier token
    stage's per-token advantages kept as they are."""
    from megapo.algorithms.token_tensors import per_token_advantages

    base = per_token_advantages(advantages, [len(p) for p in process])
    return [(b + coef * p).tolist() for b, p in zip(base, process)]
