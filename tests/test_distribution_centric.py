"""Distribution-Centric Policy Optimization (Li et al. 2026, Distribution-Centric Policy Optimization Dominates
Exploration-Exploitation Trade-off, arXiv:2601.12730), the stage distribution_centric, against the formula written out
here as loops (never the functions' own outputs): the target temperature and mixing weight from the batch, the
advantages A' = (1 − α)·A + α·b·π^T_old/π_old, the learner's tempered log-probs against log_softmax(z/T) of the
full float64 logits, the loop's glue (one tempered pass on the replayed routes), split invariance of the loss on A',
a float64 finite-difference gradient, the refusals by field, the registry and the stability bench's variant."""

from __future__ import annotations

import math
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megapo.algorithms import policy_loss
from megapo.algorithms.distribution_centric import distribution_centric_advantages
from megapo.algorithms.sample import TrainSample
from megapo.config import ConfigError
from megapo.learner.logprobs import vocab_parallel_logprobs_at

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algorithm_configs import make_cfg  # noqa: E402
from objective_loops import assert_autograd_matches_fd  # noqa: E402
from one_rank import ONE, response_pass_stub  # noqa: E402

OPTS = dict(target_entropy=0.5, temp_high=1.2, temp_low=0.8, alpha_cap=0.1)


def ref_advantages(adv, old, logits, targets, correct, masks, o):
    """The paper's stage as loops: H = −mean log π_old over the batch's policy tokens, T by H vs H_0, α̃ =
    min(|H_0 − H|, c)/p, α = α̃/(1 + α̃) (0 without a correct response), A'_t = (1 − α)·A_t + α·b·π^T_old/π_old with
    π^T_old = softmax(z/T) written out over the vocabulary."""
    total, count = 0.0, 0
    for lp, m in zip(old, masks):
        for v, k in zip(lp, m):
            if k:
                total += v
                count += 1
    h = -total / count
    temp = o["temp_high"] if h <= o["target_entropy"] else o["temp_low"]
    p = sum(1 for c in correct if c) / len(correct)
    raw = min(abs(o["target_entropy"] - h), o["alpha_cap"]) / p if p > 0 else 0.0
    alpha = raw / (1 + raw)
    out = []
    for i in range(len(old)):
        row = []
        for t in range(len(old[i])):
            z = [x / temp for x in logits[i][t].tolist()]
            top = max(z)
            log_target = z[targets[i][t]] - top - math.log(sum(math.exp(x - top) for x in z))
            a = adv[i] if not isinstance(adv[i], list) else adv[i][t]
            row.append((1 - alpha) * a + alpha * (1.0 if correct[i] else 0.0) * math.exp(log_target - old[i][t]))
        out.append(row)
    return out, h, temp, alpha


def make_batch(seed, lengths=(4, 6, 3, 5), vocab=9, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    logits = [torch.randn(n, vocab, generator=gen, dtype=torch.float64) * scale for n in lengths]
    # the sampled tokens drawn from the distribution, so a peaked one has a low entropy estimate
    targets = [torch.multinomial(torch.softmax(z, -1), 1, generator=gen).squeeze(-1) for z in logits]
    old = [torch.log_softmax(z, -1).gather(-1, y[:, None]).squeeze(-1).tolist() for z, y in zip(logits, targets)]
    return logits, targets, old


def tempered(logits, targets, temp):
    return [torch.log_softmax(z / temp, -1).gather(-1, y[:, None]).squeeze(-1).tolist()
            for z, y in zip(logits, targets)]


@pytest.mark.parametrize("scale, correct", [(0.3, [True, False, True, False]), (12.0, [False, False, True, False]),
                                            (0.3, [False] * 4)])
def test_advantages_match_the_formula(scale, correct):
    """scale 0.3: a high-entropy batch (H > H_0: T = 0.8); scale 12: a peaked one (H <= H_0: T = 1.2); no correct
    response: α = 0, A' = A."""
    logits, targets, old = make_batch(1, scale=scale)
    adv = [0.7, -0.4, [0.1, -0.2, 0.3], 1.1]
    masks = [[1] * len(o) for o in old]
    masks[1][0] = 0
    want, h, temp, alpha = ref_advantages(adv, old, logits, [y.tolist() for y in targets], correct, masks, OPTS)
    got, metrics = distribution_centric_advantages(advantages=adv, old_logp=old,
                                                   tempered_logp=tempered(logits, targets, temp), correct=correct,
                                                   loss_mask=masks, **OPTS)
    for g, w in zip(got, want):
        assert g.tolist() == pytest.approx(w, abs=1e-12)
    assert metrics["distribution_centric/entropy"] == pytest.approx(h, abs=1e-12)
    assert metrics["distribution_centric/temperature"] == temp and metrics["distribution_centric/alpha"] == alpha
    assert (temp == 1.2) == (scale > 1) and (alpha == 0) == (not any(correct))


def test_learner_tempered_logp_reads_the_response_slots(monkeypatch):
    """Learner.response_tempered_logp's glue on a hand-made micro-batch (2 sequences at 2 and 3 selected slots, a
    padded vocabulary entry; the schedule stubbed): log_softmax(z/T) at each slot's target over the real vocabulary."""
    import megapo.learner.learner as learner_mod
    from megapo.learner.learner import Learner

    monkeypatch.setattr(learner_mod, "vocab_parallel_logprobs_at", partial(vocab_parallel_logprobs_at, group=ONE))
    V = 6
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4, V + 1, generator=gen, dtype=torch.float64) * 2
    logits[..., V] = 50.0  # padding: must not count
    select = torch.tensor([1, 2, 5, 6, 7])
    targets = torch.randint(0, V, (8,), generator=gen)
    mb = SimpleNamespace(select=select, targets=targets, order=[0, 1], sizes=[2, 3], head_selected=False)
    me = response_pass_stub(logits, V, mb)
    got = Learner.response_tempered_logp(me, [[1, 2, 3, 4], [1, 2, 3, 4, 5]], [2, 2], 1.2)
    flat = logits.reshape(-1, V + 1)[select, :V]
    want = [torch.log_softmax(flat[n] / 1.2, -1)[targets[select[n]]].item() for n in range(5)]
    assert got[0].tolist() == pytest.approx(want[:2], abs=1e-6) and got[1].tolist() == pytest.approx(want[2:], abs=1e-6)
    with pytest.raises(ValueError, match="^temperature:"):
        Learner.response_tempered_logp(me, [[1, 2, 3]], [1], 0.0)


def test_the_loop_takes_one_tempered_pass_on_the_replayed_routes():
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.update import advantage_stages

    logits, targets, old = make_batch(4, scale=12.0)
    correct = [True, False, False, True]
    batch = [TrainSample([1, 2] + y.tolist(), 2, a, old_logp=o, routes=f"routes{i}")
             for i, (y, o, a) in enumerate(zip(targets, old, [0.5, -0.5, -0.5, 0.5]))]
    calls = []

    class TemperedLearner:
        def response_tempered_logp(self, sequences, prompt_lens, temperature, routes=None):
            calls.append((sequences, prompt_lens, temperature, routes))
            return [torch.tensor(x, dtype=torch.float64) for x in tempered(logits, targets, temperature)]

    groups = [SimpleNamespace(rewards=[1.0, 0.0], samples=[None, None], privileged=False,
                              verdicts=lambda threshold: [True, False]),
              SimpleNamespace(rewards=[0.0, 1.0], samples=[None, None], privileged=False,
                              verdicts=lambda threshold: [False, True])]
    cfg = make_cfg(stages=[{"name": "distribution_centric"}], n_samples=2)
    metrics = advantage_stages(TemperedLearner(), batch, groups, cfg, 1, None, StepTimer())
    want, _, temp, _ = ref_advantages([0.5, -0.5, -0.5, 0.5], old, logits, [y.tolist() for y in targets], correct,
                                      [[1] * len(o) for o in old], OPTS)
    assert calls == [([s.tokens for s in batch], [2] * 4, temp, [f"routes{i}" for i in range(4)])]
    for s, w in zip(batch, want):
        assert s.advantage == pytest.approx(w, abs=1e-12)
    assert metrics["distribution_centric/temperature"] == temp


def loss_inputs(seed):
    logits, targets, old = make_batch(seed, lengths=(4, 6, 3, 5, 2, 6, 4, 3))
    correct = [i % 3 == 0 for i in range(8)]
    adv = [0.9, -0.3, -0.3, 0.9, -0.6, 0.2, 0.9, -0.3]
    masks = [[1] * len(o) for o in old]
    h_temp = ref_advantages(adv, old, logits, [y.tolist() for y in targets], correct, masks, OPTS)[2]
    got, _ = distribution_centric_advantages(advantages=adv, old_logp=old, tempered_logp=tempered(logits, targets,
                                             h_temp), correct=correct, **OPTS)
    width = max(len(o) for o in old)
    pad = lambda rows: torch.stack([torch.nn.functional.pad(torch.as_tensor(r, dtype=torch.float64),  # noqa: E731
                                                            (0, width - len(r))) for r in rows])
    o = pad(old)
    logp = o + torch.randn(o.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64) * 0.2
    mask = pad([[1.0] * len(r) for r in old]) > 0.5
    return logp, o, pad([g.tolist() for g in got]), mask


def test_ppo_on_the_stage_advantages_is_split_invariant():
    """The stage's batch statistics are taken once over the batch; PPO on A' over 4 micro-batches x 2 DP shards sums
    to the one-batch loss (token-mean, the batch's global token count) to 1e-12."""
    logp, old, adv, mask = loss_inputs(6)
    n = int(mask.sum())
    whole, _ = policy_loss("ppo", logp, old, adv, mask, loss_agg="token-mean", global_tokens=n)
    parts = 0.0
    for rank in range(2):
        rows = list(range(rank, logp.shape[0], 2))
        for micro in (rows[j::4] for j in range(4)):
            if micro:
                idx = torch.tensor(micro)
                parts = parts + policy_loss("ppo", logp[idx], old[idx], adv[idx], mask[idx], loss_agg="token-mean",
                                            global_tokens=n)[0]
    assert abs(float(parts) - float(whole)) < 1e-12


def test_loss_gradient_matches_float64_finite_differences():
    logp, old, adv, mask = loss_inputs(8)

    def loss(x):
        return policy_loss("ppo", x, old, adv, mask, loss_agg="token-mean")[0]

    assert_autograd_matches_fd(loss, logp, mask)


@pytest.mark.parametrize("option, value", [("temp_high", 0.0), ("temp_low", -1.0), ("target_entropy", -0.1),
                                           ("alpha_cap", float("nan"))])
def test_options_refused_naming_the_field(option, value):
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "distribution_centric", option: value}])
    assert err.value.field == f"algorithm.stages[0].{option}"


def test_stage_refuses_missing_inputs():
    with pytest.raises(ValueError, match="^correct:"):
        distribution_centric_advantages(advantages=[1.0], old_logp=[[-1.0]], tempered_logp=[[-1.0]], correct=None)
    with pytest.raises(ValueError, match=r"^tempered_logp\[0\]"):
        distribution_centric_advantages(advantages=[1.0], old_logp=[[-1.0, -2.0]], tempered_logp=[[-1.0]],
                                        correct=[True])


def test_registered_apart_from_the_dynamic_clipping_dcpo_and_in_the_bench():
    from megapo.algorithms.registry import entries
    from tools.bench import stability as st

    (entry,) = [e for e in entries("advantage_stage") if e.name == "distribution_centric"]
    assert "Distribution-Centric Policy Optimization" in entry.paper and "arXiv:2601.12730" in entry.paper
    assert "A'_{i,t} = (1 − α)·A_{i,t} + α·b_i·ρ_{i,t}" in entry.formula and "Assumptions:" in entry.formula
    assert "distribution_centric" in st.variant_names("distribution_centric")


def test_train_two_steps(tmp_path, tiny_moe):
    """`megapo train` with the stage on ppo: the learner's tempered pass on the tiny MoE, both steps update with a
    finite loss and log the stage's temperature and mixing weight."""
    from train_runs import train_rows

    rows = train_rows(tmp_path, "distribution_centric", f"model.path={tiny_moe}", "train.steps=2",
                      "data.prompts_per_step=4", "rollout.n_samples=4", "algorithm.objective=ppo",
                      "algorithm.stages=[{name: distribution_centric}]")
    assert len(rows) == 2
    assert all(math.isfinite(r["train/loss"]) and r["train/skipped_nonfinite"] == 0 for r in rows)
    assert all(r["distribution_centric/temperature"] in (0.8, 1.2) and 0 <= r["distribution_centric/alpha"] < 1
               for r in rows)
