"""Per-difficulty response-length metrics (len/mean, len/p90, len/d{k}, len/d{k}_p90), against the definitions
written out here, and their wiring into the loop's rollout metrics."""

import math

import pytest

from megapo.trainer.metrics import length_metrics


def _p90(values):
    """The 90th percentile by linear interpolation between closest ranks, written out."""
    xs = sorted(values)
    rank = 0.9 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (rank - lo) * (xs[hi] - xs[lo])


def test_length_metrics_by_difficulty():
    lengths = [4, 61, 30, 8, 12, 5, 44, 7, 9, 3, 100]
    buckets = [2, 6, 4, 2, 3, 2, 6, 3, 3, None, 6]
    got = length_metrics(lengths, buckets)
    assert got["len/mean"] == pytest.approx(sum(lengths) / len(lengths))
    assert got["len/p90"] == pytest.approx(_p90(lengths))
    for k in (2, 3, 4, 6):
        mine = [n for n, d in zip(lengths, buckets) if d == k]
        assert got[f"len/d{k}"] == pytest.approx(sum(mine) / len(mine))
        assert got[f"len/d{k}_p90"] == pytest.approx(_p90(mine))
    assert set(got) == {"len/mean", "len/p90"} | {f"len/d{k}{s}" for k in (2, 3, 4, 6) for s in ("", "_p90")}
    assert length_metrics([5, 6], [None, None]) == {"len/mean": 5.5, "len/p90": pytest.approx(5.9)}
    assert length_metrics([], []) == {}


def test_the_loop_logs_length_by_difficulty(tiny_moe):
    from transformers import AutoTokenizer

    from megapo.config import load_config
    from megapo.engines.base import Sample
    from megapo.trainer import data
    from megapo.trainer.rollout import collect_rollouts, make_reward_fn
    from megapo.trainer.config import RunConfig

    tok = AutoTokenizer.from_pretrained(tiny_moe)
    cfg = load_config(RunConfig, None, [f"model.path={tiny_moe}", "data.task=addition_cot", "rollout.n_samples=2",
                                        "data.prompts_per_step=5", "rollout.max_new_tokens=64"])
    pool = data.prompt_pool(cfg, tok)

    class Engine:  # a response of 3 * digits tokens then EOS, and one of 1 token then EOS
        def generate(self, prompts, params):
            out = []
            for p in prompts:
                digits = (len(p) - 2) // 2
                out.append([Sample(p, [20] * (3 * digits) + [tok.eos_token_id], [0.0] * (3 * digits + 1), "stop", 0),
                            Sample(p, [20, tok.eos_token_id], [0.0] * 2, "stop", 0)])
            return out

    source = data.PromptSource(len(pool), shuffle=False)  # the first 5 train examples: 2, 3, 4, 5, 6 digits
    _, metrics, _ = collect_rollouts(Engine(), type("P", (), {"n": 2})(), pool, source,
                                          make_reward_fn(cfg, tok), cfg)
    for k in range(2, 7):
        assert metrics[f"len/d{k}"] == pytest.approx((3 * k + 1 + 2) / 2)
        assert metrics[f"len/d{k}_p90"] == pytest.approx(_p90([3 * k + 1, 2]))
    every = [3 * k + 1 for k in range(2, 7)] + [2] * 5
    assert metrics["len/mean"] == pytest.approx(sum(every) / 10) and metrics["len/p90"] == pytest.approx(_p90(every))
