"""Stages iapo and spae (megapo/algorithms/information.py): token advantages from the reference answer's likelihood
after each response prefix (IAPO: each token's information about it; SPAE: each step's potential).

References: the advantage formula written out here with the statistics module; the information input through
update.advantage_stages against a closed form: the stand-in learner is a bigram model, under which
log π(a* | x, y_≤t) depends on y_t alone, so m_t = log P(a*_1 | y_t) − log P(a*_1 | y_{t−1}) (+ the same answer
tail on both sides, which cancels), and SPAE's Acc and Conf likewise; one real training step runs both stages on
the Megatron learner.
"""

from __future__ import annotations

import math
import random
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megapo.algorithms.information import (IAPOOptions, iapo_advantages, prefix_answer_sequences, prefix_cuts,
                                           token_information)
from megapo.algorithms.sample import TrainSample
from megapo.config import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
from algorithm_configs import make_cfg  # noqa: E402

VOCAB = 128


def iapo_loop(advantages, information, beta, clip):
    """The formula with plain floats: z over every token of the batch (population std), A + beta·|A|·clip(z)."""
    flat = [m for ms in information for m in ms]
    mean, std = statistics.fmean(flat), statistics.pstdev(flat)
    out = []
    for a, ms in zip(advantages, information):
        row = []
        for t, m in enumerate(ms):
            at = a[t] if isinstance(a, list) else a
            z = min(clip, max(-clip, (m - mean) / (std + 1e-8)))
            row.append(at + beta * abs(at) * z)
        out.append(row)
    return out


def test_iapo_against_its_formula():
    rng = random.Random(0)
    info = [[rng.gauss(0, 2) for _ in range(n)] for n in (3, 1, 5, 4)]
    adv = [1.2, -0.7, 0.0, [0.5, -0.5, 1.0, 2.0]]  # the last per token, as an earlier stage leaves it
    for beta, clip in [(0.5, 1.5), (0.9, 0.3)]:
        got = iapo_advantages(adv, [torch.tensor(m, dtype=torch.float64) for m in info], IAPOOptions(beta, clip))
        for g, w in zip(got, iapo_loop(adv, info, beta, clip)):
            assert g.tolist() == pytest.approx(w, abs=1e-12)
    # beta · clip < 1: every token keeps its sequence's sign, a zero advantage stays zero
    got = iapo_advantages(adv[:3], [torch.tensor(m, dtype=torch.float64) for m in info[:3]], IAPOOptions())
    assert (got[0] > 0).all() and (got[1] < 0).all() and (got[2] == 0).all()


def test_prefix_sequences_hold_every_prefix_then_the_answer():
    assert prefix_cuts(3) == [0, 1, 2, 3] and prefix_cuts(5, [1, 4]) == [0, 2, 5]
    assert prefix_answer_sequences([1, 2], [7, 8, 9], [5], prefix_cuts(3)) == [
        [1, 2, 5], [1, 2, 7, 5], [1, 2, 7, 8, 5], [1, 2, 7, 8, 9, 5]]
    # a step's information shared by its tokens: L = 0, 1, 4 after 0, 2 and 5 tokens
    assert token_information([0.0, 1.0, 4.0], [0, 2, 5]).tolist() == [0.5, 0.5, 1.0, 1.0, 1.0]


class CharTokenizer:
    """One token per character (id = its code point); id 0 the end of sequence, no text."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i == 0 else chr(i) for i in ids)


class BigramLearner:
    """learner.logprobs of a bigram model: log P(next | previous token), a fixed random table."""

    route_hook = None

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.log_softmax(torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64), dim=-1)
        self.calls = 0

    def logprobs(self, sequences, routes=None, with_entropy=False, prompt_lens=None):
        self.calls += 1
        return [self.table[torch.tensor(s[:-1]), torch.tensor(s[1:])] for s in sequences]


@pytest.mark.parametrize("delimiter", ["", ";"])
def test_the_trainer_computes_each_tokens_information_and_runs_iapo(delimiter):
    """Every token's information (no delimiter), or each step's shared by its tokens: "7;ab" is the steps "7;" and
    "ab", the others one step each."""
    from megapo.tasks.base import Example
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.rollout import Group
    from megapo.trainer.update import advantage_stages

    cfg = make_cfg(stages=[{"name": "iapo", "beta": 0.4, "clip": 2.0, "step_delimiter": delimiter}], n_samples=3)
    texts, answer, prompt = ["7;ab", "8", "x9y"], "42", [ord("p"), ord("q")]
    groups = [Group(Example("pq", answer), [SimpleNamespace(output_ids=[ord(c) for c in t]) for t in texts],
                    [1.0, 0.0, 0.5], correct=[True, False, False])]
    adv = [0.8, -1.1, 0.3]
    batch = [TrainSample(prompt + [ord(c) for c in t], 2, a) for t, a in zip(texts, adv)]
    learner = BigramLearner()
    metrics = advantage_stages(learner, batch, groups, cfg, 1, CharTokenizer(), StepTimer())
    assert learner.calls == 1  # one forward for every prefix of every sample
    first = ord(answer[0])
    info = []
    for t in texts:
        before = [prompt[-1]] + [ord(c) for c in t]  # the token a*'s first token follows, for t = 0..|y|
        cuts = [0, 2, 4] if delimiter and t == "7;ab" else ([0, len(t)] if delimiter else list(range(len(t) + 1)))
        row = []
        for a, b in zip(cuts, cuts[1:]):
            step = float(learner.table[before[b], first] - learner.table[before[a], first])
            row += [step / (b - a)] * (b - a)
        info.append(row)
    for x, w in zip(batch, iapo_loop(adv, info, 0.4, 2.0)):
        assert x.advantage == pytest.approx(w, abs=1e-10)
    flat = [m for ms in info for m in ms]
    assert metrics["iapo/info_mean"] == pytest.approx(statistics.fmean(flat), abs=1e-10)
    assert metrics["iapo/info_std"] == pytest.approx(statistics.pstdev(flat), abs=1e-10)
    with pytest.raises(ValueError, match="tokenizer"):
        advantage_stages(learner, batch, groups, cfg, 1, None, StepTimer())


@pytest.mark.parametrize("option, value", [("beta", 0), ("beta", -1.0), ("clip", 0.0), ("clip", float("inf")),
                                           ("beta", True), ("step_delimiter", 3)])
def test_bad_options_are_refused_naming_the_field(option, value):
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "iapo", option: value}])
    assert err.value.field == f"algorithm.stages[0].{option}"


def test_a_stages_config_reads_the_information_only():
    a = make_cfg(stages=[{"name": "iapo"}]).algorithm
    assert "answer_information" in a.stage_inputs() and not a.needs_old_stats()


def test_one_training_step_with_iapo_then_spae(tmp_path, tiny_moe):
    from train_runs import train_rows

    rows = train_rows(tmp_path, "iapo", f"model.path={tiny_moe}", "train.steps=1",
                      'algorithm.stages=[{name: iapo}, {name: spae, step_delimiter: ";"}]')
    assert rows[0]["step"] == 1 and math.isfinite(rows[0]["train/loss"])
    assert math.isfinite(rows[0]["iapo/info_mean"]) and rows[0]["iapo/info_std"] > 0, sorted(rows[0])
    assert -1 <= rows[0]["spae/final_potential"] <= 1 and 0 <= rows[0]["spae/saturated_frac"] <= 1, sorted(rows[0])


# ----------------------------------------------------------------------------- SPAE (the same probe, per step)


def spae_loop(advantage, phi, cuts, alpha, tau, penalty):
    """The SPAE formula with plain floats: per step k >= 1 its tokens get w·A + alpha·ΔΦ_k."""
    out = []
    for k in range(1, len(cuts)):
        delta = 0.0 if k == 1 else phi[k] - phi[k - 1]
        saturated = any(phi[j] >= tau for j in range(1, k))
        w = 1.0 if not saturated else (1 - penalty if advantage > 0 else 1 + penalty if advantage < 0 else 1.0)
        out += [w * advantage + alpha * delta] * (cuts[k] - cuts[k - 1])
    return out


def test_spae_against_its_formula():
    from megapo.algorithms.information import SPAEOptions, spae_advantages

    cuts = [[0, 2, 5, 6, 9], [0, 3], [0, 1, 2, 4]]
    phi = [[0.1, 0.3, 0.95, 0.2, 0.97], [0.5, 0.99], [-0.2, 0.92, 0.4, 0.1]]
    adv = [0.8, -1.3, -0.4]
    for alpha, tau, penalty in [(0.5, 0.9, 0.5), (2.0, 0.3, 1.0), (0.0, 0.9, 0.2)]:
        got = spae_advantages(adv, [torch.tensor(p, dtype=torch.float64) for p in phi], cuts,
                              SPAEOptions(";", alpha, tau, penalty))
        for g, a, p, c in zip(got, adv, phi, cuts):
            assert g.tolist() == pytest.approx(spae_loop(a, p, c, alpha, tau, penalty), abs=1e-12)


def test_step_potential_is_the_authors_combination():
    from megapo.algorithms.information import step_potential

    logp, entropy = torch.log(torch.tensor([0.5, 0.9], dtype=torch.float64)), torch.tensor([0.3, 0.1], dtype=torch.float64)
    acc, conf = 0.7, math.exp(-0.2)
    assert step_potential(logp, entropy) == pytest.approx(1.5 * acc * conf + 0.5 * acc - conf, abs=1e-12)


class BigramEntropyLearner(BigramLearner):
    def logprobs(self, sequences, routes=None, with_entropy=False, prompt_lens=None):
        logps = super().logprobs(sequences, routes, False, prompt_lens)
        if not with_entropy:
            return logps
        rows = self.table
        entropy = -(rows.exp() * rows).sum(-1)
        return logps, [entropy[torch.tensor(s[:-1])] for s in sequences]


def test_the_trainer_probes_each_step_and_runs_spae():
    """Steps at ";": after each, Acc and Conf of a* = "42" under the bigram stand-in in closed form (a*'s first token
    follows the step's last token, its second follows "4")."""
    from megapo.tasks.base import Example
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.rollout import Group
    from megapo.trainer.update import advantage_stages

    cfg = make_cfg(stages=[{"name": "spae", "step_delimiter": ";", "alpha": 0.7, "tau": -1.0, "penalty": 0.25}],
                   n_samples=2)
    texts, answer, prompt = ["7;ab;c", "x9"], "42", [ord("p"), ord("q")]
    groups = [Group(Example("pq", answer), [SimpleNamespace(output_ids=[ord(c) for c in t]) for t in texts],
                    [1.0, 0.0], correct=[True, False])]
    adv = [0.6, -0.6]
    batch = [TrainSample(prompt + [ord(c) for c in t], 2, a) for t, a in zip(texts, adv)]
    learner = BigramEntropyLearner()
    metrics = advantage_stages(learner, batch, groups, cfg, 1, CharTokenizer(), StepTimer())
    table = learner.table
    entropy = -(table.exp() * table).sum(-1)
    a1, a2 = ord("4"), ord("2")

    def phi(last):
        acc = (float(table[last, a1].exp()) + float(table[a1, a2].exp())) / 2
        conf = math.exp(-(float(entropy[last]) + float(entropy[a1])) / 2)
        return 1.5 * acc * conf + 0.5 * acc - conf

    for x, t, a, cuts in zip(batch, texts, adv, [[0, 2, 5, 6], [0, 2]]):
        before = [prompt[-1]] + [ord(c) for c in t]
        potentials = [phi(before[c]) for c in cuts]
        assert x.advantage == pytest.approx(spae_loop(a, potentials, cuts, 0.7, -1.0, 0.25), abs=1e-10)
    assert metrics["spae/saturated_frac"] == pytest.approx(4 / 8)  # tau -1: every step after the first
    for option, value in [("step_delimiter", ""), ("penalty", 1.5), ("alpha", -0.1), ("tau", math.nan)]:
        with pytest.raises(ConfigError) as err:
            make_cfg(stages=[{"name": "spae", "step_delimiter": ";", option: value}])
        assert err.value.field == f"algorithm.stages[0].{option}"
