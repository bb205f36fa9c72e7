"""Blockwise Advantage Estimation (the token stage `bae` of algorithm.stages): each objective's advantage on its own
text block only, later blocks baselined by the Outcome-Conditioned Baseline.

Pavlenko et al. 2026, Blockwise Advantage Estimation for Multi-Objective RL with Verifiable Rewards (arXiv:2602.10231).

A response is cut into B named blocks (`blocks`, e.g. [solution, confidence]) at `delimiters` (B − 1 strings: block
k + 1 starts after the token that completes delimiters[k], process_rewards.block_ids, the same segmentation as the
dense process rewards' steps). The reward interface gives one scalar per response (data.reward), so the stage takes
its per-block rewards from its own function, the smallest extension that leaves data.reward alone:

    block_reward: "module:function"     fn(response_text, answer) -> {block name: float, ...}, one per block

(the response decoded as data.reward sees it; every name of `blocks` present). A response with no delimiter text
(the built-in addition task's bare digits) is cut by character counts instead, `cut_chars` (B − 1 increasing ints:
block k ends with the token holding the cut_chars[k]-th character, char_block_ids). Assumption: the paper's blocks
are marked-up text segments; cutting by position is this implementation's extension for such responses.
block_inputs computes the blocks and rewards of a batch from its groups; the stage reads them as the input
`block_rewards` (pipeline.INPUTS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.options import check_choice, check_number
from megapo.algorithms.registry import register

PAPER = ("Pavlenko et al. 2026, Blockwise Advantage Estimation for Multi-Objective RL with Verifiable Rewards "
         "(arXiv:2602.10231), BAE with the Outcome-Conditioned Baseline")
SCALES = ("std", "none")


@dataclass
class BlockwiseOptions:
    option_field = True  # refusals name algorithm.stages[i].<option>
    blocks: list | None = None  # the blocks' names, in order (at least 2)
    delimiters: list | None = None  # len(blocks) − 1 strings: delimiters[k] ends block k
    # or, for responses with no delimiter text (the addition task's bare digits), len(blocks) − 1 increasing
    # character counts: block k ends with the token holding the response's cut_chars[k]-th character
    cut_chars: list | None = None
    block_reward: str = ""  # "module:function": fn(response, answer) -> {block name: reward}
    outcome_threshold: float = 0.5  # τ: the intermediate outcome o_i = 1[r_{i,1} >= τ]
    scale: str = "std"  # std: divide by the baseline set's population std (GRPO's); none: the difference alone
    eps: float = 1e-6

    def __post_init__(self):
        b = self.blocks
        if not (isinstance(b, (list, tuple)) and len(b) >= 2 and all(isinstance(x, str) and x for x in b)
                and len(set(b)) == len(b)):
            raise ValueError(f"blocks: must be a list of two or more distinct block names, got {b!r}")
        d = self.delimiters
        if self.cut_chars is not None:
            _check_cut_chars(self.cut_chars, d, len(b))
        elif not (isinstance(d, (list, tuple)) and len(d) == len(b) - 1 and all(isinstance(x, str) and x for x in d)):
            raise ValueError(f"delimiters: must be a list of len(blocks) − 1 = {len(b) - 1} non-empty strings, "
                             f"got {d!r}")
        r = self.block_reward
        if not (isinstance(r, str) and r.count(":") == 1 and all(r.split(":"))):
            raise ValueError(f"block_reward: must name a 'module:function' returning {{block name: reward}}, "
                             f"got {r!r}")
        check_number("outcome_threshold", self.outcome_threshold)
        check_choice("scale", self.scale, SCALES)
        check_number("eps", self.eps, above=0)


def _check_cut_chars(cuts, delimiters, n_blocks: int) -> None:
    """cut_chars: len(blocks) − 1 strictly increasing positive ints, and no delimiters beside them."""
    if delimiters is not None:
        raise ValueError(f"cut_chars: give delimiters or cut_chars, not both (delimiters={delimiters!r})")
    if not (isinstance(cuts, (list, tuple)) and len(cuts) == n_blocks - 1
            and all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in cuts)
            and all(x < y for x, y in zip(cuts, cuts[1:]))):
        raise ValueError(f"cut_chars: must be a list of len(blocks) − 1 = {n_blocks - 1} strictly increasing "
                         f"positive character counts, got {cuts!r}")


def char_block_ids(texts: list[str], cuts: list[int]) -> list[int]:
    """Each token's block 0 .. len(cuts): block k ends with the token holding the response's cuts[k]-th character
    (a token holding characters on both sides of a cut stays in the earlier block); a response shorter than a cut
    leaves the rest of it in the block before that cut. `texts`: process_rewards.token_texts' output."""
    owner = [i for i, t in enumerate(texts) for _ in t]  # the token holding each character
    ids, block, start = [0] * len(texts), 0, 0
    for c in cuts:
        if c > len(owner):
            break
        end = owner[c - 1]
        if end < start:  # the cut inside a token an earlier cut already closed: block k holds no token
            block += 1
            continue
        ids[start:end + 1] = [block] * (end + 1 - start)
        block, start = block + 1, end + 1
    ids[start:] = [block] * (len(texts) - start)
    return ids


def _baselined(values: Tensor, members: Tensor, scale: str, eps: float) -> Tensor:
    """(v − mean over members) / (population std over members + eps) (std) or without the division (none)."""
    ref = values[members]
    out = values - ref.mean()
    return out / (float(ref.std(unbiased=False)) + eps) if scale == "std" else out


@register("bae", "advantage_stage", "group", PAPER, BlockwiseOptions)
def outcome_conditioned_advantages(rewards: Tensor, threshold: float = 0.5, scale: str = "std",
                                   eps: float = 1e-6) -> Tensor:
    """One group's [G, B] block rewards r_{i,k} -> [G, B] block advantages. o_i = 1[r_{i,1} >= τ], the intermediate
    outcome the first block leaves. Block 1: A_{i,1} = (r_{i,1} − mean_g r_1)/(std_g r_1 + eps); block k >= 2 (the
    Outcome-Conditioned Baseline): A_{i,k} = (r_{i,k} − mean_{S_i} r_k)/(std_{S_i} r_k + eps) over the stratum
    S_i = {j in g: o_j = o_i} (population std; scale: none drops the division). Each token of block k of response i
    gets A_{i,k} in place of the estimator's advantage; tokens of a block a response never reached get none.
    Assumption: the abstract names the per-block advantages and a baseline from the group's samples stratified by a
    prefix-derived intermediate outcome; the outcome as the first block's reward >= τ, GRPO's std scaling within
    each set, and a stratum of one sample giving 0 are this implementation's, and so are blocks cut by character
    counts (cut_chars) for responses without delimiter text."""
    outcome = rewards[:, 0] >= threshold
    out = torch.empty_like(rewards)
    everyone = torch.ones_like(outcome)
    out[:, 0] = _baselined(rewards[:, 0], everyone, scale, eps)
    for k in range(1, rewards.shape[1]):
        for side in (True, False):
            stratum = outcome == side
            if bool(stratum.any()):
                out[stratum, k] = _baselined(rewards[:, k], stratum, scale, eps)[stratum]
    return out


# ----------------------------------------------------------------------------- the batch's blocks and rewards


@dataclass(frozen=True)
class BlockInputs:
    """The input block_rewards: per sample of the train batch (groups contiguous), each response token's block
    and the [B] block rewards, and the groups' sizes."""

    ids: list  # per sample: list[int], each response token's block 0 .. B − 1
    rewards: Tensor  # [N, B] float64
    group_sizes: list


def block_inputs(responses: list[list[int]], answers: list[str], group_sizes: list[int], tokenizer,
                 o: BlockwiseOptions, reward_fn=None) -> BlockInputs:
    """Each response's token blocks (cut at o.delimiters or o.cut_chars) and its block rewards from o.block_reward
    (or `reward_fn`) on its decoded text (end-of-sequence left out by the decoding) and its prompt's answer."""
    from megapo.algorithms.process_rewards import block_ids, token_texts

    if reward_fn is None:
        from megapo.config import import_function

        reward_fn = import_function(o.block_reward, "block_reward", "block reward")
    cache: dict = {}
    ids, rows = [], []
    for tokens, answer in zip(responses, answers):
        texts = token_texts(tokenizer, list(tokens), cache)
        ids.append(char_block_ids(texts, list(o.cut_chars)) if o.cut_chars is not None
                   else block_ids(texts, list(o.delimiters)))
        rows.append(_block_row(reward_fn("".join(texts), answer), o.blocks))
    return BlockInputs(ids, torch.tensor(rows, dtype=torch.float64).reshape(len(rows), len(o.blocks)),
                       list(group_sizes))


def _block_row(got, blocks: list) -> list[float]:
    if not isinstance(got, dict) or set(got) != set(blocks):
        raise ValueError(f"block_reward: must return {{block name: reward}} for exactly the blocks {list(blocks)}, "
                         f"got {got!r}")
    row = [float(got[b]) for b in blocks]
    if not all(math.isfinite(v) for v in row):
        raise ValueError(f"block_reward: rewards must be finite, got {got!r}")
    return row


def blockwise_token_advantages(inputs: BlockInputs, o: BlockwiseOptions) -> list[Tensor]:
    """Per sample, [L_i] float64: A_{i, block of t} for every response token t (group by group)."""
    if sum(inputs.group_sizes) != len(inputs.ids):
        raise ValueError(f"group_sizes: {sum(inputs.group_sizes)} samples in groups, {len(inputs.ids)} given")
    out, lo = [], 0
    for n in inputs.group_sizes:
        adv = outcome_conditioned_advantages(inputs.rewards[lo:lo + n], o.outcome_threshold, o.scale, o.eps)
        out.extend(adv[i][torch.tensor(inputs.ids[lo + i], dtype=torch.long)] for i in range(n))
        lo += n
    return out


def run_bae_stage(batch: list, s, ctx) -> tuple[list[Tensor], dict]:
    """pipeline.STAGES' runner for `bae`: per sample its per-token block advantages, and the mean block rewards."""
    if ctx.blocks is None:
        raise ValueError("block_rewards: stage bae needs each response's blocks and block rewards (block_inputs)")
    values = blockwise_token_advantages(ctx.blocks, s.options)
    for x, v in zip(batch, values):
        if len(v) != len(x.tokens) - x.prompt_len:
            raise ValueError(f"block_rewards: {len(v)} token blocks for a response of {len(x.tokens) - x.prompt_len}")
    return values, {f"bae/reward_{b}": float(ctx.blocks.rewards[:, k].mean()) for k, b in enumerate(s.options.blocks)}
