"""Compact routes with PP > 1 (megapo.trainer.handout): rank 0 cuts each sample's routes to a pipeline stage's MoE
layer columns for that stage's ranks, and the route hook takes routes of every MoE layer or of its stage's only.
Expected arrays are written out here, not computed by the code under test."""

import numpy as np
import pytest

from megapo.engines.base import Sample
from megapo.replay.routes import RouteShape, given_columns, route_table, stage_columns
from megapo.tasks.base import Example
from megapo.trainer.handout import hand_out, stage_groups
from megapo.trainer.rollout import Group

# 3 positions x 4 MoE layers x top-2: entry (t, j, i) = 10*t + 2*j + i (a -1 at t=2, layer 3: no route there)
ROUTES = np.array([[[0, 1], [2, 3], [4, 5], [6, 7]],
                   [[10, 11], [12, 13], [14, 15], [16, 17]],
                   [[20, 21], [22, 23], [24, 25], [-1, -1]]], dtype=np.int8)


def test_stage_columns_are_the_full_arrays_columns():
    np.testing.assert_array_equal(stage_columns(ROUTES, [2, 3]), np.array(
        [[[4, 5], [6, 7]], [[14, 15], [16, 17]], [[24, 25], [-1, -1]]], dtype=np.int8))
    np.testing.assert_array_equal(stage_columns(ROUTES, [0]), np.array([[[0, 1]], [[10, 11]], [[20, 21]]]))
    cut = stage_columns(ROUTES, [1, 3])
    assert cut.dtype == np.int8 and cut.shape == (3, 2, 2) and cut.flags.c_contiguous
    assert cut.nbytes == 12  # only its columns travel (a pickled view would carry the same bytes; a copy is explicit)
    np.testing.assert_array_equal(stage_columns(ROUTES.tolist(), [1]), np.array([[[2, 3]], [[12, 13]], [[22, 23]]]))
    assert stage_columns(None, [0, 1]) is None
    with pytest.raises(ValueError, match=r"\[positions, MoE layers, top-k\]"):
        stage_columns(np.zeros((3, 4)), [0])


def _groups():
    a = Sample(prompt_ids=[1, 2], output_ids=[3, 4], logprobs=[-0.1, -0.2], finish_reason="stop", weight_version=0,
               routes=ROUTES)
    b = Sample(prompt_ids=[5], output_ids=[6], logprobs=[-0.3], finish_reason="stop", weight_version=0, routes=None)
    return [Group(Example(prompt="p", answer="a"), [a, b], [1.0, 0.0])]


def test_stage_groups_send_each_rank_its_stage_columns():
    groups = _groups()
    # PP=2 over 4 ranks: ranks 0, 1 hold MoE layers 0, 1 (stage 0), ranks 2, 3 layers 2, 3 (stage 1)
    out = stage_groups(groups, [[0, 1], [0, 1], [2, 3], [2, 3]])
    assert len(out) == 4 and out[0] is groups  # rank 0 keeps its groups whole
    assert out[0][0].samples[0].routes is ROUTES and out[0][0].route_layers is None
    np.testing.assert_array_equal(out[1][0].samples[0].routes, np.array(
        [[[0, 1], [2, 3]], [[10, 11], [12, 13]], [[20, 21], [22, 23]]], dtype=np.int8))
    np.testing.assert_array_equal(out[2][0].samples[0].routes, np.array(
        [[[4, 5], [6, 7]], [[14, 15], [16, 17]], [[24, 25], [-1, -1]]], dtype=np.int8))
    assert out[3] is out[2]  # one copy per stage
    assert out[1][0].route_layers == [0, 1] and out[2][0].route_layers == [2, 3]
    for part in out[1:]:
        assert part[0].samples[1].routes is None
        s, full = part[0].samples[0], groups[0].samples[0]
        assert (s.prompt_ids, s.output_ids, s.logprobs, part[0].rewards) == (full.prompt_ids, full.output_ids,
                                                                             full.logprobs, groups[0].rewards)
    assert groups[0].samples[0].routes is ROUTES and groups[0].route_layers is None  # rank 0's are unchanged
    assert sum(r.nbytes for r in (out[2][0].samples[0].routes,)) == ROUTES.nbytes // 2


def test_hand_out_in_one_process_is_the_groups():
    groups = _groups()
    assert hand_out(groups, None) is groups
    assert hand_out(groups, [[0, 1], [2, 3]]) is groups  # rank 0 (the only one) keeps its own


def test_train_samples_of_a_cut_group_have_no_engine_routes():
    from megapo.trainer.config import RunConfig
    from megapo.trainer.update import train_samples

    cfg = RunConfig()
    cfg.rollout.n_samples = 2
    cfg.algorithm.routing_replay = "r3"
    whole = train_samples(_groups(), cfg)
    cut = train_samples(stage_groups(_groups(), [[0, 1], [2, 3]])[1], cfg)
    assert whole[0].routes is whole[0].engine_routes  # rank 0: router/disagree compares every MoE layer
    np.testing.assert_array_equal(whole[0].engine_routes, ROUTES)
    # another rank: the stage's columns are replayed, but not compared with the learner's routes of every layer
    assert cut[0].engine_routes is None and cut[1].engine_routes is None
    np.testing.assert_array_equal(cut[0].routes, ROUTES[:, 2:])
    assert [s.advantage for s in cut] == [s.advantage for s in whole]


SHAPE = RouteShape(num_moe_layers=4, topk=2, num_experts=32)


def test_hook_columns_full_or_this_stages():
    # full routes: the stage's layers are picked from them
    shape, columns, width = given_columns([ROUTES, None], SHAPE, [2, 3], "batch")
    assert (shape, columns, width) == (SHAPE, [2, 3], 4)
    # the stage's columns already: all of them, checked as a 2-layer shape
    cut = stage_columns(ROUTES, [2, 3])
    shape, columns, width = given_columns([cut, None], SHAPE, [2, 3], "batch")
    assert (shape, columns, width) == (RouteShape(2, 2, 32), [0, 1], 2)
    # both give the same table
    full_table = route_table([ROUTES], np.array([4]), [2, 3])
    cut_table = route_table([cut], np.array([4]), [0, 1])
    np.testing.assert_array_equal(full_table.targets, cut_table.targets)
    np.testing.assert_array_equal(full_table.given, cut_table.given)
    np.testing.assert_array_equal(cut_table.given, [[True, True], [True, True], [True, False], [False, False]])
    # no routes: the full shape
    assert given_columns([None, None], SHAPE, [0], "batch") == (SHAPE, [0], None)


def test_hook_refuses_other_widths():
    with pytest.raises(ValueError, match=r"batch: routes must hold all 4 MoE layers or this pipeline stage's 2 "
                                         r"\(MoE layers \[2, 3\]\).*got \[3\] columns"):
        given_columns([ROUTES[:, :3]], SHAPE, [2, 3], "batch")
    with pytest.raises(ValueError, match=r"one width for the whole batch; got \[2, 4\]"):
        given_columns([ROUTES, stage_columns(ROUTES, [2, 3])], SHAPE, [2, 3], "batch")
