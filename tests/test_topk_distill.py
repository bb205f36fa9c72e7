"""The top-k seam and top-k forward-KL distillation (issue 31), against independent references:

- megapo.learner.logprobs.vocab_parallel_topk / vocab_parallel_logprobs_at against torch.topk of log_softmax of the
  unsharded float64 logits, on one rank (a padded vocabulary slice) and on two (torchrun, gloo, each rank its slice),
  and the K-target log-probs' gradient against autograd through the full log_softmax;
- megapo.algorithms.topk_distill's term against Σ_t Σ_v p_T(v)(log p_T(v) − log π_θ(v)) written out as loops, 0 when
  the teacher is the student, and its gradient against the closed form −β Σ_v p_T(v)(e_v − softmax(z)) / N;
- the config's and the learner's refusals naming the field;
- one `megapo train` with two teachers in mode topk_forward_kl, the first the student itself (its KL 0 at step 1).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megapo.algorithms.aggregation import Norm
from megapo.algorithms.batch import TokenBatch
from megapo.algorithms.spec import LossSpec, LossSpecError
from megapo.algorithms.topk_distill import topk_distill_loss, topk_forward_kl
from megapo.config import ConfigError, from_dict
from megapo.learner.logprobs import vocab_parallel_logprobs_at, vocab_parallel_topk
from megapo.trainer.distill import DistillConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_runs import train_rows  # noqa: E402
from one_rank import ONE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]



# ----------------------------------------------------------------------------- the vocabulary-parallel seam


@pytest.mark.parametrize("k", [1, 4, 9])
def test_topk_matches_torch_topk_of_log_softmax_on_one_rank(k):
    """11 logits of which 9 are the vocabulary (2 padding entries that must never be chosen), float64."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64) * 3
    logits[..., 9:] = 50.0  # padding larger than any real logit: masked, never a top-k id
    ids, logp = vocab_parallel_topk(logits, k, vocab_size=9, group=ONE)
    want_logp, want_ids = torch.log_softmax(logits[..., :9], dim=-1).topk(k, dim=-1)
    assert ids.dtype == torch.int64 and logp.dtype == torch.float64
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-12)


def test_logprobs_at_k_targets_and_gradient_match_log_softmax_on_one_rank():
    torch.manual_seed(1)
    logits = (torch.randn(4, 6, 11, dtype=torch.float64) * 2).requires_grad_(True)
    targets = torch.randint(0, 9, (4, 6, 3))
    weights = torch.randn(4, 6, 3, dtype=torch.float64)
    got = vocab_parallel_logprobs_at(logits, targets, vocab_size=9, group=ONE)
    ref_logits = logits.detach().clone().requires_grad_(True)
    want = torch.log_softmax(ref_logits[..., :9], dim=-1).gather(-1, targets)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    (weights * got).sum().backward()
    (weights * want).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=0, atol=1e-12)
    assert logits.grad[..., 9:].abs().max() == 0  # padding gets no gradient


def test_topk_refuses_k_outside_the_vocabulary():
    logits = torch.randn(2, 11)
    for k in (0, 10):
        with pytest.raises(ValueError, match=r"^k: must be in \[1, vocab_size=9\]"):
            vocab_parallel_topk(logits, k, vocab_size=9, group=ONE)


def test_topk_and_logprobs_at_match_log_softmax_under_tp2(tmp_path):
    """Two processes, each the half of a padded vocabulary of 14 (13 real: rank 1 holds one padding entry); k = 10 is
    more than a rank's 7 entries, so the global top k needs both ranks' candidates."""
    from megapo.launch.local import run_torchrun

    sys.path.insert(0, str(ROOT / "tests" / "distributed"))
    from topk_ranks import inputs

    spec = dict(seed=3, rows=6, vocab=13, padded=14, k=10, K=5)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "out.pt"
    rc = run_torchrun([str(ROOT / "tests" / "distributed" / "topk_ranks.py"), "--spec", str(tmp_path / "spec.json"),
                       "--out", str(out)], 2, timeout_s=120)
    assert rc == 0
    got = torch.load(out, weights_only=False)
    logits, targets, weights = inputs(spec)
    full = logits.clone().requires_grad_(True)
    log_softmax = torch.log_softmax(full[:, :13], dim=-1)
    want_logp, want_ids = log_softmax.detach().topk(10, dim=-1)
    assert got["ranks_agree"]
    assert torch.equal(got["ids"], want_ids)
    torch.testing.assert_close(got["logp"], want_logp, rtol=0, atol=1e-12)
    want_at = log_softmax.gather(-1, targets)
    torch.testing.assert_close(got["at"], want_at.detach(), rtol=0, atol=1e-12)
    (weights * want_at).sum().backward()
    torch.testing.assert_close(got["grad"], full.grad, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- the loss term


def _batch(mask):
    zeros = torch.zeros(mask.shape, dtype=torch.float64)
    return TokenBatch(zeros, zeros, zeros, mask)


def test_topk_forward_kl_term_is_the_formula_written_out():
    """Two teachers (k = 2 each) over 2 sequences × 3 tokens, one token masked; token-mean and seq-mean-token-mean."""
    student = torch.tensor([[[-0.5, -1.5, -0.2, -2.0], [-1.0, -0.7, -3.0, -0.1], [-2.0, -0.3, -0.9, -1.1]],
                            [[-0.4, -2.2, -1.3, -0.6], [-0.8, -0.9, -0.5, -1.9], [-1.2, -1.4, -0.35, -2.5]]],
                           dtype=torch.float64)
    teacher = torch.tensor([[[-0.3, -1.9, -0.1, -3.0], [-0.6, -1.2, -2.0, -0.4], [-1.5, -0.5, -0.7, -1.6]],
                            [[-0.2, -2.0, -1.0, -0.9], [-0.7, -1.3, -0.3, -2.4], [-0.9, -1.8, -0.5, -1.7]]],
                           dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    coefs = (0.5, 0.25)

    def kl(i, t, j):  # Σ_{v in teacher j's block} p_T (log p_T − log π_θ)
        lp_t, lp_s = teacher.tolist()[i][t], student.tolist()[i][t]
        return sum(math.exp(lp_t[c]) * (lp_t[c] - lp_s[c]) for c in (2 * j, 2 * j + 1))

    per_token = {(i, t): sum(c * kl(i, t, j) for j, c in enumerate(coefs))
                 for i in range(2) for t in range(3) if mask[i, t]}
    loss, metrics = topk_distill_loss(student, teacher, coefs, _batch(mask), "token-mean", Norm(global_tokens=10))
    assert loss.item() == pytest.approx(sum(per_token.values()) / 10, abs=1e-12)  # the batch-global normaliser
    loss, metrics = topk_distill_loss(student, teacher, coefs, _batch(mask), "seq-mean-token-mean", Norm())
    want = (sum(per_token[0, t] for t in range(2)) / 2 + sum(per_token[1, t] for t in range(3)) / 3) / 2
    assert loss.item() == pytest.approx(want, abs=1e-12)
    # metrics: each teacher's KL summed over the policy tokens (the learner divides by the batch's policy tokens)
    for j in range(2):
        want_j = sum(kl(i, t, j) for (i, t) in per_token)
        assert metrics[f"distill/topk_forward_kl/{j}"].item() == pytest.approx(want_j, abs=1e-12)
    assert metrics["distill/topk_forward_kl"].item() == pytest.approx(sum(kl(i, t, 0) for (i, t) in per_token))
    single, m = topk_distill_loss(student[..., :2], teacher[..., :2], (1.0,), _batch(mask), "token-mean", Norm())
    assert set(m) == {"distill/topk_forward_kl"}
    assert single.item() == pytest.approx(sum(kl(i, t, 0) for (i, t) in per_token) / 5, abs=1e-12)
    with pytest.raises(ValueError, match="teacher_topk_logp"):
        topk_distill_loss(student[..., :3], teacher[..., :3], coefs, _batch(mask), "token-mean", Norm())


def test_student_as_its_own_teacher_gives_zero_and_its_gradient_is_the_closed_form():
    """π_θ = softmax(z) over 7 tokens; teacher = the student's own top 3 (KL exactly 0), then another teacher: the
    gradient of coef · token-mean KL wrt z against −coef Σ_v p_T(v)(e_v − softmax(z)) / N at each policy token."""
    torch.manual_seed(2)
    z = (torch.randn(2, 4, 7, dtype=torch.float64) * 2).requires_grad_(True)
    mask = torch.tensor([[True, True, True, False], [True, False, True, True]])
    ids, teacher = vocab_parallel_topk(z.detach(), 3, vocab_size=7, group=ONE)
    student = vocab_parallel_logprobs_at(z, ids, vocab_size=7, group=ONE)
    assert torch.equal(topk_forward_kl(student, teacher), torch.zeros(2, 4, dtype=torch.float64))

    other = torch.randn(2, 4, 7, dtype=torch.float64)
    ids, teacher = vocab_parallel_topk(other, 3, vocab_size=7, group=ONE)
    student = vocab_parallel_logprobs_at(z, ids, vocab_size=7, group=ONE)
    coef = 0.7
    loss, _ = topk_distill_loss(student, teacher, (coef,), _batch(mask), "token-mean", Norm())
    loss.backward()
    p_student = torch.softmax(z.detach(), dim=-1)
    want = torch.zeros_like(z)
    for i in range(2):
        for t in range(4):
            if mask[i, t]:
                for v, lp in zip(ids[i, t].tolist(), teacher[i, t].tolist()):
                    onehot = torch.zeros(7, dtype=torch.float64)
                    onehot[v] = 1.0
                    want[i, t] -= coef * math.exp(lp) * (onehot - p_student[i, t]) / mask.sum()
    torch.testing.assert_close(z.grad, want, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- refusals


def test_distill_k_refusals_name_the_field(tiny_moe):
    vocab = json.loads((Path(tiny_moe) / "config.json").read_text())["vocab_size"]

    def refused(**fields) -> ConfigError:
        with pytest.raises(ConfigError) as err:
            DistillConfig(teacher=str(tiny_moe), **fields).validate(str(tiny_moe))
        return err.value

    for k in (0, -3):
        err = refused(mode="topk_forward_kl", k=k)
        assert err.field == "algorithm.distill.k" and ">= 1" in str(err)
    err = refused(mode="topk_forward_kl", k=vocab + 1)
    assert err.field == "algorithm.distill.k" and f"<= the vocabulary size {vocab}" in str(err)
    err = refused(k=8)  # mode reverse_kl has no top-k
    assert err.field == "algorithm.distill.k" and "topk_forward_kl" in str(err)
    err = refused(mode="forward_kl")
    assert err.field == "algorithm.distill.mode" and "topk_forward_kl" in str(err)
    with pytest.raises(ConfigError) as raised:  # the loader checks the range too
        from_dict(DistillConfig, {"teacher": str(tiny_moe), "mode": "topk_forward_kl", "k": 0}, "algorithm.distill")
    assert raised.value.field == "algorithm.distill.k"
    ok = DistillConfig(teacher=str(tiny_moe), mode="topk_forward_kl", k=vocab, coef=0.5)
    ok.validate(str(tiny_moe))
    assert ok.topk_coefs() == (0.5,) and DistillConfig(teacher=str(tiny_moe)).topk_coefs() == ()


def test_loss_spec_refuses_a_negative_distill_coefficient():
    with pytest.raises(LossSpecError) as err:
        LossSpec("ppo", distill_topk=(0.5, -1.0))
    assert err.value.field == "distill_topk" and str(err.value).startswith("distill_topk")
    assert LossSpec("ppo", distill_topk=[0.5, 1]).distill_topk == (0.5, 1.0)


def test_learner_refuses_malformed_teacher_topk_rows():
    from megapo.learner.learner import _train_inputs

    def sample(**kw):
        base = dict(tokens=[1, 2, 3, 4], prompt_len=2, advantage=1.0, old_logp=[-1.0, -1.0],
                    teacher_topk_ids=[[1, 2], [3, 4]], teacher_topk_logp=[[-0.1, -2.0], [-0.5, -1.0]])
        return {**base, **kw}

    inputs = _train_inputs([sample(), sample()], 10, need_old=True, device="cpu")
    assert inputs.topk["teacher_topk_ids"].dtype == torch.int64 and inputs.topk["teacher_topk_ids"].shape == (4, 2)
    for bad, words in [(dict(teacher_topk_ids=[[1, 2]]), r"batch\[1\]\.teacher_topk_ids: expected \[2, K\]"),
                       (dict(teacher_topk_logp=[[-0.1], [-0.5]]), r"batch\[1\]\.teacher_topk_logp: expected \[2, K\]"),
                       (dict(teacher_topk_ids=[[1, 2], [3, 10]]), r"batch\[1\]\.teacher_topk_ids: ids must be in"),
                       (dict(teacher_topk_logp=None), r"batch\[1\]\.teacher_topk_logp: missing")]:
        with pytest.raises(ValueError, match=words):
            _train_inputs([sample(), sample(**bad)], 10, need_old=True, device="cpu")
    assert _train_inputs([dict(tokens=[1, 2, 3], prompt_len=1, advantage=0.0, old_logp=[0.0, 0.0])], 10,
                         need_old=True, device="cpu").topk is None
    assert np.isfinite(inputs.topk["teacher_topk_logp"].numpy()).all()


# ----------------------------------------------------------------------------- megapo train


def test_train_with_topk_teachers_logs_the_kl_zero_for_the_student_itself(tmp_path, tiny_moe):
    """teachers [the student's own folder, other weights] in mode topk_forward_kl, r3: teacher 0's top-k forward KL is
    0 at step 1 (the same logits at the same routes as the train forward), teacher 1's is positive and finite, and
    the loss stays finite. The objective is simko (tests/test_simko.py), whose π_θ top-k inputs the same train
    forward computes through the same seam: one run covers both (the suite's time budget)."""
    from family_checks import write_variant

    other = write_variant(Path(tiny_moe), tmp_path / "other_teacher", seed=7)
    rows = train_rows(tmp_path, "topk", f"model.path={tiny_moe}", "algorithm.routing_replay=r3", "train.steps=2",
                      "algorithm.distill.mode=topk_forward_kl", "algorithm.distill.k=8",
                      f"algorithm.distill.teachers=[{{path: {tiny_moe}, coef: 0.5}}, {{path: {other}, coef: 0.25}}]",
                      "data.prompts_per_step=8", "rollout.n_samples=4", "algorithm.objective=simko",
                      "algorithm.objective_options={mix: 0.1}")
    first = rows[0]
    # bitwise: the teacher's top-k log-probs and the learner's at those ids share their arithmetic (logprobs.py)
    assert first["distill/topk_forward_kl/0"] == 0.0 and first["distill/topk_forward_kl"] == 0.0
    assert first["distill/topk_forward_kl/1"] > 0 and math.isfinite(first["distill/topk_forward_kl/1"])
    assert all(math.isfinite(r["train/loss"]) and r["train/skipped_nonfinite"] == 0 for r in rows)
    assert "distill/reverse_kl" not in first


# ----------------------------------------------------------------------------- the learner's glue


def test_learner_glue_selects_pads_and_weighs_like_the_full_vocabulary_reference(monkeypatch):
    """The train step's two uses of the seam on a hand-made micro-batch (2 packed rows of 4 slots, sequences of 2 and
    3 selected slots): the objective inputs topk_logp_sum / top1 (simko) and the distillation term with its metrics,
    against log_softmax over the micro-batch's full logits; one rank (the functions' group bound to it)."""
    from functools import partial
    from types import SimpleNamespace

    import megapo.learner.learner as learner_mod
    from megapo.learner.learner import Learner

    monkeypatch.setattr(learner_mod, "vocab_parallel_topk", partial(vocab_parallel_topk, group=ONE))
    monkeypatch.setattr(learner_mod, "vocab_parallel_logprobs_at", partial(vocab_parallel_logprobs_at, group=ONE))
    torch.manual_seed(4)
    V = 7
    logits = (torch.randn(2, 4, V, dtype=torch.float64) * 2).requires_grad_(True)
    select = torch.tensor([1, 2, 5, 6, 7])  # sequence 0: slots 1, 2; sequence 1: slots 5, 6, 7
    targets = torch.randint(0, V, (8,))
    targets[2] = logits[0, 2].argmax()  # one sampled token is the top-1 for sure
    mask = torch.tensor([[True, True, False], [True, True, True]])
    mb = SimpleNamespace(select=select, targets=targets, mask=mask, place=torch.tensor([0, 1, 3, 4, 5]),
                         columns=torch.arange(5), loss_mask=mask, head_selected=False)
    me = SimpleNamespace(spec=SimpleNamespace(vocab_size=V), _padded=Learner._padded, _padded_rows=Learner._padded_rows)
    full = torch.log_softmax(logits.reshape(-1, V)[select], dim=-1)  # [5, V]
    rows = [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]

    got = Learner._at_selected(lambda m, x: Learner._policy_topk_inputs(me, m, x, 3), mb, logits)
    top = full.topk(3, dim=-1)
    for n, (i, t) in enumerate(rows):
        assert got["topk_logp_sum"][i, t].item() == pytest.approx(top.values[n].sum().item(), abs=1e-12)
        assert got["top1"][i, t].item() == float(top.indices[n, 0].item() == targets[select[n]].item())
    assert got["top1"].sum() >= 1 and got["topk_logp_sum"][0, 2] == 0  # padding stays 0
    assert got["topk_logp_sum"].requires_grad

    teacher_logits = torch.randn(5, V, dtype=torch.float64)
    t_logp, t_ids = torch.log_softmax(teacher_logits, -1).topk(2, dim=-1)
    topk = {"teacher_topk_ids": t_ids, "teacher_topk_logp": t_logp}
    spec = LossSpec("ppo", "token-mean", distill_topk=(0.5,))
    zeros = torch.zeros(2, 3, dtype=torch.float64)
    loss, metrics = Learner._at_selected(
        lambda m, x: Learner._topk_distill(me, m, x, topk, spec, zeros, zeros, zeros, 8, 2, {}), mb, logits)
    want = sum(math.exp(t_logp[n, j]) * (t_logp[n, j] - full[n, t_ids[n, j]]) for n in range(5) for j in range(2))
    assert loss.item() == pytest.approx(0.5 * want.item() / 8, abs=1e-12)  # token-mean over global_tokens = 8
    assert metrics["distill/topk_forward_kl"].item() == pytest.approx(want.item(), abs=1e-12)
    with pytest.raises(ValueError, match="teacher_topk_ids"):
        Learner._topk_distill(me, mb, logits, None, spec, zeros, zeros, zeros, 8, 2, {})
