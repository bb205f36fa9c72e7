"""Token-budget packing: sequences -> micro-batches of [rows x width], balanced across DP ranks.

A row holds whole sequences back to back, position ids restarting at 0 for each, attention
block-diagonal causal (sequences never see each other). A micro-batch is several rows of one width,
so its mask is [rows, 1, width, width] rather than one [budget, budget] row: the token budget
(`micro_batch_tokens` = rows x width) grows without a quadratic mask.
- rows: filled best-fit decreasing up to `row_tokens` tokens (0: the batch's longest sequence; a longer
  sequence gets a row of its own, so 1 means one sequence per row), padded to one width per micro-batch,
  a multiple of `pad_multiple` (the TP size: sequence parallel splits every row over TP ranks);
- micro-batches: as many rows as the budget holds (at least one), spread evenly over the fewest;
- every DP rank gets the same number of micro-batches (a rank with fewer gets empty ones): expert
  all-to-alls and pipeline sends are collective, so all ranks run the same number;
- equal_shapes: every micro-batch on every rank is [most rows x width] (the allgather dispatcher needs
  equal token counts over EP, a pipeline without variable_seq_lengths fixed p2p shapes);
- one_row (Transformer Engine's THD format): each micro-batch's sequences in one row [1 x tokens],
  their boundaries given as cu_seqlens.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class PackedRow:
    indices: list[int] = field(default_factory=list)  # which input sequences, in row order
    lengths: list[int] = field(default_factory=list)
    width: int = 0  # padded row length

    @property
    def used(self) -> int:
        return sum(self.lengths)


@dataclass
class MicroBatchLayout:
    """Rows of one width; row r of the [rows, width] tensors is rows[r]."""

    rows: list[PackedRow]
    width: int

    @property
    def indices(self) -> list[int]:
        """The sequences of this micro-batch, row after row."""
        return [i for row in self.rows for i in row.indices]

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.rows), self.width


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def split_over_dp(lengths: list[int], dp: int) -> list[list[int]]:
    """Longest-first, each sequence to the DP rank with the fewest tokens so far."""
    shards: list[list[int]] = [[] for _ in range(dp)]
    load = [0] * dp
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min(range(dp), key=lambda r: (load[r], len(shards[r])))
        shards[r].append(i)
        load[r] += lengths[i]
    return shards


def fill_rows(indices: list[int], lengths: list[int], capacity: int) -> list[PackedRow]:
    """Sequences `indices` into rows of at most `capacity` tokens, best-fit decreasing: longest first,
    each into the row it fills most tightly (a sequence longer than the capacity gets a row of its own)."""
    rows: list[PackedRow] = []
    free: list[tuple[int, int]] = []  # (free tokens, row), sorted
    for i in sorted(indices, key=lambda i: -lengths[i]):
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, r = free.pop(at)
        else:
            room, r = max(capacity, n), len(rows)
            rows.append(PackedRow())
        rows[r].indices.append(i)
        rows[r].lengths.append(n)
        bisect.insort(free, (room - n, r))
    return rows


def group_rows(rows: list[PackedRow], count: int) -> list[list[PackedRow]]:
    """`rows` over `count` micro-batches: row counts differ by at most one, fullest rows spread first."""
    groups: list[list[PackedRow]] = [[] for _ in range(count)]
    load = [0] * count
    cap = -(-len(rows) // count)
    for row in sorted(rows, key=lambda r: -r.used):
        g = min((g for g in range(count) if len(groups[g]) < cap), key=lambda g: (len(groups[g]), load[g]))
        groups[g].append(row)
        load[g] += row.used
    return groups


def row_capacity(lengths: list[int], row_tokens: int) -> int:
    """Tokens a row is filled to: row_tokens, or (0) the longest sequence."""
    if row_tokens < 0:
        raise ValueError(f"row_tokens must be >= 0, got {row_tokens}")
    return row_tokens or max([*lengths, 1])


def plan(lengths: list[int], *, dp: int, dp_rank: int, budget: int, row_tokens: int = 0, pad_multiple: int = 1,
         equal_shapes: bool = False, one_row: bool = False) -> list[MicroBatchLayout]:
    """This DP rank's micro-batches (the same number on every rank)."""
    if budget < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {budget}")
    capacity = row_capacity(lengths, row_tokens)
    width = round_up(max([capacity, *lengths, 1]), pad_multiple)  # the widest row
    rows_per_mb = max(1, budget // width)
    per_rank = [fill_rows(shard, lengths, capacity) for shard in split_over_dp(lengths, dp)]
    count = max(1, max(-(-len(rows) // rows_per_mb) for rows in per_rank))
    groups = [group_rows(rows, count) for rows in per_rank]
    most_rows = max(1, max(len(g) for rank in groups for g in rank))
    out = []
    for group in groups[dp_rank]:
        if equal_shapes:
            rows = group + [PackedRow() for _ in range(most_rows - len(group))]
            mb_width = width
        else:
            rows = group or [PackedRow()]  # an empty micro-batch: padding only, contributes nothing
            mb_width = round_up(max([r.used for r in rows] + [1]), pad_multiple)
        if one_row:
            rows = [PackedRow([i for r in rows for i in r.indices], [n for r in rows for n in r.lengths])]
            mb_width = most_rows * width if equal_shapes else round_up(max(rows[0].used, 1), pad_multiple)
        for row in rows:
            row.width = mb_width
        out.append(MicroBatchLayout(rows, mb_width))
    return out


def padding_waste(rows: list[PackedRow]) -> float:
    total = sum(r.width for r in rows)
    return 0.0 if total == 0 else 1.0 - sum(r.used for r in rows) / total


def sequence_map(layout: MicroBatchLayout) -> tuple[np.ndarray, np.ndarray]:
    """(sequence [rows, width], position [rows, width]): which input sequence each slot holds and its
    position in that sequence; padding is sequence -1 at position 0, 1, ... from the row's end of use."""
    b, w = layout.shape
    lengths = np.asarray([n for row in layout.rows for n in row.lengths], dtype=np.int64)
    indices = np.asarray([i for row in layout.rows for i in row.indices], dtype=np.int64)
    per_row = np.asarray([len(row.lengths) for row in layout.rows], dtype=np.int64)
    row_of = np.repeat(np.arange(b), per_row)  # each sequence's row
    ends = np.cumsum(lengths)
    row_start = np.repeat(np.cumsum(per_row) - per_row, per_row)  # index of the row's first sequence
    offset = (ends - lengths) - np.concatenate([[0], ends])[row_start]  # where each sequence starts in its row
    within = np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - lengths, lengths)
    slots = np.repeat(row_of * w + offset, lengths) + within
    used = np.bincount(row_of, weights=lengths, minlength=b).astype(np.int64)
    seq = np.full(b * w, -1, dtype=np.int64)
    seq[slots] = np.repeat(indices, lengths)
    pos = (np.arange(w)[None, :] - used[:, None]).reshape(-1)  # padding: 0, 1, ... after the row's end of use
    pos[slots] = within
    return seq.reshape(b, w), pos.reshape(b, w)


def batch_tensors(layout: MicroBatchLayout, flat_tokens: np.ndarray, starts: np.ndarray, pad_id: int = 0):
    """(tokens [rows, width], position_ids [rows, width], sequence map) of one micro-batch; the batch's
    tokens laid end to end in `flat_tokens`, sequence i starting at starts[i]."""
    seq, pos = sequence_map(layout)
    real = seq >= 0
    tokens = np.full(seq.shape, pad_id, dtype=np.int64)
    tokens[real] = flat_tokens[starts[seq[real]] + pos[real]]
    return torch.from_numpy(tokens), torch.from_numpy(pos.copy()), (seq, pos)


def block_causal_mask(seq: np.ndarray, pos: np.ndarray) -> torch.Tensor:
    """Megatron's local-spec mask [rows, 1, W, W] from a sequence map (sequence_map), True = masked: slot i
    sees the slots j <= i of its own sequence, i.e. j in [i - pos[i], i]; padding sees only itself, so no
    softmax row is empty."""
    w = seq.shape[-1]
    slot = np.arange(w)
    first = torch.from_numpy(np.where(seq >= 0, slot[None, :] - pos, slot[None, :]))  # [rows, W]
    after = torch.ones(w, w, dtype=torch.bool).triu(1)  # j > i
    return ((torch.arange(w)[None, None, :] < first[:, :, None]) | after)[:, None]


def cu_seqlens(row: PackedRow) -> torch.Tensor:
    """Sequence boundaries (THD / PackedSeqParams on Transformer Engine); padding is one extra segment."""
    bounds = [0]
    for n in row.lengths:
        bounds.append(bounds[-1] + n)
    if row.width > bounds[-1]:
        bounds.append(row.width)
    return torch.tensor(bounds, dtype=torch.int32)


def span_index(seq: np.ndarray, pos: np.ndarray, order: list[int], lo: np.ndarray, hi: np.ndarray):
    """Gather indices for the spans [lo[i], hi[i]) of the sequences `order` (in that order), as a
    padded [len(order), longest span] view of the flattened [rows * width] slots: (index, mask).
    Padding entries index slot 0 and are masked out."""
    flat_seq, flat_pos = seq.reshape(-1), pos.reshape(-1)
    starts = np.flatnonzero((flat_seq >= 0) & (flat_pos == 0))  # each sequence's first slot
    slot_of = np.zeros(int(flat_seq.max(initial=-1)) + 1, dtype=np.int64)
    slot_of[flat_seq[starts]] = starts
    order_arr = np.asarray(order, dtype=np.int64)
    first = slot_of[order_arr] + lo[order_arr]
    count = hi[order_arr] - lo[order_arr]
    width = max(1, int(count.max(initial=0)))
    offsets = np.arange(width)
    mask = offsets[None, :] < count[:, None]
    index = np.where(mask, first[:, None] + offsets[None, :], 0)
    return index, mask
