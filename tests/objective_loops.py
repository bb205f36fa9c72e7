"""Scaffolding the objective tests share (test_objectives_seed32.py, test_objectives_ratio_gating.py, the token
stages' split checks of test_self_distill.py and test_entropy_credit.py): sequences
padded into [S, T] tensors, the aggregations written as loops, float64 central finite differences of a loop and the
split of a batch over 4 micro-batches x 2 DP shards (the config they check options against: algorithm_configs.py).
Each test file keeps its own data (make_seqs) and its loops of the formulas."""

from __future__ import annotations

import math

import pytest
import torch

F64 = torch.float64


def padded(seqs: list[dict], keys: tuple[str, ...], width: int | None = None) -> dict:
    """The float lists of each sequence under `keys` as zero-padded [S, width] float64 tensors, and "mask"."""
    width = width or max(len(s["lp"]) for s in seqs)
    out = {}
    for key in keys:
        t = torch.zeros(len(seqs), width, dtype=F64)
        for i, s in enumerate(seqs):
            t[i, : len(s[key])] = torch.tensor(s[key], dtype=F64)
        out[key] = t
    out["mask"] = torch.arange(width)[None, :] < torch.tensor([len(s["lp"]) for s in seqs])[:, None]
    return out


def token_mean(rows):
    return sum(sum(r) for r in rows) / sum(len(r) for r in rows)


def seq_mean(rows):
    return sum(sum(r) / len(r) for r in rows) / len(rows)


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def fd_grad(loss_of, seqs: list[dict], h: float = 1e-6) -> list[list[float]]:
    """d loss / d lp[i][t] by central differences, where loss_of(lp_of, frozen_of) is the loop's loss with
    sequence j's log-probs lp_of(j) and its stop-gradient parts frozen_of(j) (held at the unperturbed values)."""
    frozen = [list(s["lp"]) for s in seqs]
    grads = []
    for i, s in enumerate(seqs):
        row = []
        for t in range(len(s["lp"])):
            vals = []
            for sign in (1, -1):
                def lp_of(j, sign=sign, i=i, t=t):
                    v = list(frozen[j])
                    if j == i:
                        v[t] += sign * h
                    return v
                vals.append(loss_of(lp_of, lambda j: frozen[j]))
            row.append((vals[0] - vals[1]) / (2 * h))
        grads.append(row)
    return grads


def check_split_sums(call, name: str, seqs: list[dict], pad, opts: dict) -> None:
    """8 sequences, 2 DP ranks x 4 micro-batches of one sequence each, with the batch's global_tokens and
    global_seqs: under each aggregation the shards' losses and gradients sum to the full batch's.
    call(name, p, x, **kw) is the file's policy_loss call; pad(seqs, width=None) its padded."""
    lengths = [len(s["lp"]) for s in seqs]
    p = pad(seqs)
    x = p["lp"].clone().requires_grad_(True)
    n_tok, n_seq = sum(lengths), len(lengths)
    for agg in ("auto", "token-mean", "seq-mean-token-mean"):
        x.grad = None
        full, _ = call(name, p, x, loss_agg=agg, global_tokens=n_tok, global_seqs=n_seq, **opts)
        full.backward()
        total = 0.0
        for rank in range(2):
            for mb in range(4):
                i = rank * 4 + mb
                sp = pad([seqs[i]], width=lengths[i] + 2)
                sx = sp["lp"].clone().requires_grad_(True)
                loss, _ = call(name, sp, sx, loss_agg=agg, global_tokens=n_tok, global_seqs=n_seq, **opts)
                loss.backward()
                total += loss.item()
                assert torch.allclose(sx.grad[0, : lengths[i]], x.grad[i, : lengths[i]], rtol=1e-12, atol=1e-15)
        assert total == pytest.approx(full.item(), rel=1e-12, abs=1e-14), agg


def pad_rows(rows: list, width: int) -> torch.Tensor:
    """Float lists (one per sequence) as a zero-padded [S, width] float64 tensor."""
    out = torch.zeros(len(rows), width, dtype=F64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=F64)
    return out


def assert_ppo_split_invariant(old: list, adv: list, lengths: list[int], seed: int) -> None:
    """PPO's token-mean loss and gradient on per-token advantages `adv` (computed once on the whole batch) equal
    over 8 one-sequence pieces (2 DP ranks x 4 micro-batches, each normalised by the global token count), 1e-12;
    the policy's log-probs are `old` moved by seeded noise."""
    from megapo.algorithms import policy_loss

    width = max(lengths)
    g = torch.Generator().manual_seed(seed)
    lp = pad_rows([[x + 0.1 * float(torch.randn(1, generator=g)) for x in row] for row in old], width)
    o, a, mask = pad_rows(old, width), pad_rows(adv, width), pad_rows([[1] * n for n in lengths], width).bool()
    x = lp.clone().requires_grad_(True)
    full, _ = policy_loss("ppo", x, o, a, mask, loss_agg="token-mean")
    full.backward()
    total = 0.0
    for k in range(len(lengths)):
        sl = slice(k, k + 1)
        y = lp[sl].clone().requires_grad_(True)
        loss, _ = policy_loss("ppo", y, o[sl], a[sl], mask[sl], loss_agg="token-mean", global_tokens=sum(lengths))
        loss.backward()
        total += loss.item()
        assert torch.allclose(y.grad, x.grad[sl], rtol=1e-12, atol=1e-15)
    assert total == pytest.approx(full.item(), rel=1e-12)


def assert_ppo_gradient_matches_fd(old: list, adv: list, lengths: list[int], seed: int) -> None:
    """PPO's token-mean loss on per-token advantages `adv`: autograd's gradient in the log-probs (`old` moved by
    seeded noise) equals float64 central finite differences (assert_autograd_matches_fd)."""
    from megapo.algorithms import policy_loss

    width = max(lengths)
    o, a, mask = pad_rows(old, width), pad_rows(adv, width), pad_rows([[1] * n for n in lengths], width).bool()
    logp = o + torch.randn(o.shape, generator=torch.Generator().manual_seed(seed), dtype=F64) * 0.2
    assert_autograd_matches_fd(lambda x: policy_loss("ppo", x, o, a, mask, loss_agg="token-mean")[0], logp, mask)


class RecordingLearner:
    """learner.logprobs of the old-log-prob pass: records whether π_old's entropy was asked for (the pipeline tests:
    an input no stage asks for is not computed)."""

    route_hook = None

    def __init__(self):
        self.asked = []

    def logprobs(self, sequences, with_entropy=False, prompt_lens=None):
        self.asked.append(with_entropy)
        logps = [torch.full((len(s),), -0.5, dtype=F64) for s in sequences]
        return (logps, [torch.full((len(s),), 0.7, dtype=F64) for s in sequences]) if with_entropy else logps


def rand_lists(seed: int, lengths: list[int], low: float, high: float) -> list[list[float]]:
    """Seeded float64 values uniform in [low, high), one list of n per length."""
    g = torch.Generator().manual_seed(seed)
    return [(low + (high - low) * torch.rand(n, generator=g, dtype=F64)).tolist() for n in lengths]


def close(got, want, tol: float = 1e-13) -> None:
    """Per-sample tensors `got` equal the lists `want` within tol (relative and absolute)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.tolist() == pytest.approx(w, rel=tol, abs=tol)


def old_pass_request(cfg) -> tuple[list[bool], dict]:
    """The old-log-prob pass of `cfg` on one 4-token sample with a RecordingLearner: (whether each call asked for
    π_old's entropy, the sample as the pass left it)."""
    from megapo.trainer.update import old_logprob_pass

    learner = RecordingLearner()
    batch = [{"tokens": [1, 2, 3, 4], "prompt_len": 2, "advantage": 1.0}]
    old_logprob_pass(learner, batch, cfg)
    return learner.asked, batch[0]


def objectives_listing(capsys, name: str) -> tuple[str, str, list[str]]:
    """`megapo objectives --formulas` and `--stages` for the entry `name`: (its row of the listing, the whole
    formulas output, the stage's declared inputs, [] when it is no stage)."""
    from megapo.cli import main

    assert main(["objectives", "--formulas"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.split()[:1] == [name] and not line.startswith(" "))
    assert main(["objectives", "--stages"]) == 0
    rows = {line.split()[0]: line.split()[1:3] for line in capsys.readouterr().out.splitlines()[1:]}
    return row, out, rows.get(name, [])


def assert_autograd_matches_fd(loss_of, logp: torch.Tensor, mask: torch.Tensor, h: float = 1e-6,
                               atol: float = 1e-7) -> None:
    """loss_of(logp [S, T]) -> scalar: its autograd gradient equals float64 central finite differences at every
    token where `mask` is set."""
    x = logp.clone().requires_grad_(True)
    loss_of(x).backward()
    for i, t in [(i, t) for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t]]:
        up, down = logp.clone(), logp.clone()
        up[i, t] += h
        down[i, t] -= h
        fd = (float(loss_of(up)) - float(loss_of(down))) / (2 * h)
        assert x.grad[i, t].item() == pytest.approx(fd, abs=atol), (i, t)


def assert_ppo_shards_sum(lp, old, adv, mask, lengths: list[int], full, full_grad, token_weight=None) -> None:
    """PPO's token-mean loss on one-sequence pieces of the [S, T] batch (8 pieces: 2 DP ranks x 4 micro-batches),
    each normalised by the batch's token count, sums to the whole batch's `full` and each piece's gradient is its
    rows of `full_grad`, 1e-12."""
    from megapo.algorithms import policy_loss

    total = 0.0
    for k in range(lp.shape[0]):
        sl = slice(k, k + 1)
        y = lp[sl].clone().requires_grad_(True)
        weight = None if token_weight is None else token_weight[sl]
        loss, _ = policy_loss("ppo", y, old[sl], adv[sl], mask[sl], loss_agg="token-mean",
                              global_tokens=sum(lengths), token_weight=weight)
        loss.backward()
        total += loss.item()
        assert torch.allclose(y.grad, full_grad[sl], rtol=1e-12, atol=1e-15)
    assert total == pytest.approx(float(full), rel=1e-12, abs=1e-15)


def stapo_reference(advantages, old, ent, prob_max, entropy_max, renorm):
    """STAPO's token weights written out: 0 at a positive response's token with π_old < prob_max and entropy <
    entropy_max, else 1; renormalised over the batch, per sequence, or not."""
    keep = []
    for a, lp, h in zip(advantages, old, ent):
        total = sum(a) if isinstance(a, list) else a * len(lp)
        keep.append([0.0 if total > 0 and math.exp(p) < prob_max and e < entropy_max else 1.0
                     for p, e in zip(lp, h)])
    if renorm == "batch":
        n, k = sum(len(r) for r in keep), sum(sum(r) for r in keep)
        return [[w * n / k for w in r] for r in keep]
    if renorm == "sequence":
        return [[w * len(r) / max(sum(r), 1) for w in r] for r in keep]
    return keep
