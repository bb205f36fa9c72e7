"""Scaffolding the objective tests share (test_objectives_seed32.py, test_objectives_ratio_gating.py): sequences
padded into [S, T] tensors, the aggregations written as loops, float64 central finite differences of a loop and the
split of a batch over 4 micro-batches x 2 DP shards (the config they check options against: algorithm_configs.py).
Each test file keeps its own data (make_seqs) and its loops of the formulas."""

from __future__ import annotations

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
