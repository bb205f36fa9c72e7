"""Stage bae's blocks by character counts (blockwise.cut_chars, char_block_ids) and the addition task's block rewards
(megapo/tasks/addition_blocks.py), against loops written out here: each token's block from the characters before
it, each half's reward digit by digit, and the stage's advantages on a hand-made group; the refusals naming the
field."""

from __future__ import annotations

import math

import pytest

from megapo.algorithms.blockwise import block_inputs, char_block_ids
from megapo.algorithms.pipeline import TokenContext, parse_stages, run_token_stages
from megapo.algorithms.sample import TrainSample
from megapo.config import ConfigError
from megapo.tasks.addition_blocks import digit_halves

OPTIONS = {"name": "bae", "blocks": ["high", "low"], "cut_chars": [2],
           "block_reward": "megapo.tasks.addition_blocks:digit_halves"}


def _loop_blocks(texts, cuts):
    """Token i's block: the number of cuts c (c <= the response's length) whose c-th character sits in a token
    before i."""
    holder, n = [], 0  # holder[j]: the token holding character j
    for i, t in enumerate(texts):
        for _ in t:
            holder.append(i)
            n += 1
    out = []
    for i in range(len(texts)):
        k = 0
        for c in cuts:
            if c <= n and holder[c - 1] < i:
                k += 1
        out.append(k)
    return out


@pytest.mark.parametrize("texts, cuts", [
    (["0", "5", "7", "9", ""], [2]),  # the bench's shape: four digit tokens and end-of-sequence
    (["0", "5", "7", "9", ""], [1, 2, 3]),  # one block per digit
    (["05", "79", ""], [2]),  # a cut at a token's end
    (["0", "57", "9", ""], [2]),  # a token across the cut stays in the earlier block
    (["0579", ""], [1, 2]),  # two cuts inside one token: the middle block holds no token
    (["0", ""], [2]),  # a response shorter than the cut: one block
    (["", "0", "5", "", "7"], [2, 4]),  # empty texts (a partial character, a special token)
    ([], [2]),
])
def test_char_block_ids_against_the_loop(texts, cuts):
    assert char_block_ids(texts, cuts) == _loop_blocks(texts, cuts)


def _loop_halves(response, answer):
    """high: both of the first two characters match; low: the remaining characters match one by one, same count."""
    high = len(response) >= 2 and all(response[j] == answer[j] for j in range(2))
    rest, want = response[2:], answer[2:]
    low = len(rest) == len(want) and all(rest[j] == want[j] for j in range(len(want)))
    return {"high": float(high), "low": float(low)}


@pytest.mark.parametrize("response", ["0579", "0578", "1579", "0679", "05790", "057", "05", "0", "", " 0579", "579"])
def test_digit_halves_against_the_loop(response):
    assert digit_halves(response, "0579") == _loop_halves(response, "0579")


class CharTokenizer:
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i == 0 else chr(i) for i in ids)


def _mean_std(xs):
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def test_the_stage_puts_each_half_advantage_on_its_digits():
    """One group against the formula written out: the high half against the group, the low half against the samples
    whose high half is equally right; the cut after the second digit, end-of-sequence in the low block."""
    texts = ["0579", "0578", "0679", "1579", "057"]
    batch = [TrainSample([5, 5] + [ord(c) for c in t] + [0], 2, 0.7) for t in texts]
    stages = parse_stages([dict(OPTIONS)])
    inputs = block_inputs([x.tokens[x.prompt_len:] for x in batch], ["0579"] * len(texts), [len(texts)],
                          CharTokenizer(), stages[0].options)
    ctx = TokenContext(group_size=len(texts), step=1, seed=0, kl_coef=0.0, blocks=inputs)
    run_token_stages(stages, batch, ctx)
    rows = [_loop_halves(t, "0579") for t in texts]
    for x, text, row in zip(batch, texts, rows):
        m, s = _mean_std([r["high"] for r in rows])
        high = (row["high"] - m) / (s + 1e-6)
        m, s = _mean_std([r["low"] for r in rows if (r["high"] >= 0.5) == (row["high"] >= 0.5)])
        low = (row["low"] - m) / (s + 1e-6)
        assert x.advantage[:2] == pytest.approx([high] * 2)
        assert x.advantage[2:] == pytest.approx([low] * (len(text) + 1 - 2))


@pytest.mark.parametrize("change, field", [
    ({"delimiters": ["|"]}, "cut_chars"),  # both ways of cutting
    ({"cut_chars": [2, 3]}, "cut_chars"),  # one cut per block boundary
    ({"cut_chars": [0]}, "cut_chars"),
    ({"cut_chars": ["2"]}, "cut_chars"),
    ({"cut_chars": None}, "delimiters"),  # neither
])
def test_bad_cuts_name_the_field(change, field):
    with pytest.raises(ConfigError) as err:
        parse_stages([{**OPTIONS, **change}])
    assert err.value.field == f"algorithm.stages[0].{field}", str(err.value)


def test_decreasing_cuts_are_refused():
    with pytest.raises(ConfigError) as err:
        parse_stages([{**OPTIONS, "blocks": ["a", "b", "c"], "cut_chars": [3, 2]}])
    assert err.value.field == "algorithm.stages[0].cut_chars"
