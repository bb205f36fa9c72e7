"""Token-budget packing: sequences -> packed rows (micro-batches), balanced across DP ranks.

A micro-batch is one row holding several whole sequences back to back, position ids restarting at 0
for each, attention block-diagonal-causal (so sequences never see each other). Rows are filled up to
`budget` tokens (first-fit decreasing), and rows are padded to a multiple of `pad_multiple` (the TP
size: sequence parallel splits the row over TP ranks). A sequence longer than the budget gets a row
of its own. Every DP rank gets the same number of rows (ranks with fewer get empty ones): expert
all-to-alls and pipeline sends are collective, so all ranks must run the same number of micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PackedRow:
    indices: list[int] = field(default_factory=list)  # which input sequences, in row order
    lengths: list[int] = field(default_factory=list)
    width: int = 0  # padded row length

    @property
    def used(self) -> int:
        return sum(self.lengths)

    @property
    def offsets(self) -> list[int]:
        out, at = [], 0
        for n in self.lengths:
            out.append(at)
            at += n
        return out


def split_over_dp(lengths: list[int], dp: int) -> list[list[int]]:
    """Longest-first, each sequence to the DP rank with the fewest tokens so far."""
    shards: list[list[int]] = [[] for _ in range(dp)]
    load = [0] * dp
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min(range(dp), key=lambda r: (load[r], len(shards[r])))
        shards[r].append(i)
        load[r] += lengths[i]
    return shards


def pack(indices: list[int], lengths: list[int], budget: int, pad_multiple: int = 1) -> list[PackedRow]:
    """Sequences `indices` into as few rows of at most `budget` tokens as first-fit decreasing finds,
    then spread evenly over that many rows (longest first, each to the emptiest row) when that still
    fits the budget: even rows keep pipeline stages busy and cost little when rows must be equal width."""
    if budget < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {budget}")
    order = sorted(indices, key=lambda i: -lengths[i])
    rows: list[PackedRow] = []
    for i in order:
        for row in rows:
            if row.used + lengths[i] <= budget:
                break
        else:
            row = PackedRow()
            rows.append(row)
        row.indices.append(i)
        row.lengths.append(lengths[i])
    even = [PackedRow() for _ in rows]
    for i in order:
        row = min(even, key=lambda r: r.used)
        row.indices.append(i)
        row.lengths.append(lengths[i])
    if all(r.used <= budget or len(r.indices) == 1 for r in even):
        rows = even
    for row in rows:
        row.width = -(-row.used // pad_multiple) * pad_multiple
    return rows


def plan(lengths: list[int], *, dp: int, dp_rank: int, budget: int, pad_multiple: int = 1,
         equal_width: bool = False) -> list[PackedRow]:
    """This DP rank's rows, padded with empty rows to the same count on every rank.
    equal_width: every row (on every rank) padded to the widest, for pipelines with fixed shapes."""
    shards = split_over_dp(lengths, dp)
    per_rank = [pack(s, lengths, budget, pad_multiple) for s in shards]
    count = max(1, max(len(rows) for rows in per_rank))
    widest = max([r.width for rows in per_rank for r in rows] + [pad_multiple])
    rows = per_rank[dp_rank]
    while len(rows) < count:
        rows.append(PackedRow(width=pad_multiple))  # an empty row: only padding, contributes nothing
    if equal_width:
        for row in rows:
            row.width = widest
    return rows


def padding_waste(rows: list[PackedRow]) -> float:
    total = sum(r.width for r in rows)
    return 0.0 if total == 0 else 1.0 - sum(r.used for r in rows) / total


def row_tensors(row: PackedRow, sequences: list[list[int]], pad_id: int = 0):
    """(tokens [1, W], position_ids [1, W], segment ids [W]; padding is segment -1)."""
    tokens = torch.full((1, row.width), pad_id, dtype=torch.long)
    positions = torch.zeros((1, row.width), dtype=torch.long)
    segments = torch.full((row.width,), -1, dtype=torch.long)
    for s, (i, at, n) in enumerate(zip(row.indices, row.offsets, row.lengths)):
        tokens[0, at:at + n] = torch.as_tensor(sequences[i], dtype=torch.long)
        positions[0, at:at + n] = torch.arange(n)
        segments[at:at + n] = s
    pad = row.width - row.used
    if pad:
        positions[0, row.used:] = torch.arange(pad)
    return tokens, positions, segments


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """Megatron's local-spec mask [1, 1, W, W], True = masked: token i sees j <= i of its own sequence.
    Padding tokens (segment -1) see only themselves, so no softmax row is empty."""
    w = segments.numel()
    idx = torch.arange(w)
    same = segments[:, None] == segments[None, :]
    same &= segments[:, None] >= 0
    allowed = (same & (idx[None, :] <= idx[:, None])) | torch.eye(w, dtype=torch.bool)
    return (~allowed)[None, None]


def cu_seqlens(row: PackedRow) -> torch.Tensor:
    """Sequence boundaries (THD / PackedSeqParams on Transformer Engine); padding is one extra segment."""
    bounds = [0]
    for n in row.lengths:
        bounds.append(bounds[-1] + n)
    if row.width > bounds[-1]:
        bounds.append(row.width)
    return torch.tensor(bounds, dtype=torch.int32)
