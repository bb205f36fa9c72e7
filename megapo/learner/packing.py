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

Shared prefixes (train.share_prefix): the items packed are `Unit`s. A unit of one sequence is that sequence; a
unit of several (samples of one prompt) holds their common first tokens once, then each member's remaining
tokens, which see the shared tokens and their own (a tree of depth one). The shared part stops one token short
of the common prefix, so every member's part starts with a common token and every slot's logits still predict
the next slot's token: the loss, log-probs and gradients are those of unshared packing (sums in another order).
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


@dataclass(frozen=True)
class Unit:
    """Sequences packed as one item: their first `shared` tokens (the same in all) once, then each member's rest."""

    members: tuple[int, ...]  # input sequences, in slot order
    lengths: tuple[int, ...]  # their full lengths
    shared: int = 0  # leading positions held once (0: a single unshared sequence)

    @property
    def size(self) -> int:
        """Slots the unit fills."""
        return self.shared + sum(self.lengths) - self.shared * len(self.lengths)


def single_units(lengths) -> list[Unit]:
    """One unit per sequence (unit i is sequence i): today's packing."""
    return [Unit((i,), (int(n),)) for i, n in enumerate(lengths)]


def pair_units(lengths, partner_lengths) -> list[Unit]:
    """Unit i: sequence i and sequence len(lengths) + i (its partner), unshared, side by side in one row of one
    micro-batch on one DP rank (Learner.response_js_distance reads both members' logits together)."""
    return group_units(lengths, [partner_lengths])


def group_units(lengths, partners: list) -> list[Unit]:
    """Unit i: sequence i and its partner in each list of `partners` (partners[j][i] the length of sequence
    (j + 1)·len(lengths) + i), unshared, side by side in one row of one micro-batch on one DP rank
    (Learner.response_js_distances reads every member's logits together: sequence i's once for all its partners)."""
    n = len(lengths)
    for j, part in enumerate(partners):
        if len(part) != n:
            name = "partner_lengths" if len(partners) == 1 else f"partners[{j}]"
            raise ValueError(f"{name}: one per sequence ({n}), got {len(part)}")
    return [Unit((i, *((j + 1) * n + i for j in range(len(partners)))),
                 (int(a), *(int(part[i]) for part in partners))) for i, a in enumerate(lengths)]


def partners_per_unit(count: int, longest: int, budget: int) -> int:
    """How many of `count` partners a group unit takes (group_units) so that it fits a micro-batch's token
    `budget` with sequences of up to `longest` tokens: as many as fit beside the sequence, at least one (a pair,
    which may exceed the budget as one row does)."""
    return max(1, min(count, budget // max(longest, 1) - 1))


def member_row(row: PackedRow, units: list[Unit]) -> PackedRow:
    """`row` (whose lengths are its units' sizes) with an unshared unit's members as segments of their own: the
    sequence boundaries Transformer Engine's THD attention takes (a shared unit, which it never gets, stays one)."""
    lengths = [n for i in row.indices for n in (units[i].lengths if not units[i].shared else (units[i].size,))]
    return PackedRow(list(row.indices), lengths, row.width)


def prefix_units(sequences: list[list[int]], prompt_lens, capacity: int, agreed=None) -> list[Unit]:
    """Units of `sequences`: those whose first prompt_lens[i] tokens are the same share their longest common
    prefix but its last token (a lone sequence stays a unit of its own); a group larger than `capacity` slots is
    split into parts that each repeat the prefix. `agreed(groups)`: for each (members, shared) the number of
    leading positions, at most `shared`, on which their given routes agree (the group shares only those)."""
    keyed: dict[tuple, list[int]] = {}
    for i, (s, p) in enumerate(zip(sequences, prompt_lens)):
        keyed.setdefault(tuple(s[:int(p)]), []).append(i)
    groups = [(members, common_prefix(sequences, members) - 1) for members in keyed.values()]
    groups = [(m, s) if len(m) > 1 and s > 0 else (m, 0) for m, s in groups]
    if agreed is not None:
        shared = agreed(groups)
        groups = [(m, min(s, int(a))) for (m, s), a in zip(groups, shared)]
    units = []
    for members, shared in groups:
        if shared < 1:
            units.extend(Unit((i,), (len(sequences[i]),)) for i in members)
        else:
            units.extend(split_group(members, [len(sequences[i]) for i in members], shared, capacity))
    return units


def common_prefix(sequences: list[list[int]], members: list[int]) -> int:
    """Length of the longest prefix all `members` share."""
    n = min(len(sequences[i]) for i in members)
    block = np.array([sequences[i][:n] for i in members])  # [members, n]
    same = (block == block[0]).all(0)
    return n if same.all() else int(np.argmin(same))


def split_group(members: list[int], lengths: list[int], shared: int, capacity: int) -> list[Unit]:
    """Members in order into units of at most `capacity` slots (a member alone is always placed); a part of one
    member is a plain unit."""
    parts: list[list[int]] = [[]]
    used = shared
    for k, n in enumerate(lengths):
        if parts[-1] and used + n - shared > capacity:
            parts.append([])
            used = shared
        parts[-1].append(k)
        used += n - shared
    units = []
    for part in parts:
        if len(part) == 1:
            units.append(Unit((members[part[0]],), (lengths[part[0]],)))
        else:
            units.append(Unit(tuple(members[k] for k in part), tuple(lengths[k] for k in part), shared))
    return units


@dataclass
class SlotMap:
    """Where a micro-batch's sequences sit in its [rows, width] slots.
    Per slot: seq (the sequence whose token it holds; a shared slot: its unit's first member; -1 padding), pos
    (the position in that sequence), first (the first slot of its segment in the row: it sees [first, itself]),
    prefix_end (a member's part also sees its unit's shared slots [first of the unit, prefix_end); 0: none).
    Per sequence in slot order (`order`): the flat slot of its position 0, of its position `split` (where its own
    part starts; 0 for an unshared sequence) and `split`."""

    seq: np.ndarray
    pos: np.ndarray
    first: np.ndarray
    prefix_start: np.ndarray
    prefix_end: np.ndarray
    order: list[int]
    start: np.ndarray
    own: np.ndarray
    split: np.ndarray
    shared: list[tuple[int, tuple[int, ...], int]]  # (first member, the others, shared positions) per shared unit


def slot_map(layout: MicroBatchLayout, units: list[Unit]) -> SlotMap:
    """The SlotMap of a micro-batch whose rows hold `units` (PackedRow.indices are unit indices). The segments
    (a unit's shared slots, each member's own part) are listed in one pass, then written into the maps at once."""
    b, w = layout.shape
    slot = np.arange(w)
    used = np.asarray([row.used for row in layout.rows], dtype=np.int64)
    pos = slot[None, :] - used[:, None]  # padding: 0, 1, ... after the row's end of use
    first = np.tile(slot, (b, 1))  # padding sees only itself
    # per segment: its row's first slot (r * w + at), length, sequence, first position, base of its unit's prefix,
    # shared positions of its unit (0: none); then the order/start/own/split of each member's part
    seg_at, seg_len, seg_seq, seg_pos, seg_base, seg_shared = [], [], [], [], [], []
    order, start, own, split, shared = [], [], [], [], []
    for r, row in enumerate(layout.rows):
        at = r * w
        for u in (units[i] for i in row.indices):
            base, s = at, u.shared
            if s:
                seg_at.append(at), seg_len.append(s), seg_seq.append(u.members[0]), seg_pos.append(0)
                seg_base.append(at), seg_shared.append(0)
                shared.append((u.members[0], u.members[1:], s))
                at += s
            for m, n in zip(u.members, u.lengths):
                seg_at.append(at), seg_len.append(n - s), seg_seq.append(m), seg_pos.append(s)
                seg_base.append(base), seg_shared.append(s)
                order.append(m), start.append(base), own.append(at), split.append(s)
                at += n - s
    as_array = lambda v: np.asarray(v, dtype=np.int64)
    seq = np.full(b * w, -1, dtype=np.int64)
    prefix_start = np.zeros(b * w, dtype=np.int64)
    prefix_end = np.zeros(b * w, dtype=np.int64)
    lengths = as_array(seg_len)
    if lengths.sum():
        at, base, s = as_array(seg_at), as_array(seg_base), as_array(seg_shared)
        slots = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # offset in segment
        flat = np.repeat(at, lengths) + slots
        seq[flat] = np.repeat(as_array(seg_seq), lengths)
        pos.reshape(-1)[flat] = np.repeat(as_array(seg_pos), lengths) + slots
        # a shared segment starts its own block (first = its first slot), as does a member's part
        first.reshape(-1)[flat] = np.repeat(at % w, lengths)
        cut = np.repeat(s > 0, lengths)
        prefix_start[flat[cut]] = np.repeat(base % w, lengths)[cut]
        prefix_end[flat[cut]] = np.repeat(base % w + s, lengths)[cut]
    return SlotMap(seq.reshape(b, w), pos, first, prefix_start.reshape(b, w), prefix_end.reshape(b, w), order,
                   as_array(start), as_array(own), as_array(split), shared)


def slot_tensors(smap: SlotMap, flat_tokens: np.ndarray, starts: np.ndarray, pad_id: int = 0):
    """(tokens [rows, width], position_ids [rows, width]) of a SlotMap; the batch's tokens end to end in
    `flat_tokens`, sequence i starting at starts[i]."""
    real = smap.seq >= 0
    tokens = np.full(smap.seq.shape, pad_id, dtype=np.int64)
    tokens[real] = flat_tokens[starts[smap.seq[real]] + smap.pos[real]]
    return torch.from_numpy(tokens), torch.from_numpy(smap.pos.copy())


def tree_mask(smap: SlotMap) -> torch.Tensor:
    """Megatron's local-spec mask [rows, 1, W, W] of a SlotMap, True = masked: slot i sees [first[i], i] and its
    unit's shared slots [prefix_start[i], prefix_end[i])."""
    w = smap.seq.shape[-1]
    j = torch.arange(w)[None, None, :]
    i = torch.arange(w)[None, :, None]
    first, lo, hi = (torch.from_numpy(a)[:, :, None] for a in (smap.first, smap.prefix_start, smap.prefix_end))
    seen = ((j >= first) & (j <= i)) | ((j >= lo) & (j < hi))
    return (~seen)[:, None]


def slot_spans(smap: SlotMap, lo: np.ndarray, hi: np.ndarray):
    """Gather indices for the positions [lo[i], hi[i]) of the SlotMap's sequences (in its order), as a padded
    [sequences, longest span] view of the flattened [rows * width] slots: (index, mask). A position below a
    sequence's split is in its unit's shared slots, the rest in its own part. Padding entries index slot 0."""
    order = np.asarray(smap.order, dtype=np.int64)
    count = hi[order] - lo[order]
    width = max(1, int(count.max(initial=0)))
    position = lo[order][:, None] + np.arange(width)[None, :]
    mask = np.arange(width)[None, :] < count[:, None]
    in_prefix = position < smap.split[:, None]
    slot = np.where(in_prefix, smap.start[:, None] + position, smap.own[:, None] + position - smap.split[:, None])
    return np.where(mask, slot, 0), mask


def padding_waste(rows: list[PackedRow]) -> float:
    total = sum(r.width for r in rows)
    return 0.0 if total == 0 else 1.0 - sum(r.used for r in rows) / total


def cu_seqlens(row: PackedRow) -> torch.Tensor:
    """Sequence boundaries (THD / PackedSeqParams on Transformer Engine); padding is one extra segment."""
    bounds = [0]
    for n in row.lengths:
        bounds.append(bounds[-1] + n)
    if row.width > bounds[-1]:
        bounds.append(row.width)
    return torch.tensor(bounds, dtype=torch.int32)
