"""Blockwise Advantage Estimation (megapo/algorithms/blockwise.py, stage bae) against its formula written out here as
plain loops over hand-made groups of block rewards, the blocks of hand-made responses, split invariance, and the
refusals naming the field."""

from __future__ import annotations

import math

import pytest
import torch

from megapo.algorithms.blockwise import BlockwiseOptions, block_inputs, outcome_conditioned_advantages
from megapo.algorithms.pipeline import TokenContext, parse_stages, run_token_stages
from megapo.algorithms.process_rewards import block_ids
from megapo.algorithms.sample import TrainSample
from megapo.config import ConfigError

OPTIONS = {"name": "bae", "blocks": ["solution", "confidence"], "delimiters": ["</answer>"],
           "block_reward": "my_rewards:two_blocks"}


def _mean_std(xs):
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def _loop(rows, tau, scale, eps=1e-6):
    """A_{i,1} against the group; A_{i,k>1} against the samples whose first block reward is on the same side of τ."""
    out = [[0.0] * len(rows[0]) for _ in rows]
    for k in range(len(rows[0])):
        for i, row in enumerate(rows):
            peers = [r[k] for r in rows if k == 0 or (r[0] >= tau) == (row[0] >= tau)]
            m, s = _mean_std(peers)
            out[i][k] = (row[k] - m) / (s + eps) if scale == "std" else row[k] - m
    return out


GROUPS = [
    [[1.0, -0.1], [1.0, -0.4], [0.0, -0.9], [0.0, -0.2]],  # two right, two wrong: each stratum its own baseline
    [[1.0, -0.3], [1.0, -0.3], [1.0, -0.1]],  # all right: one stratum
    [[0.0, 0.5], [1.0, -0.5]],  # strata of one: their later block gets 0
    [[0.3, 0.2, 1.0], [0.7, 0.1, 0.0], [0.9, 0.4, 0.5]],  # three blocks, a partial first-block reward
]


@pytest.mark.parametrize("scale", ["std", "none"])
def test_outcome_conditioned_advantages_against_the_formula(scale):
    for rows in GROUPS:
        got = outcome_conditioned_advantages(torch.tensor(rows, dtype=torch.float64), 0.5, scale).tolist()
        want = _loop(rows, 0.5, scale)
        for g, w in zip(got, want):
            assert g == pytest.approx(w, abs=1e-9), (rows, got, want)
    got = outcome_conditioned_advantages(torch.tensor(GROUPS[2], dtype=torch.float64), 0.5)
    assert got[:, 1].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("text, delimiters, ids", [
    ("ab|cd", ["|"], [0, 0, 0, 1, 1]),  # the delimiter's token ends block 0
    ("abcd", ["|"], [0, 0, 0, 0]),  # never reached: one block
    ("a|b#c", ["|", "#"], [0, 0, 1, 1, 2]),
    ("a#b|c#d", ["|", "#"], [0, 0, 0, 0, 1, 1, 2]),  # a '#' before the '|' does not count
    ("ab||", ["|", "|"], [0, 0, 0, 1]),
])
def test_block_ids_hand_written(text, delimiters, ids):
    assert block_ids(list(text), delimiters) == ids


class CharTokenizer:
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i == 0 else chr(i) for i in ids)


def two_blocks(response, answer):
    """A solution block (right or wrong) and a confidence block (minus the Brier score of its stated number)."""
    solution, _, rest = response.partition("</answer>")
    right = float(solution.strip() == answer)
    conf = float(rest) if rest else 0.0
    return {"solution": right, "confidence": -(conf - right) ** 2}


def _batch(texts, prompt_len=2):
    samples = []
    for t in texts:
        ids = [ord(c) for c in t] + [0]
        samples.append(TrainSample([5] * prompt_len + ids, prompt_len, 0.7))
    return samples


RESPONSES = [["7</answer>0.9", "7</answer>0.2", "8</answer>0.8", "8</answer>0.1"], ["5</answer>1", "4</answer>0.5"]]


def _run(groups, answers):
    options = parse_stages([dict(OPTIONS)])[0].options
    flat = [t for g in groups for t in g]
    batch = _batch(flat)
    inputs = block_inputs([x.tokens[x.prompt_len:] for x in batch], [a for g, a in zip(groups, answers) for _ in g],
                          [len(g) for g in groups], CharTokenizer(), options, reward_fn=two_blocks)
    ctx = TokenContext(group_size=len(groups[0]), step=1, seed=0, kl_coef=0.0, blocks=inputs)
    metrics = run_token_stages(parse_stages([dict(OPTIONS)]), batch, ctx)
    return batch, inputs, metrics


def test_the_stage_puts_each_block_advantage_on_its_tokens():
    batch, inputs, metrics = _run(RESPONSES, ["7", "5"])
    rows = [[two_blocks(t, a)[b] for b in ("solution", "confidence")] for g, a in zip(RESPONSES, ["7", "5"]) for t in g]
    assert inputs.rewards.reshape(-1).tolist() == pytest.approx([v for r in rows for v in r])
    lo = 0
    for g in RESPONSES:
        want = _loop(rows[lo:lo + len(g)], 0.5, "std")
        for x, text, w in zip(batch[lo:lo + len(g)], g, want):
            cut = text.index("</answer>") + len("</answer>")  # the solution block's tokens, its delimiter included
            assert x.advantage[:cut] == pytest.approx([w[0]] * cut)
            assert x.advantage[cut:] == pytest.approx([w[1]] * (len(text) + 1 - cut))  # end-of-sequence included
        lo += len(g)
    assert metrics["bae/reward_solution"] == pytest.approx(sum(r[0] for r in rows) / len(rows))


def test_split_invariant():
    """Group statistics only: the batch's groups one call, or one call per group, give the same advantages."""
    whole, _, _ = _run(RESPONSES, ["7", "5"])
    parts = _run(RESPONSES[:1], ["7"])[0] + _run(RESPONSES[1:], ["5"])[0]
    assert [x.advantage for x in whole] == [x.advantage for x in parts]


@pytest.mark.parametrize("change, field", [
    ({"blocks": ["solution"]}, "blocks"),
    ({"blocks": ["a", "a"]}, "blocks"),
    ({"delimiters": ["|", "#"]}, "delimiters"),
    ({"block_reward": "no_colon"}, "block_reward"),
    ({"scale": "mad"}, "scale"),
    ({"eps": 0}, "eps"),
])
def test_bad_options_name_the_field(change, field):
    with pytest.raises(ConfigError) as err:
        parse_stages([{**OPTIONS, **change}])
    assert err.value.field == f"algorithm.stages[0].{field}", str(err.value)


def test_a_wrong_block_reward_and_a_run_without_block_rewards_are_refused():
    options = BlockwiseOptions(blocks=["solution", "confidence"], delimiters=["</answer>"], block_reward="m:f")
    with pytest.raises(ValueError, match="^block_reward: must return"):
        block_inputs([[ord("7"), 0]], ["7"], [1], CharTokenizer(), options, reward_fn=lambda r, a: {"solution": 1.0})


def test_objectives_formulas_list_it(capsys):
    from megapo.algorithms.pipeline import entry
    from megapo.cli import main

    assert main(["objectives", "--kind", "advantage_stage", "--formulas"]) == 0
    out = capsys.readouterr().out
    e = entry("bae")
    assert "bae" in out and e.paper in out and e.formula.splitlines()[0].strip() in out


def test_the_trainer_computes_the_block_rewards_and_runs_the_stage():
    """update.advantage_stages with bae listed: the block rewards come from the stage's block_reward function on the
    decoded responses and each group's answer, and each block's tokens get the formula's advantage."""
    from types import SimpleNamespace

    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.update import advantage_stages
    from algorithm_configs import make_cfg

    cfg = make_cfg(stages=[{**OPTIONS, "block_reward": "test_blockwise:two_blocks"}], n_samples=4)
    texts, answers = RESPONSES[0], ["7"]
    batch = _batch(texts)
    groups = [SimpleNamespace(example=SimpleNamespace(answer=a), samples=texts, privileged=False) for a in answers]
    advantage_stages(None, batch, groups, cfg, 1, CharTokenizer(), StepTimer())
    rows = [[two_blocks(t, "7")[b] for b in ("solution", "confidence")] for t in texts]
    for x, text, w in zip(batch, texts, _loop(rows, 0.5, "std")):
        cut = text.index("</answer>") + len("</answer>")
        assert x.advantage[:cut] == pytest.approx([w[0]] * cut)
        assert x.advantage[cut:] == pytest.approx([w[1]] * (len(text) + 1 - cut))
