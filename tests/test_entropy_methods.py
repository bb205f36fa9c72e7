"""Objectives that read π_old's per-token entropy (issue 14): dhpo alpha=entropy (DHPO's entropy-guided mixing),
sspo (sentence-level ratio, sentence-entropy clip bounds), ppo clip_mode=entropy (HAPO's asymmetric adaptive
clipping). Each against a plain loop written from its docstring's formula at float64, float64 central
differences through policy_loss, special cases that reduce to another objective, the old_entropy / sentence_end
plumbing (refused when missing, ignored when not asked for), bad options refused at config time naming the field,
and the loop's and learner's wiring."""

from __future__ import annotations

import math
import sys
from functools import partial

import pytest
import torch

from megapo.algorithms import policy_loss

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import algorithm_configs  # noqa: E402

config_data = partial(algorithm_configs.config_data, objective=None)  # RunConfig's default objective

F64 = torch.float64


def make_batch(seed, lengths, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    old = -torch.rand(len(lengths), width, generator=g, dtype=F64) * 2 - 0.05
    logp = old + torch.randn(len(lengths), width, generator=g, dtype=F64) * spread
    adv = torch.randn(len(lengths), 1, generator=g, dtype=F64).expand(-1, width).contiguous()
    ent = torch.rand(len(lengths), width, generator=g, dtype=F64) * 2.5
    zero = torch.zeros((), dtype=F64)
    return (torch.where(mask, logp, zero), torch.where(mask, old, zero), torch.where(mask, adv, zero), mask,
            torch.where(mask, ent, zero))


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def seq_token_mean(per_token, lengths):
    return sum(sum(row[:n]) / n for row, n in zip(per_token, lengths)) / len(lengths)


def token_mean(per_token, lengths):
    return sum(sum(row[:n]) for row, n in zip(per_token, lengths)) / sum(lengths)


# ----------------------------------------------------------------------------- dhpo alpha=entropy


def dhpo_reference(logp, old, adv, ent, lengths, scale, tl, th, sl, sh):
    out = []
    for i, n in enumerate(lengths):
        lr = [logp[i][t] - old[i][t] for t in range(n)]
        s = math.exp(sum(lr) / n)
        row = []
        for t in range(n):
            a = 1 - math.exp(-ent[i][t] / scale)
            r = math.exp(lr[t])
            rho = a * r + (1 - a) * s
            rho_c = a * clip(r, 1 - tl, 1 + th) + (1 - a) * clip(s, 1 - sl, 1 + sh)
            A = adv[i][t]
            row.append(max(-A * rho, -A * rho_c))
        out.append(row)
    return out


def test_dhpo_entropy_alpha_against_a_loop_and_finite_differences():
    lengths = [5, 3, 7, 1]
    logp, old, adv, mask, ent = make_batch(1, lengths)
    opts = dict(alpha="entropy", entropy_scale=0.7, tok_eps_low=0.15, tok_eps_high=0.25, seq_eps_low=0.01,
                seq_eps_high=0.02)
    loss, _ = policy_loss("dhpo", logp, old, adv, mask, old_entropy=ent, **opts)
    ref = dhpo_reference(logp.tolist(), old.tolist(), adv.tolist(), ent.tolist(), lengths, 0.7, 0.15, 0.25, 0.01,
                         0.02)
    assert loss.item() == pytest.approx(seq_token_mean(ref, lengths), rel=1e-12)
    assert torch.autograd.gradcheck(lambda x: policy_loss("dhpo", x, old, adv, mask, old_entropy=ent, **opts)[0],
                                    (logp.clone().requires_grad_(True),), eps=1e-6, atol=1e-8)


def test_dhpo_entropy_alpha_at_constant_entropy_is_the_constant_mixing():
    """α_t = 1 - e^{-H/τ}: a batch of constant entropy H gives alpha = 1 - e^{-H/τ} as a number; entropy 0 is
    the sequence branch alone (GSPO's ratio with the sequence clip)."""
    lengths = [4, 6, 2]
    logp, old, adv, mask, _ = make_batch(2, lengths)
    h = 0.4
    ent = torch.full_like(logp, h) * mask
    a = 1 - math.exp(-h)
    got, _ = policy_loss("dhpo", logp, old, adv, mask, alpha="entropy", old_entropy=ent)
    want, _ = policy_loss("dhpo", logp, old, adv, mask, alpha=a)
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    zero_h, _ = policy_loss("dhpo", logp, old, adv, mask, alpha="entropy", old_entropy=torch.zeros_like(logp),
                            seq_eps_low=3e-4, seq_eps_high=4e-4)
    gspo, _ = policy_loss("gspo", logp, old, adv, mask, eps_low=3e-4, eps_high=4e-4, loss_agg="seq-mean-token-mean")
    assert zero_h.item() == pytest.approx(gspo.item(), rel=1e-12)


def test_dhpo_entropy_alpha_overflowing_ratio_stays_finite():
    lengths = [3, 3]
    logp, old, adv, mask, ent = make_batch(3, lengths)
    logp = logp.clone()
    logp[0, 1] = old[0, 1] + 800.0  # e^800 overflows float64
    ent[0, 1] = 0.0  # a weight-0 token branch at the overflowing token
    x = logp.clone().requires_grad_(True)
    loss, _ = policy_loss("dhpo", x, old, adv.abs(), mask, alpha="entropy", old_entropy=ent)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()


# ----------------------------------------------------------------------------- sspo


def sentences_of(ends, n):
    """Sentence index of each of n tokens: a token flagged 1 ends its sentence."""
    out, k = [], 0
    for t in range(n):
        out.append(k)
        if ends[t] > 0.5:
            k += 1
    return out


def sspo_reference(logp, old, adv, ent, ends, lengths, el, eh, gmin, gmax):
    out = []
    for i, n in enumerate(lengths):
        seg = sentences_of(ends[i], n)
        lr = [logp[i][t] - old[i][t] for t in range(n)]
        h_mean = sum(ent[i][:n]) / n
        row = []
        for t in range(n):
            members = [u for u in range(n) if seg[u] == seg[t]]
            s = math.exp(sum(lr[u] for u in members) / len(members))
            hk = sum(ent[i][u] for u in members) / len(members)
            g = clip(hk / h_mean, gmin, gmax) if h_mean > 0 else 1.0
            lo = 1 - el * g
            A = adv[i][t]
            row.append(max(-A * s, -A * clip(s, lo, 1 + eh * g)))
        out.append(row)
    return out


def test_sspo_against_a_loop_and_finite_differences():
    lengths = [7, 4, 9, 2]
    logp, old, adv, mask, ent = make_batch(4, lengths, spread=0.1)
    ends = torch.zeros_like(logp)
    for i, t in [(0, 2), (0, 5), (1, 3), (2, 0), (2, 4), (2, 5), (3, 1)]:
        ends[i, t] = 1.0  # (1, 3) and (3, 1) end the response: no tail sentence there
    opts = dict(eps_low=0.03, eps_high=0.04, scale_min=0.6, scale_max=1.7, sentence_end_ids=[13, 29])
    loss, _ = policy_loss("sspo", logp, old, adv, mask, old_entropy=ent, sentence_end=ends, **opts)
    ref = sspo_reference(logp.tolist(), old.tolist(), adv.tolist(), ent.tolist(), ends.tolist(), lengths, 0.03,
                         0.04, 0.6, 1.7)
    assert loss.item() == pytest.approx(seq_token_mean(ref, lengths), rel=1e-12)
    assert torch.autograd.gradcheck(
        lambda x: policy_loss("sspo", x, old, adv, mask, old_entropy=ent, sentence_end=ends, **opts)[0],
        (logp.clone().requires_grad_(True),), eps=1e-6, atol=1e-8)


def test_sspo_packed_equals_padded():
    lengths = [5, 3, 6]
    logp, old, adv, mask, ent = make_batch(5, lengths, spread=0.1)
    ends = torch.zeros_like(logp)
    ends[0, 1] = ends[2, 2] = ends[2, 3] = 1.0
    opts = dict(eps_low=0.01, eps_high=0.01, sentence_end_ids=[1])
    padded, _ = policy_loss("sspo", logp, old, adv, mask, old_entropy=ent, sentence_end=ends, **opts)
    cu = torch.tensor([0, 5, 8, 14])
    packed, _ = policy_loss("sspo", logp[mask], old[mask], adv[mask], torch.ones(14, dtype=torch.bool),
                            cu_seqlens=cu, old_entropy=ent[mask], sentence_end=ends[mask], **opts)
    assert packed.item() == pytest.approx(padded.item(), rel=1e-12)


def test_sspo_without_sentence_ends_is_gspo():
    """No sentence-ending ids: the response is one sentence, its entropy is the response's (g = 1), and the
    loss is GSPO's with the same clip range."""
    lengths = [4, 8, 3]
    logp, old, adv, mask, ent = make_batch(6, lengths, spread=0.02)
    got, _ = policy_loss("sspo", logp, old, adv, mask, old_entropy=ent, eps_low=0.004, eps_high=0.006)
    want, _ = policy_loss("gspo", logp, old, adv, mask, eps_low=0.004, eps_high=0.006)
    assert got.item() == pytest.approx(want.item(), rel=1e-12)


def test_sentence_end_flags_from_token_ids():
    from megapo.algorithms.trust_region import sentence_end_flags

    assert sentence_end_flags([5, 13, 7, 29, 29, 4], [13, 29]) == [0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert sentence_end_flags([5, 6], []) == [0.0, 0.0]


# ----------------------------------------------------------------------------- ppo clip_mode=entropy


def test_ppo_entropy_clip_against_a_loop_and_finite_differences():
    lengths = [6, 2, 5]
    logp, old, adv, mask, ent = make_batch(7, lengths, spread=0.4)
    opts = dict(clip_mode="entropy", eps_low=0.1, eps_high=0.2, eps_low_wide=0.5, eps_high_wide=0.6,
                entropy_scale=0.8)
    loss, metrics = policy_loss("ppo", logp, old, adv, mask, old_entropy=ent, **opts)
    per_token, high = [], 0
    for i, n in enumerate(lengths):
        row = []
        for t in range(n):
            h = 1 - math.exp(-ent[i, t].item() / 0.8)
            el = 0.1 + (0.5 - 0.1) * (1 - h)
            eh = 0.2 + (0.6 - 0.2) * h
            r = math.exp(logp[i, t].item() - old[i, t].item())
            A = adv[i, t].item()
            row.append(max(-A * r, -A * clip(r, 1 - el, 1 + eh)))
            high += A > 0 and r > 1 + eh
        per_token.append(row)
    assert loss.item() == pytest.approx(token_mean(per_token, lengths), rel=1e-12)
    assert metrics["clipfrac_high"].item() == pytest.approx(high / sum(lengths), rel=1e-12)
    assert torch.autograd.gradcheck(lambda x: policy_loss("ppo", x, old, adv, mask, old_entropy=ent, **opts)[0],
                                    (logp.clone().requires_grad_(True),), eps=1e-6, atol=1e-8)


def test_ppo_entropy_clip_with_equal_ends_is_fixed_ppo():
    lengths = [3, 5]
    logp, old, adv, mask, ent = make_batch(8, lengths, spread=0.4)
    got, _ = policy_loss("ppo", logp, old, adv, mask, old_entropy=ent, clip_mode="entropy", eps_low=0.2,
                         eps_high=0.28, eps_low_wide=0.2, eps_high_wide=0.28)
    want, _ = policy_loss("ppo", logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    assert got.item() == pytest.approx(want.item(), rel=1e-12)


# ----------------------------------------------------------------------------- plumbing


def test_old_entropy_and_sentence_end_refused_missing_and_ignored_unasked():
    from megapo.algorithms.loss import token_inputs

    lengths = [3, 4]
    logp, old, adv, mask, ent = make_batch(9, lengths)
    for name, opts in [("dhpo", {"alpha": "entropy"}), ("sspo", {}), ("ppo", {"clip_mode": "entropy"})]:
        with pytest.raises(ValueError, match="old_entropy"):
            policy_loss(name, logp, old, adv, mask, **opts)
    with pytest.raises(ValueError, match="sentence_end"):
        policy_loss("sspo", logp, old, adv, mask, old_entropy=ent, sentence_end_ids=[3])
    plain, _ = policy_loss("dhpo", logp, old, adv, mask)
    ignored, _ = policy_loss("dhpo", logp, old, adv, mask, old_entropy=torch.full_like(logp, float("nan")),
                             sentence_end=torch.ones_like(logp))
    assert ignored.item() == plain.item()  # not asked for: not even checked
    assert token_inputs("dhpo", {"alpha": 0.5, "kl_coef": 0.1}) == ()
    assert token_inputs("dhpo", {"alpha": "entropy"}) == ("old_entropy",)
    assert token_inputs("sspo", {"sentence_end_ids": [2]}) == ("old_entropy", "sentence_end")
    assert token_inputs("not_registered", {"x": 1}) == ()


@pytest.mark.parametrize("objective, options, words", [
    ("dhpo", {"alpha": "entropyy"}, "alpha"),
    ("dhpo", {"alpha": 1.5}, "alpha"),
    ("dhpo", {"alpha": "entropy", "entropy_scale": 0}, "entropy_scale"),
    ("ppo", {"clip_mode": "entropi"}, "clip_mode"),
    ("ppo", {"clip_mode": "entropy", "eps_low_wide": 0.1}, "eps_low_wide"),
    ("ppo", {"clip_mode": "entropy", "eps_high": 0.3, "eps_high_wide": 0.2}, "eps_high_wide"),
    ("ppo", {"entropy_scale": -1.0}, "entropy_scale"),
    ("sspo", {"sentence_end_ids": ["."]}, "sentence_end_ids"),
    ("sspo", {"sentence_end_ids": 13}, "sentence_end_ids"),
    ("sspo", {"scale_min": 2.0, "scale_max": 1.0}, "scale_max"),
    ("sspo", {"scale_min": 0.0}, "scale_min"),
    ("sspo", {"eps_low": -0.1}, "eps_low"),
    ("sspo", {"sentence_ends": [1]}, "sentence_ends"),
])
def test_bad_options_refused_at_config_time(objective, options, words):
    from megapo.config import ConfigError, from_dict
    from megapo.trainer.config import RunConfig

    with pytest.raises(ConfigError) as err:
        from_dict(RunConfig, config_data(objective=objective, objective_options=options))._validate_algorithm()
    assert err.value.field == "algorithm.objective_options" and words in str(err.value)


@pytest.mark.parametrize("options", [{}, {"sentence_end_ids": []}, {"eps_low": 0.1, "eps_high": 0.1}])
def test_sspo_without_sentence_ends_refused_at_config_time(options):
    """A run's sspo must split responses into sentences: without sentence_end_ids the whole response is one
    sentence (GSPO with sspo's entropy-scaled clip), so the config refuses it, naming the option; policy_loss
    itself keeps the one-sentence form (test_sspo_without_sentence_ends_is_gspo)."""
    from megapo.config import ConfigError, from_dict
    from megapo.trainer.config import RunConfig

    with pytest.raises(ConfigError) as err:
        from_dict(RunConfig, config_data(objective="sspo", objective_options=options))._validate_algorithm()
    assert err.value.field == "algorithm.objective_options.sentence_end_ids"
    assert "one sentence" in err.value.message and "GSPO" in err.value.message and "'.'" in err.value.message
    from_dict(RunConfig, config_data(objective="sspo", objective_options={**options, "sentence_end_ids": [13]})
              )._validate_algorithm()
    # st_ppo's [] is documented as one turn per response (Turn-PPO): not refused
    from_dict(RunConfig, config_data(objective="st_ppo"))._validate_algorithm()


def test_config_asks_for_old_entropy_only_when_the_objective_reads_it():
    from megapo.config import from_dict
    from megapo.trainer.update import on_policy
    from megapo.trainer.config import RunConfig

    class FusedLearner:
        def train_step_on_policy(self, *a, **k):
            raise AssertionError("not called")

    for options, needs in [({"alpha": 0.5}, False), ({"alpha": "entropy"}, True)]:
        cfg = from_dict(RunConfig, config_data(objective="dhpo", objective_options=options))
        cfg._validate_algorithm()
        assert cfg.algorithm.needs_old_entropy() is needs
        assert on_policy(cfg, FusedLearner())  # the fused step takes π_old's entropy from its own forward


def test_train_samples_carry_sentence_end_flags_for_sspo():
    from types import SimpleNamespace

    from megapo.config import from_dict
    from megapo.trainer.rollout import Group
    from megapo.trainer.update import train_samples
    from megapo.trainer.config import RunConfig

    def sample(out):
        return SimpleNamespace(prompt_ids=[1, 2], output_ids=out, logprobs=[-0.1] * len(out), routes=None,
                               finish_reason="stop")

    groups = [Group(None, [sample([5, 9, 6]), sample([9, 7])], [1.0, 0.0])]
    cfg = from_dict(RunConfig, config_data(objective="sspo", objective_options={"sentence_end_ids": [9]}))
    cfg.rollout.n_samples = 2
    batch = train_samples(groups, cfg)
    assert [s["sentence_end"] for s in batch] == [[0.0, 1.0, 0.0], [1.0, 0.0]]
    cfg = from_dict(RunConfig, config_data(objective="sspo"))
    cfg.rollout.n_samples = 2
    assert all("sentence_end" not in s for s in train_samples(groups, cfg))


LEARNER_SCRIPT = r"""
import json, sys
from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner
from megapo.replay.modes import old_logprobs, on_policy_step

seen = []
def loss_fn(objective, logp, old, adv, mask, rollout_logp=None, **kw):
    from megapo.algorithms import policy_loss
    seen.append({k: [kw[k][i][mask[i]].tolist() for i in range(mask.shape[0])]
                 for k in ("old_entropy", "sentence_end") if k in kw})
    return policy_loss(objective, logp, old, adv, mask, rollout_logp, **kw)

learner = Learner(sys.argv[1], ParallelConfig(), OptimConfig(lr=1e-3), loss_fn=loss_fn, micro_batch_tokens=64)
batch = [{"tokens": [5, 6, 7, 8, 9, 10], "prompt_len": 3, "advantage": 0.5, "sentence_end": [0.0, 1.0, 0.0]},
         {"tokens": [11, 12, 13, 14, 15], "prompt_len": 2, "advantage": -1.0, "sentence_end": [1.0, 0.0, 0.0]}]
out = {}
_, ent = learner.logprobs([s["tokens"] for s in batch], with_entropy=True)
out["ref0"] = [e[s["prompt_len"] - 1:].tolist() for e, s in zip(ent, batch)]
on_policy_step(learner, [dict(s) for s in batch], "off", "sspo", sentence_end_ids=[7])
out["fused"] = list(seen)
seen.clear()
_, ent = learner.logprobs([s["tokens"] for s in batch], with_entropy=True)
out["ref1"] = [e[s["prompt_len"] - 1:].tolist() for e, s in zip(ent, batch)]
logps, _ = old_logprobs(learner, batch, "off", with_entropy=True)
for s, lp in zip(batch, logps):
    s["old_logp"] = lp.tolist()
learner.train_step(batch, "sspo", sentence_end_ids=[7])
out["separate"] = list(seen)
seen.clear()
learner.train_step(batch, "dhpo", alpha=0.5)
out["unasked"] = list(seen)
print(json.dumps(out))
"""


def test_learner_passes_old_entropy_and_sentence_ends_only_when_asked(tmp_path, tiny_dense):
    """sspo gets π_old's per-token entropy (the fused step's own forward; else the old pass's sample field) and
    the sentence_end flags in sample order; dhpo with a constant alpha gets neither."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "learner_entropy.py").write_text(LEARNER_SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "learner_entropy.py"), str(tiny_dense)], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    flags = {(0.0, 1.0, 0.0): 0, (1.0, 0.0, 0.0): 1}  # each sample's sentence_end, as the batch gives them
    for key, ref in (("fused", "ref0"), ("separate", "ref1")):
        (call,) = out[key]  # one micro-batch holds both sequences
        rows = [flags[tuple(f)] for f in call["sentence_end"]]
        assert sorted(rows) == [0, 1], key
        for row, sample in enumerate(rows):
            assert call["old_entropy"][row] == pytest.approx(out[ref][sample], rel=1e-5, abs=1e-6), key
    assert out["unasked"] == [{}]
