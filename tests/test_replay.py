"""Routing replay pieces that need no processes: route checks, laying routes onto packed rows, route
files, modes, config guards, and `megapo logprobs --routes-in/--routes-out` refusing bad input
before any process starts. (The replay itself: tests/test_replay_layouts.py.)"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megapo.cli import run_command
from megapo.replay.hook import _check_config, same_sets
from megapo.replay.modes import parse_mode
from megapo.replay.routes import GIVEN, LAST, MISSING, PAD, RouteShape, check_routes, load_routes, row_plan, save_routes

SHAPE = RouteShape(num_moe_layers=2, topk=2, num_experts=8)


def routes(n, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([[rng.choice(8, 2, replace=False) for _ in range(2)] for _ in range(n)]).astype(np.int32)


@pytest.mark.parametrize("value, n, words", [
    (np.zeros((4, 3, 2), np.int64), 5, ["shape", "2 MoE layers"]),
    (np.zeros((4, 2), np.int64), 5, ["shape"]),
    (routes(6), 5, ["6 route positions", "at most 4"]),
    (np.full((2, 2, 2), 8), 5, ["expert id 8", "[0, 8)"]),
    (np.zeros((2, 2, 2), np.float32) + [0, 1], 5, ["integers"]),
    (np.array([[[0, 1], [3, 3]]]), 5, ["position 0, MoE layer 1", "repeated"]),
])
def test_bad_routes_named(value, n, words):
    with pytest.raises(ValueError) as err:
        check_routes(value, n, SHAPE, "batch[3]")
    assert "batch[3]" in str(err.value)
    for w in words:
        assert w in str(err.value)


def test_partial_and_unknown_entries_accepted():
    r = routes(3)
    r[1, 0] = -1
    out = check_routes(torch.tensor(r), 10, SHAPE, "x")
    assert out.dtype == np.int8 and out.shape == (3, 2, 2)  # compact: the fewest bytes holding 8 experts and -1
    assert (out == r).all()
    assert check_routes(None, 10, SHAPE, "x") is None


def test_row_plan_sources_targets_and_distinct_padding():
    a, b = routes(4, 1), routes(6, 2)
    b[2, 1] = -1  # unknown (position 2, layer 1)
    # row: sample 0 (5 tokens, full routes), sample 1 (8 tokens, routes for 6 of its 7 positions), 3 pads
    plan = row_plan([0, 1], [0, 5], [5, 8], 16, [a, b], SHAPE)
    src, tgt = plan.source, plan.targets
    expect = torch.full((16, 2), PAD, dtype=torch.int8)
    expect[0:4] = GIVEN
    expect[4] = LAST
    expect[5:11] = GIVEN
    expect[7, 1] = MISSING
    expect[11] = MISSING  # sample 1 position 6: beyond its routes
    expect[12] = LAST
    assert torch.equal(src, expect)
    assert torch.equal(tgt[0:4], torch.as_tensor(a, dtype=torch.long))
    assert torch.equal(tgt[5:7], torch.as_tensor(b[:2], dtype=torch.long))
    assert torch.equal(tgt[7, 0], torch.as_tensor(b[2, 0], dtype=torch.long))
    pads = tgt[13:]  # [3, L, k]: k distinct ids in range on every layer
    assert ((pads >= 0) & (pads < 8)).all()
    assert (pads[..., 0] != pads[..., 1]).all()


def test_row_plan_without_routes_is_all_own_choice():
    plan = row_plan([2], [0], [4], 6, None, SHAPE)
    assert plan.source[:3].eq(MISSING).all() and plan.source[3].eq(LAST).all() and plan.source[4:].eq(PAD).all()


def test_dummy_experts_distinct_when_topk_equals_experts():
    shape = RouteShape(1, 4, 4)
    plan = row_plan([], [], [], 5, None, shape)
    for row in plan.targets[:, 0]:
        assert sorted(row.tolist()) == [0, 1, 2, 3]


def test_route_files_round_trip_and_missing_keys(tmp_path):
    rs = [routes(3), routes(5, 1)]
    save_routes(tmp_path / "r.npz", rs)
    back = load_routes(tmp_path / "r.npz", 3)
    assert back[2] is None
    for x, y in zip(rs, back):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="unexpected keys"):
        load_routes(tmp_path / "r.npz", 1)
    with pytest.raises(FileNotFoundError):
        load_routes(tmp_path / "none.npz", 1)


def test_same_sets_ignores_order():
    a = torch.tensor([[1, 2], [3, 4], [5, 6]])
    b = torch.tensor([[2, 1], [3, 5], [5, 6]])
    assert same_sets(a, b).tolist() == [True, False, True]


def test_modes():
    assert parse_mode("r2").value == "r2"
    with pytest.raises(ValueError, match="routing_replay.*off, r2, r3"):
        parse_mode("r4")


@pytest.mark.parametrize("field, value, words", [
    ("moe_enable_routing_replay", False, "moe_enable_routing_replay"),
    ("moe_router_fusion", True, "moe_router_fusion"),
    ("moe_expert_capacity_factor", 1.0, "capacity"),
    ("moe_input_jitter_eps", 0.1, "jitter"),
    ("moe_router_load_balancing_type", "sinkhorn", "sinkhorn"),
])
def test_settings_that_would_ignore_replay_refused(field, value, words):
    cfg = dict(moe_enable_routing_replay=True, moe_router_fusion=False, moe_expert_capacity_factor=None,
               moe_input_jitter_eps=None, moe_router_load_balancing_type="none")
    cfg[field] = value
    with pytest.raises(ValueError, match=words):
        _check_config(SimpleNamespace(**cfg))


# ----------------------------------------------------------------------------- command line


def _args(model, tmp_path, **kw):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"tokens": [1, 2, 3, 4, 5]}) + "\n" + json.dumps({"tokens": [6, 7, 8]}) + "\n")
    base = dict(model=str(model), input=str(inp), output=str(tmp_path / "out.jsonl"), tp=1, pp=1, ep=1, dp=1,
                dispatcher="alltoall", micro_batch_tokens=64, timeout=60, worker=False, routes_in=None,
                routes_out=None)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("content, words", [
    ({"0": np.zeros((4, 2, 2), np.int32)}, ["line 1", "repeated"]),
    ({"0": routes(4)[:, :1]}, ["line 1", "shape"]),
    ({"1": routes(3)}, ["line 2", "3 route positions"]),
    ({"0": routes(4), "7": routes(1)}, ["unexpected keys"]),
])
def test_bad_routes_in_refused_before_any_process(tiny_moe, tmp_path, capsys, no_launch, content, words):
    np.savez(tmp_path / "r.npz", **content)
    assert run_command("logprobs", _args(tiny_moe, tmp_path, routes_in=str(tmp_path / "r.npz"), tp=2)) == 2
    err = capsys.readouterr().err
    assert "--routes-in" in err
    for w in words:
        assert w in err


def test_routes_flags_refused_for_dense_model_and_bad_paths(tiny_moe, tiny_dense, tmp_path, capsys, no_launch):
    save_routes(tmp_path / "r.npz", [routes(4)])
    assert run_command("logprobs", _args(tiny_dense, tmp_path, routes_in=str(tmp_path / "r.npz"))) == 2
    assert "--routes-in" in capsys.readouterr().err
    assert run_command("logprobs", _args(tiny_moe, tmp_path, routes_in=str(tmp_path / "missing.npz"))) == 2
    assert "does not exist" in capsys.readouterr().err
    assert run_command("logprobs", _args(tiny_moe, tmp_path, routes_out=str(tmp_path / "r.json"))) == 2
    assert "--routes-out" in capsys.readouterr().err


def test_row_plan_for_a_pipeline_stage_keeps_its_layers():
    shape = RouteShape(num_moe_layers=3, topk=2, num_experts=8)
    r = np.stack([[[0, 1], [2, 3], [4, 5]], [[6, 7], [0, 2], [1, 3]]])
    plan = row_plan([0], [0], [3], 4, [r], shape, layers=[2])
    assert plan.targets.shape == (4, 1, 2)
    assert plan.targets[:2, 0].tolist() == [[4, 5], [1, 3]]


def test_old_logprobs_refuses_before_any_pass():
    from megapo.replay.modes import old_logprobs

    class NoPasses:
        route_hook = None

        def logprobs(self, *a, **k):
            raise AssertionError("a forward pass ran")

    samples = [dict(tokens=[1, 2, 3], prompt_len=1)]
    with pytest.raises(ValueError, match="return_routes=True"):
        old_logprobs(NoPasses(), samples, "r3")
    with pytest.raises(ValueError, match="routing_replay=True"):
        old_logprobs(NoPasses(), samples, "r2")
    with pytest.raises(ValueError, match="off, r2, r3"):
        old_logprobs(NoPasses(), samples, "R2")


def test_position_plan_follows_the_routers_width_major_order():
    """Two rows of width 4 as Megatron's router sees them, [width, rows] flattened: position j*2 + r is row
    r's slot j. Expected per slot from each sequence's own routes, written out here."""
    from megapo.replay.routes import position_plan, route_table

    a, b, c = routes(2, 3), routes(3, 4), routes(1, 5)  # sequences of 3, 4 and 2 tokens
    c[0, 1] = -1
    lengths = np.array([3, 4, 2])
    rows = [[(0, 0), (0, 1), (0, 2), (-1, 0)], [(1, 0), (1, 1), (1, 2), (1, 3)]]  # (sequence, position) per slot
    slots = [rows[r][j] for j in range(4) for r in range(2)]
    seq, pos = np.array([s for s, _ in slots]), np.array([p for _, p in slots])
    table = route_table([a, b, c], lengths, [0, 1])
    plan = position_plan(table, seq, pos, lengths, SHAPE, 2)
    given = {0: a, 1: b, 2: c}
    for j, (s, p) in enumerate(slots):
        for layer in range(2):
            if s < 0:
                assert plan.source[j, layer] == PAD
            elif p == lengths[s] - 1:
                assert plan.source[j, layer] == LAST
            elif p < len(given[s]) and (given[s][p, layer] >= 0).all():
                assert plan.source[j, layer] == GIVEN
                assert plan.targets[j, layer].tolist() == given[s][p, layer].tolist()
            else:
                assert plan.source[j, layer] == MISSING


def test_replayed_counts_of_an_on_policy_pass():
    """as_replayed: a second pass replaying what this one routed sees every routed position as given and the
    same disagreements; the fractions written out from the counts."""
    from megapo.replay.hook import DISAGREE_PRE, FALLBACK_N, GIVEN_N, MISMATCH_POST, ROUTED_N, as_replayed, fractions

    counts = torch.zeros(2, 5, dtype=torch.float64)
    columns = [GIVEN_N, DISAGREE_PRE, ROUTED_N, MISMATCH_POST, FALLBACK_N]
    counts[0, columns] = torch.tensor([6., 3., 10., 0., 4.], dtype=torch.float64)
    counts[1, columns] = torch.tensor([8., 2., 10., 1., 2.], dtype=torch.float64)
    first, second = fractions(counts), fractions(as_replayed(counts))
    assert first["replay/disagree_pre"] == pytest.approx(5 / 14)
    assert first["replay/fallback_frac"] == pytest.approx(6 / 20)
    assert second["replay/disagree_pre"] == pytest.approx(5 / 20) and second["replay/fallback_frac"] == 0.0
    assert second["replay/disagree_pre/layer1"] == pytest.approx(2 / 10)
    assert second["replay/disagree_post"] == first["replay/disagree_post"] == pytest.approx(1 / 20)


@pytest.mark.parametrize("bad, words", [
    (np.full((2, 2, 2), 8), ["batch[2]", "expert id 8", "[0, 8)"]),
    (np.array([[[0, 1], [2, 3]], [[4, 5], [6, 6]]]), ["batch[2]", "position 1, MoE layer 1", "repeated"]),
    (np.zeros((2, 2), np.int64), ["batch[2]", "shape"]),
])
def test_batch_routes_checked_at_once_name_the_sample_and_position(bad, words):
    from megapo.replay.routes import check_batch_routes

    good = [routes(3, 1), None, bad, routes(2, 2)]
    with pytest.raises(ValueError) as err:
        check_batch_routes(good, [5, 4, 4, 3], SHAPE, "batch")
    for w in words:
        assert w in str(err.value), str(err.value)
    out = check_batch_routes([routes(3, 1), None, routes(2, 2)], [5, 4, 3], SHAPE, "batch")
    assert out[1] is None and out[0].dtype == np.int8 and (out[2] == routes(2, 2)).all()


def test_route_dtype_is_the_smallest_holding_the_ids():
    from megapo.replay.routes import compact_routes, route_dtype

    # (experts, the type): ids 0..E-1 and -1 must fit, written out
    for experts, want in [(8, np.int8), (127, np.int8), (128, np.int16), (256, np.int16), (32767, np.int16),
                          (32768, np.int32)]:
        assert route_dtype(experts) == want, experts
    r = np.array([[[3, -7]], [[255, 0]]], dtype=np.int64)
    out = compact_routes(r, 256)
    assert out.dtype == np.int16 and out.tolist() == [[[3, -1]], [[255, 0]]]  # every "no route" is -1
    assert compact_routes(np.array([[[0, 5]]], dtype=np.uint8)).dtype == np.int8  # by the largest id given
    with pytest.raises(ValueError, match="out of range"):  # checked before narrowing: 300 must not wrap to 44
        check_routes(np.full((2, 2, 2), 300), 10, SHAPE, "x")
