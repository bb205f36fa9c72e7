"""Token-budget packing: budgets, DP balance, equal micro-batch counts, masks vs written-out loops."""

from __future__ import annotations

import random

import torch

from megapo.learner import packing


def test_rows_respect_budget_and_keep_every_sequence_once():
    rng = random.Random(0)
    lengths = [rng.randint(1, 40) for _ in range(50)]
    rows = packing.pack(list(range(50)), lengths, budget=64, pad_multiple=2)
    seen = sorted(i for r in rows for i in r.indices)
    assert seen == list(range(50))
    for r in rows:
        assert r.used <= 64 and r.width % 2 == 0 and r.width - r.used < 2
        assert r.lengths == [lengths[i] for i in r.indices]


def test_too_long_sequence_gets_its_own_row():
    rows = packing.pack([0, 1], [100, 3], budget=10)
    assert sorted(r.used for r in rows) == [3, 100]


def test_dp_shards_balanced_and_same_number_of_rows():
    rng = random.Random(1)
    lengths = [rng.choice([4, 8, 200]) for _ in range(30)]
    plans = [packing.plan(lengths, dp=3, dp_rank=r, budget=256) for r in range(3)]
    assert len({len(p) for p in plans}) == 1
    loads = [sum(r.used for r in p) for p in plans]
    assert max(loads) - min(loads) <= max(lengths)
    assert sorted(i for p in plans for r in p for i in r.indices) == list(range(30))


def test_equal_width_pads_every_row_to_the_widest():
    plans = [packing.plan([5, 9, 2, 30], dp=2, dp_rank=r, budget=16, pad_multiple=2, equal_width=True) for r in range(2)]
    widths = {r.width for p in plans for r in p}
    assert widths == {30}


def test_row_tensors_and_block_causal_mask_match_loops():
    seqs = [[7, 8, 9], [1, 2], [5]]
    row = packing.PackedRow(indices=[1, 0, 2], lengths=[2, 3, 1], width=8)
    tokens, positions, segments = packing.row_tensors(row, seqs, pad_id=0)
    assert tokens.tolist() == [[1, 2, 7, 8, 9, 5, 0, 0]]
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 0, 1]]
    mask = packing.block_causal_mask(segments)[0, 0]
    seg = segments.tolist()
    for i in range(8):
        for j in range(8):
            visible = (i == j) or (seg[i] >= 0 and seg[i] == seg[j] and j <= i)
            assert bool(mask[i, j]) == (not visible), (i, j)
    assert packing.cu_seqlens(row).tolist() == [0, 2, 5, 6, 8]


def test_padding_waste_of_length_skewed_batch_is_small():
    rng = random.Random(2)
    lengths = [int(rng.paretovariate(1.2) * 16) % 1500 + 4 for _ in range(256)]
    rows = packing.plan(lengths, dp=2, dp_rank=0, budget=2048, pad_multiple=2)
    waste = packing.padding_waste(rows)
    assert 0.0 <= waste < 0.05
    assert packing.padding_waste([packing.PackedRow(indices=[0], lengths=[3], width=4)]) == 0.25


def test_empty_row_is_padding_only():
    rows = packing.plan([5], dp=2, dp_rank=1, budget=8, pad_multiple=2)
    assert len(rows) == 1 and rows[0].indices == [] and rows[0].width == 2
    tokens, positions, segments = packing.row_tensors(rows[0], [[1] * 5], pad_id=0)
    assert torch.equal(segments, torch.tensor([-1, -1]))


def test_rows_spread_evenly_over_the_fewest_rows():
    rng = random.Random(4)
    lengths = [rng.randint(1, 60) for _ in range(100)]
    rows = packing.pack(list(range(100)), lengths, budget=512)
    assert len(rows) == -(-sum(lengths) // 512) or len(rows) == -(-sum(lengths) // 512) + 1
    assert max(r.used for r in rows) - min(r.used for r in rows) <= max(lengths)
