"""[rows x width] packing: row capacity, micro-batch budgets, DP balance, equal shapes, the THD one-row
form, and the tensors / masks / gather indices checked against loops written out here."""

from __future__ import annotations

import random

import numpy as np

from megapo.learner import packing


def all_plans(lengths, dp, **kw):
    return [packing.plan(lengths, dp=dp, dp_rank=r, **kw) for r in range(dp)]


def test_rows_respect_capacity_and_keep_every_sequence_once():
    rng = random.Random(0)
    lengths = [rng.randint(1, 40) for _ in range(50)]
    rows = packing.fill_rows(list(range(50)), lengths, 64)
    assert sorted(i for r in rows for i in r.indices) == list(range(50))
    for r in rows:
        assert r.used <= 64 and r.lengths == [lengths[i] for i in r.indices]
    assert len(rows) <= -(-sum(lengths) // 64) + 1  # best fit leaves at most one row's worth of gaps here


def test_longer_sequence_gets_its_own_row_and_capacity_one_means_one_per_row():
    rows = packing.fill_rows([0, 1], [100, 3], 10)
    assert sorted(r.used for r in rows) == [3, 100]
    mbs = packing.plan([5, 9, 2, 7], dp=1, dp_rank=0, budget=1000, row_tokens=1)
    assert [len(r.indices) for mb in mbs for r in mb.rows] == [1, 1, 1, 1]
    assert {mb.width for mb in mbs} == {9}


def test_micro_batches_hold_at_most_the_budget():
    rng = random.Random(3)
    lengths = [rng.randint(8, 16) for _ in range(512)]
    for budget, row_tokens in [(4096, 0), (8192, 0), (1024, 32), (16, 0)]:
        mbs = packing.plan(lengths, dp=1, dp_rank=0, budget=budget, row_tokens=row_tokens, pad_multiple=2)
        assert sorted(i for mb in mbs for i in mb.indices) == list(range(512))
        width = max(row_tokens, 16)
        expected = -(-len(packing.fill_rows(list(range(512)), lengths, row_tokens or 16)) // max(1, budget // width))
        assert len(mbs) == expected
        for mb in mbs:
            rows, w = mb.shape
            assert w % 2 == 0 and (rows * w <= budget or rows == 1)
            assert all(r.width == w and r.used <= w for r in mb.rows)
        sizes = [mb.shape[0] for mb in mbs]
        assert max(sizes) - min(sizes) <= 1  # rows spread evenly over the micro-batches


def test_dp_shards_balanced_and_same_number_of_micro_batches():
    rng = random.Random(1)
    lengths = [rng.choice([4, 8, 200]) for _ in range(30)]
    plans = all_plans(lengths, 3, budget=256)
    assert len({len(p) for p in plans}) == 1
    loads = [sum(r.used for mb in p for r in mb.rows) for p in plans]
    assert max(loads) - min(loads) <= max(lengths)
    assert sorted(i for p in plans for mb in p for i in mb.indices) == list(range(30))


def test_equal_shapes_pad_every_micro_batch_to_one_shape():
    lengths = [5, 9, 2, 30, 7, 7, 3]
    plans = all_plans(lengths, 2, budget=64, pad_multiple=2, equal_shapes=True)
    shapes = {mb.shape for p in plans for mb in p}
    assert shapes == {(2, 30)}
    assert sorted(i for p in plans for mb in p for i in mb.indices) == list(range(7))


def test_one_row_form_holds_the_same_sequences_as_the_rows():
    rng = random.Random(5)
    lengths = [rng.randint(3, 20) for _ in range(40)]
    rows = packing.plan(lengths, dp=2, dp_rank=1, budget=120, pad_multiple=2)
    thd = packing.plan(lengths, dp=2, dp_rank=1, budget=120, pad_multiple=2, one_row=True)
    assert [sorted(mb.indices) for mb in rows] == [sorted(mb.indices) for mb in thd]
    for mb in thd:
        assert len(mb.rows) == 1 and mb.width % 2 == 0 and 0 <= mb.width - mb.rows[0].used < 2
        assert packing.cu_seqlens(mb.rows[0]).tolist()[-1] == mb.width


def test_empty_micro_batch_is_padding_only():
    mbs = packing.plan([5], dp=2, dp_rank=1, budget=8, pad_multiple=2)
    assert len(mbs) == 1 and mbs[0].indices == [] and mbs[0].shape == (1, 2)
    smap = packing.slot_map(mbs[0], packing.single_units([5]))
    assert (smap.seq == -1).all() and smap.order == []


def test_slot_tensors_and_tree_mask_match_loops_unshared():
    seqs = [[7, 8, 9], [1, 2], [5], [4, 4, 4, 4]]
    layout = packing.MicroBatchLayout([packing.PackedRow([1, 0, 2], [2, 3, 1], 8),
                                       packing.PackedRow([3], [4], 8)], 8)
    flat = np.asarray([t for s in seqs for t in s])
    starts = np.cumsum([len(s) for s in seqs]) - [len(s) for s in seqs]
    smap = packing.slot_map(layout, packing.single_units([len(s) for s in seqs]))
    tokens, positions = packing.slot_tensors(smap, flat, starts, pad_id=0)
    assert tokens.tolist() == [[1, 2, 7, 8, 9, 5, 0, 0], [4, 4, 4, 4, 0, 0, 0, 0]]
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 0, 1, 2, 3]]
    seq = smap.seq
    assert seq.tolist() == [[1, 1, 0, 0, 0, 2, -1, -1], [3, 3, 3, 3, -1, -1, -1, -1]]
    mask = packing.tree_mask(smap)
    assert mask.shape == (2, 1, 8, 8)
    for r in range(2):
        for i in range(8):
            for j in range(8):
                visible = (i == j) or (seq[r, i] >= 0 and seq[r, i] == seq[r, j] and j <= i)
                assert bool(mask[r, 0, i, j]) == (not visible), (r, i, j)
    assert packing.cu_seqlens(layout.rows[0]).tolist() == [0, 2, 5, 6, 8]


def test_shared_unit_slots_positions_and_mask_match_loops():
    """A unit of three samples of one prompt [3, 1, 4, 1] (the last two also share a response token) and a lone
    sequence: slots, positions and visibility written out from the tree's definition."""
    seqs = [[3, 1, 4, 1, 5], [3, 1, 4, 1, 9, 2, 6], [3, 1, 4, 1, 9, 2], [8, 8]]
    units = packing.prefix_units(seqs, [4, 4, 4, 2], capacity=64)
    shared = next(u for u in units if len(u.members) > 1)
    assert shared.members == (0, 1, 2) and shared.shared == 3  # common prefix [3, 1, 4, 1] less its last token
    layout = packing.plan([u.size for u in units], dp=1, dp_rank=0, budget=64)[0]
    smap = packing.slot_map(layout, units)
    flat = np.asarray([t for s in seqs for t in s])
    starts = np.cumsum([len(s) for s in seqs]) - [len(s) for s in seqs]
    tokens, positions = packing.slot_tensors(smap, flat, starts)
    row = layout.rows[0]
    at = {}  # (sequence, position) -> slot, from the unit layout: shared part, then each member's rest
    slot = 0
    for u in (units[i] for i in row.indices):
        for t in range(u.shared):
            for m in u.members:
                at[m, t] = slot + t
        slot += u.shared
        for m, n in zip(u.members, u.lengths):
            for t in range(u.shared, n):
                at[m, t] = slot + t - u.shared
            slot += n - u.shared
    for (m, t), k in at.items():
        assert tokens[0, k] == seqs[m][t] and positions[0, k] == t, (m, t)
    mask = packing.tree_mask(smap)[0, 0]
    for (m, t), i in at.items():
        for (m2, t2), j in at.items():
            if m2 == m and t2 <= t:  # every earlier token of the same sequence, wherever it sits
                assert not mask[i, j], (m, t, t2)
    for i in range(slot):  # and nothing else: each slot sees exactly the earlier tokens of its sequence(s)
        seen = {j for j in range(slot) if not mask[i, j]}
        owners = [(m, t) for (m, t), k in at.items() if k == i]
        want = {at[m, t2] for m, t in owners for t2 in range(t + 1)}
        assert seen == want, i
    # slot_spans: each sequence's positions [lo, hi) in slot order hold its tokens
    lengths = np.asarray([len(s) for s in seqs])
    lo, hi = np.asarray([0, 2, 3, 1]), lengths - 1
    index, real = packing.slot_spans(smap, lo, hi)
    for k, m in enumerate(smap.order):
        assert tokens.reshape(-1)[index[k][real[k]]].tolist() == seqs[m][lo[m]:hi[m]], m


def test_large_group_splits_into_prompt_repeating_parts():
    seqs = [[1, 2, 3, 4] + [i] * 6 for i in range(5)]  # prompt 4, shared 3, each member 7 more slots
    units = packing.prefix_units(seqs, [4] * 5, capacity=3 + 2 * 7)
    assert [u.members for u in units] == [(0, 1), (2, 3), (4,)]
    assert [u.shared for u in units] == [3, 3, 0] and all(u.size <= 17 for u in units)


def test_agreed_routes_limit_what_is_shared():
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7]]  # common prefix 5 -> 4 shared positions
    units = packing.prefix_units(seqs, [3, 3], 64, agreed=lambda groups: [2 for _ in groups])
    assert units[0].shared == 2
    units = packing.prefix_units(seqs, [3, 3], 64, agreed=lambda groups: [0 for _ in groups])
    assert [u.members for u in units] == [(0,), (1,)]


def test_padding_waste_of_length_skewed_batch_is_small():
    rng = random.Random(2)
    lengths = [int(rng.paretovariate(1.2) * 16) % 1500 + 4 for _ in range(256)]
    mbs = packing.plan(lengths, dp=2, dp_rank=0, budget=8192, pad_multiple=2)
    waste = packing.padding_waste([r for mb in mbs for r in mb.rows])
    assert 0.0 <= waste < 0.05
    assert packing.padding_waste([packing.PackedRow(indices=[0], lengths=[3], width=4)]) == 0.25
