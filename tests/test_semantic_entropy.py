"""SENT (Cao et al. 2025, Efficient Reinforcement Learning with Semantic and Token Entropy for LLM Reasoning,
arXiv:2512.04359): the semantic-entropy curriculum (megapo.trainer.data.CurriculumPromptSource) and the KL on the
low-entropy tokens, stronger on their high-covariance part (stage low_entropy_kl, the loss's kl_weight term)."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from megapo.algorithms import entries, policy_loss
from megapo.algorithms.pipeline import TokenContext, parse_stages, run_token_stages
from megapo.algorithms.sample import as_train_samples
from megapo.algorithms.semantic_entropy import (LowEntropyKLOptions, curriculum_order, low_entropy_kl_weights,
                                                 semantic_entropy)
from megapo.cli import main
from megapo.trainer.data import CurriculumPromptSource, PromptSource

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from algorithm_configs import config_data, make_cfg  # noqa: E402


# ----------------------------------------------------------------------------- the curriculum


def _reference_entropy(answers):
    classes = {}
    for a in answers:
        key = "<none>" if a is None else "".join(a.split())
        classes[key] = classes.get(key, 0) + 1
    h = 0.0
    for c in classes.values():
        p = c / len(answers)
        h -= p * math.log(p)
    return h


@pytest.mark.parametrize("answers", [["4", "4", "4"], ["4", " 4", "5", None], ["1", "2", "3", "4"],
                                     [None, None, "x y", "xy", "7"]])
def test_semantic_entropy_is_the_loop(answers):
    assert semantic_entropy(answers) == pytest.approx(_reference_entropy(answers), abs=1e-15)


def test_order_is_low_to_high_stable_unmeasured_last():
    order = [5, 2, 7, 0, 3, 1]
    ent = {2: 0.7, 7: 0.0, 0: 0.7, 1: 0.2}
    expect = []
    for value in sorted(set(ent.values())):  # the loop: each entropy level in the shuffle's order
        expect += [i for i in order if ent.get(i) == value]
    expect += [i for i in order if i not in ent]
    assert curriculum_order(order, ent) == expect == [7, 1, 2, 0, 5, 3]


def _epoch(src, size):
    return src.next_batch(size)


def test_epoch_zero_is_the_shuffle_then_low_to_high():
    size = 6
    src = CurriculumPromptSource(size, seed=4)
    first = _epoch(src, size)
    assert first == PromptSource(size, seed=4).next_batch(size)
    answers = {0: ["1"] * 4, 1: ["1", "2", "3", "4"], 2: ["1", "1", "2", "2"], 3: ["9"] * 4, 4: ["1", "1", "1", "2"]}
    for i, a in answers.items():
        src.observe(i, a)  # prompt 5 not measured
    second = _epoch(src, size)
    h = {i: semantic_entropy(a) for i, a in answers.items()}
    assert [i for i in second if i in h] == sorted(h, key=lambda i: (h[i], second.index(i)))
    assert second[-1] == 5 and h[second[0]] == 0.0 and second[4] == 1


def test_resumed_curriculum_keeps_its_epochs_order():
    size = 8

    def answers(i, epoch):
        return [str((i * j + epoch) % (i % 4 + 1)) for j in range(4)]

    def run(src, batches, start=0):
        out = []
        for b in range(start, start + batches):
            batch = src.next_batch(3)
            out.append(batch)
            for i in batch:
                src.observe(i, answers(i, b))
        return out

    uninterrupted = run(CurriculumPromptSource(size, seed=1), 9)
    src = CurriculumPromptSource(size, seed=1)
    before = run(src, 4)  # stopped mid-epoch 1, after observations that the epoch's order must not see
    state = json.loads(json.dumps(src.state_dict()))
    resumed = CurriculumPromptSource(size, seed=1)
    resumed.load_state_dict(state)
    assert before + run(resumed, 5, start=4) == uninterrupted


def test_curriculum_config_and_refusals():
    from megapo.config import ConfigError, from_dict
    from megapo.trainer.config import RunConfig, _check_prompt_order
    from megapo.trainer.data import prompt_source

    def cfg(**data):
        d = config_data()
        d["data"].update(data)
        return from_dict(RunConfig, d)

    c = cfg(curriculum="semantic_entropy")
    c.data.validate()
    assert isinstance(prompt_source(c, [None] * 5), CurriculumPromptSource)
    with pytest.raises(ConfigError) as err:
        cfg(curriculum="by_length").data.validate()
    assert err.value.field == "data.curriculum"
    d = config_data()
    d["data"]["curriculum"] = "semantic_entropy"
    d["train"]["mode"] = "async"
    with pytest.raises(ConfigError) as err:
        _check_prompt_order(from_dict(RunConfig, d))
    assert err.value.field == "data.curriculum"


# ----------------------------------------------------------------------------- the low-entropy-token KL


def _reference_weights(entropy, logp, adv, o):
    """The paper's rule as loops over the batch's tokens (ties: earlier token first)."""
    tokens = [(h, lp, a) for hs, lps, a_s in zip(entropy, logp, adv) for h, lp, a in zip(hs, lps, a_s)]
    n = len(tokens)
    by_entropy = sorted(range(n), key=lambda t: (tokens[t][0], t))
    low = sorted(by_entropy[:max(1, int(n * o.entropy_quantile))])  # in batch order
    mean_a = sum(tokens[t][2] for t in low) / len(low)
    mean_lp = sum(tokens[t][1] for t in low) / len(low)
    cov = {t: (tokens[t][2] - mean_a) * (tokens[t][1] - mean_lp) for t in low}
    m = max(1, int(len(low) * o.cov_ratio))
    by_cov = sorted(low, key=lambda t: (cov[t], t))
    high_part = sorted(low, key=lambda t: (-cov[t], t))[:m]
    coef = [0.0] * n
    for t in low:
        coef[t] = o.kl_coef * o.base_scale
    for t in by_cov[:m]:
        coef[t] = o.kl_coef * o.low_cov_scale
    for t in high_part:
        coef[t] = o.kl_coef * o.high_cov_scale
    return coef


def _batch(seed=0, n=8):
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(3, 9, (n,), generator=g)]
    entropy = [torch.rand(k, generator=g, dtype=torch.float64) * 2 for k in lengths]
    logp = [-torch.rand(k, generator=g, dtype=torch.float64) * 3 for k in lengths]
    adv = [float(x) for x in torch.randn(n, generator=g, dtype=torch.float64)]
    return lengths, entropy, logp, adv


@pytest.mark.parametrize("options", [{}, {"cov_ratio": 0.1, "base_scale": 0.0, "low_cov_scale": 0.5},
                                     {"entropy_quantile": 0.3, "cov_ratio": 0.25, "kl_coef": 0.02}])
def test_weights_are_the_loop(options):
    o = LowEntropyKLOptions(**options)
    lengths, entropy, logp, adv = _batch()
    got = torch.cat(low_entropy_kl_weights(entropy, logp, [torch.tensor(a) for a in adv], o)).tolist()
    ref = _reference_weights([e.tolist() for e in entropy], [x.tolist() for x in logp],
                             [[a] * k for a, k in zip(adv, lengths)], o)
    assert got == pytest.approx(ref, abs=1e-15)
    assert sum(c > 0 for c in got) == max(1, int(sum(lengths) * o.entropy_quantile)) or o.base_scale == 0


def test_masked_tokens_get_no_weight_and_no_say():
    o = LowEntropyKLOptions(cov_ratio=0.2)
    lengths, entropy, logp, adv = _batch(1, 4)
    masks = [torch.tensor([1] * (k - 1) + [0]) for k in lengths]
    got = low_entropy_kl_weights(entropy, logp, [torch.tensor(a) for a in adv], o, masks=masks)
    assert all(w[-1] == 0 for w in got)
    kept = low_entropy_kl_weights([e[:-1] for e in entropy], [x[:-1] for x in logp], [torch.tensor(a) for a in adv], o)
    assert torch.cat([w[:-1] for w in got]).tolist() == torch.cat(kept).tolist()


def _padded(rows, width):
    return torch.stack([torch.cat([r, torch.zeros(width - len(r), dtype=torch.float64)]) for r in rows])


def test_loss_term_is_split_invariant():
    """4 micro-batches x 2 DP shards (one sequence each) sum to the one-batch loss: the weights are computed once on
    the whole batch, the term aggregated with the batch-global normaliser."""
    lengths, entropy, old, adv = _batch(2, 8)
    weights = low_entropy_kl_weights(entropy, old, [torch.tensor(a) for a in adv], LowEntropyKLOptions(cov_ratio=0.1))
    g = torch.Generator().manual_seed(9)
    logp = [o + 0.1 * torch.randn(len(o), generator=g, dtype=torch.float64) for o in old]
    width = max(lengths)
    mask = torch.stack([torch.arange(width) < k for k in lengths])
    per_token_adv = [torch.full((k,), a, dtype=torch.float64) for a, k in zip(adv, lengths)]
    args = dict(logp=_padded(logp, width), old=_padded(old, width), adv=_padded(per_token_adv, width),
                w=_padded(weights, width))
    tokens = int(mask.sum())

    def loss(rows):
        return policy_loss("ppo", args["logp"][rows], args["old"][rows], args["adv"][rows], mask[rows],
                           kl_weight=args["w"][rows], global_tokens=tokens, loss_agg="token-mean")

    whole, metrics = loss(slice(0, 8))
    parts = [loss(slice(i, i + 1)) for i in range(8)]
    assert float(sum(p[0] for p in parts)) == pytest.approx(float(whole), abs=1e-12)
    assert float(sum(p[1]["low_entropy_kl"] for p in parts)) == pytest.approx(float(metrics["low_entropy_kl"]),
                                                                                abs=1e-12)
    manual = sum(float((w * (lp - o).abs()).sum()) for w, lp, o in zip(weights, logp, old)) / tokens
    assert float(metrics["low_entropy_kl"]) == pytest.approx(manual, abs=1e-12)
    without, _ = policy_loss("ppo", args["logp"], args["old"], args["adv"], mask, global_tokens=tokens,
                             loss_agg="token-mean")
    assert float(whole - without) == pytest.approx(manual, abs=1e-12)


def test_stage_sets_kl_weight_on_the_whole_batch():
    stages = parse_stages([{"name": "low_entropy_kl", "cov_ratio": 0.1}])
    lengths, entropy, logp, adv = _batch(3, 4)
    batch = [{"tokens": [1] * (2 + k), "prompt_len": 2, "advantage": a, "old_logp": lp.tolist(),
              "old_entropy": e.tolist()} for k, a, lp, e in zip(lengths, adv, logp, entropy)]
    ctx = TokenContext(group_size=2, step=1, seed=0, kl_coef=0.0)
    metrics = run_token_stages(stages, as_train_samples(batch), ctx)
    expect = low_entropy_kl_weights(entropy, logp, [torch.tensor(a) for a in adv], stages[0].options)
    assert [b["kl_weight"] for b in batch] == [w.tolist() for w in expect]
    assert 0 < metrics["low_entropy_kl/frac"] <= 0.8 and "low_entropy_kl/coef_mean" in metrics


@pytest.mark.parametrize("option, value", [("kl_coef", -1.0), ("entropy_quantile", 0.0), ("cov_ratio", 1.5),
                                           ("high_cov_scale", float("nan"))])
def test_stage_refusals_name_the_option(option, value):
    from megapo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "low_entropy_kl", option: value}])
    assert err.value.field == f"algorithm.stages[0].{option}", str(err.value)


def test_listed_with_paper_and_formula(capsys):
    assert main(["objectives", "--formulas"]) == 0
    out = capsys.readouterr().out
    e = next(e for e in entries("token_weight") if e.name == "low_entropy_kl")
    assert "arXiv:2512.04359" in e.paper and e.paper in out and "assumption:" in e.formula
    assert e.formula.splitlines()[0].strip() in out
