"""Route data: what a sample's routes look like, how they are checked, laid onto packed rows and stored.

A sample of n tokens carries routes as an integer array [m, num_moe_layers, topk] with m <= n - 1: row t
holds, for every MoE layer (column j = the j-th MoE layer in layer order; dense layers have no column),
the top-k experts chosen at position t (the rollout engine's convention:
every position fed to the model; the last token is never fed). A row may be partial:
- m < n - 1: positions m..n-2 have no route;
- a (position, layer) entry holding any negative id (e.g. -1) has no route.
Positions without a route fall back to the learner router's own choice (counted in the metrics).

At every position of a micro-batch (megapo/learner/packing.py) routers see, a target and a source:
  GIVEN   the sample's route (replayed),
  MISSING the sample has no route there: the router's own choice (counted as a fallback),
  LAST    a sample's last token (no route by convention; its output predicts nothing): own choice,
  PAD     row padding: k distinct dummy experts, (j*k + i) mod E at the j-th position (never duplicates,
          which would break the token dispatch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

GIVEN, MISSING, LAST, PAD = 0, 1, 2, 3


@dataclass(frozen=True)
class RouteShape:
    num_moe_layers: int
    topk: int
    num_experts: int

    @classmethod
    def from_spec(cls, spec) -> "RouteShape":
        """From a megapo.models.family.ModelSpec: one route column per MoE layer, in layer order; dense
        layers (e.g. deepseek_v3's first_k_dense_replace) have none."""
        if not spec.num_experts:
            return cls(0, 0, 0)
        return cls(spec.num_moe_layers, spec.topk, spec.num_experts)

    @property
    def dtype(self) -> np.dtype:
        """The type routes are kept in (route_dtype)."""
        return route_dtype(self.num_experts)


@functools.lru_cache(maxsize=None)  # asked once per sample per pass; np.iinfo is slow to build
def route_dtype(num_experts: int) -> np.dtype:
    """The smallest signed integer type holding every expert id and -1 (no route): int8 up to 127 experts, int16
    up to 32767; routes are the largest per-token payload of an MoE rollout, so they are kept in it from the
    engine to the learner (a micro-batch's replay targets are widened only when they are used)."""
    for dtype in (np.int8, np.int16, np.int32):
        if num_experts <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


def compact_routes(routes, num_experts: int | None = None) -> np.ndarray:
    """Routes as route_dtype(num_experts) (without num_experts: of the largest id in them), every negative id
    (no route) as -1."""
    arr = np.asarray(routes.cpu().numpy() if isinstance(routes, torch.Tensor) else routes)
    if num_experts is None:
        num_experts = int(arr.max()) + 1 if arr.size else 1
    dtype = route_dtype(num_experts)
    if arr.dtype == dtype:
        return arr
    if np.issubdtype(arr.dtype, np.signedinteger) and arr.size and arr.min() < -1:
        arr = np.maximum(arr, -1)
    return arr.astype(dtype)


def check_routes(routes, num_tokens: int, shape: RouteShape, name: str) -> np.ndarray | None:
    """Validate one sample's routes (None = no routes); return them as [m, L, k] of shape.dtype."""
    if routes is None:
        return None
    arr = _route_array(routes, num_tokens, shape, name)
    _check_values(arr, shape, lambda row: (name, row))
    return compact_routes(arr, shape.num_experts)


def check_batch_routes(routes: list, lengths: list[int], shape: RouteShape, name: str) -> list[np.ndarray | None]:
    """check_routes for every sample (sample i of lengths[i] tokens, named name[i]), the value checks done
    once over all of them."""
    arrays = [None if r is None else _route_array(r, n, shape, f"{name}[{i}]")
              for i, (r, n) in enumerate(zip(routes, lengths))]
    given = [i for i, a in enumerate(arrays) if a is not None and len(a)]
    if given:
        counts = np.asarray([len(arrays[i]) for i in given])
        ends = np.cumsum(counts)

        def name_at(row: int) -> tuple[str, int]:
            j = int(np.searchsorted(ends, row, side="right"))
            return f"{name}[{given[j]}]", row - int(ends[j] - counts[j])

        _check_values(np.concatenate([arrays[i] for i in given]), shape, name_at)
    return [None if a is None else compact_routes(a, shape.num_experts) for a in arrays]


def stage_columns(routes, layers: list[int]) -> np.ndarray | None:
    """One sample's routes [m, L, k] cut to the MoE layers `layers` (a pipeline stage's, in layer order):
    [m, len(layers), k], a copy of just those columns (so it pickles without the others); None stays None."""
    if routes is None:
        return None
    arr = np.asarray(routes.cpu().numpy() if isinstance(routes, torch.Tensor) else routes)
    if arr.ndim != 3:
        raise ValueError(f"routes must have shape [positions, MoE layers, top-k], got {list(arr.shape)}")
    return np.ascontiguousarray(arr[:, list(layers)])


def given_columns(routes: list, shape: RouteShape, layers: list[int],
                  name: str) -> tuple[RouteShape, list[int], int | None]:
    """Which columns of a batch's routes (one array or None per sample) are a pipeline stage's MoE `layers`.
    Routes of every MoE layer (shape.num_moe_layers columns: what rank 0 holds, what the learner records) give
    `layers`; routes of len(layers) columns are that stage's already (stage_columns: what the trainer sends the
    stage's other ranks when PP > 1) and give all their columns. Returns the shape to check them against, the
    columns to keep and the width seen (None: no sample has 3-dimensional routes; check_batch_routes then says
    what is wrong). Any other width, or samples of different widths, is refused."""
    widths = sorted({_width(r) for r in routes if r is not None} - {None})
    full, mine = shape.num_moe_layers, len(layers)
    if not widths or widths == [full]:
        return shape, list(layers), widths[0] if widths else None
    if widths == [mine]:
        return RouteShape(mine, shape.topk, shape.num_experts), list(range(mine)), mine
    raise ValueError(f"{name}: routes must hold all {full} MoE layers or this pipeline stage's {mine} (MoE layers "
                     f"{list(layers)}), one width for the whole batch; got {widths} columns")


def _width(routes) -> int | None:
    shape = routes.shape if hasattr(routes, "shape") else np.shape(routes)
    return int(shape[1]) if len(shape) == 3 else None


def _route_array(routes, num_tokens: int, shape: RouteShape, name: str) -> np.ndarray:
    """One sample's routes [m, L, k] as given (any integer type), their type and shape checked."""
    if isinstance(routes, torch.Tensor):
        routes = routes.cpu().numpy()
    arr = np.asarray(routes)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name}: routes must be integers, got dtype {arr.dtype}")
    if arr.ndim != 3 or arr.shape[1:] != (shape.num_moe_layers, shape.topk):
        raise ValueError(f"{name}: routes must have shape [positions, {shape.num_moe_layers} MoE layers, "
                         f"top-{shape.topk}], got {list(arr.shape)}")
    if arr.shape[0] > num_tokens - 1:
        raise ValueError(f"{name}: {arr.shape[0]} route positions for {num_tokens} tokens "
                         f"(at most {num_tokens - 1}: one per position fed to the model)")
    return arr


def _check_values(arr: np.ndarray, shape: RouteShape, name_at) -> None:
    """Expert ids in range and no expert twice at a (position, layer) of routes [P, L, k];
    name_at(row) -> (the sample's name, the row's position in it) for the message."""
    if not arr.size:
        return
    high = np.flatnonzero((arr >= shape.num_experts).any(axis=(1, 2)))
    if high.size:
        row = int(high[0])
        raise ValueError(f"{name_at(row)[0]}: expert id {int(arr[row].max())} out of range [0, {shape.num_experts})")
    known = (arr >= 0).all(-1)
    ordered = np.sort(arr, axis=-1)
    duplicated = (ordered[..., 1:] == ordered[..., :-1]).any(-1) & known
    if duplicated.any():
        row, layer = map(int, np.argwhere(duplicated)[0])
        name, t = name_at(row)
        raise ValueError(f"{name}: position {t}, MoE layer {layer}: repeated expert in {arr[row, layer].tolist()}")


@dataclass
class RowPlan:
    """Targets and sources of a micro-batch's positions (in the order its routers see them):
    targets [T, L, k] int64, source [T, L] int8."""

    targets: torch.Tensor
    source: torch.Tensor


@dataclass
class RouteTable:
    """A batch's routes laid end to end: position t of sequence i is row starts[i] + t."""

    starts: np.ndarray  # [S]
    targets: np.ndarray  # [P, L, k] compact ids (P = total tokens; rows without a route hold -1)
    given: np.ndarray  # [P, L] bool: a route to replay


def route_table(routes: list[np.ndarray | None], lengths: np.ndarray, layers: list[int]) -> RouteTable:
    """Checked routes (check_routes) of sequences of `lengths` tokens, only MoE layers `layers`."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    have = [i for i, r in enumerate(routes) if r is not None and len(r)]
    k = next((routes[i].shape[-1] for i in have), 1)
    dtype = next((routes[i].dtype for i in have), np.dtype(np.int8))  # compact (check_routes); plans widen it
    targets = np.full((int(lengths.sum()), len(layers), k), -1, dtype=dtype)
    given = np.zeros(targets.shape[:2], dtype=bool)
    if have:
        counts = np.asarray([len(routes[i]) for i in have], dtype=np.int64)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)  # 0.. per sequence
        rows = np.repeat(starts[have], counts) + within
        values = np.concatenate([routes[i] for i in have])[:, layers]
        targets[rows] = values
        given[rows] = (values >= 0).all(-1)
    return RouteTable(starts, targets, given)


def position_plan(table: RouteTable | None, seq: np.ndarray, pos: np.ndarray, lengths: np.ndarray,
                  shape: RouteShape, num_layers: int) -> RowPlan:
    """Targets and sources of positions holding (sequence seq[j], position pos[j]) (seq -1: padding),
    for `num_layers` MoE layers (the table's columns; no table: nothing given)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    count = len(seq)
    j = np.arange(shape.topk)
    dummy = (np.arange(count)[:, None] * shape.topk + j[None, :]) % max(shape.num_experts, 1)
    targets = np.repeat(dummy[:, None, :], num_layers, axis=1)
    source = np.full((count, num_layers), PAD, dtype=np.int8)
    real = np.flatnonzero(seq >= 0)
    last = np.zeros(count, dtype=bool)
    last[real] = pos[real] == lengths[seq[real]] - 1
    body = real[~last[real]]
    source[body] = MISSING
    source[last] = LAST
    if table is not None and body.size:
        rows = table.starts[seq[body]] + pos[body]
        given = table.given[rows]  # [M, L]
        picked = targets[body]
        picked[given] = table.targets[rows][given]
        targets[body] = picked
        src = source[body]
        src[given] = GIVEN
        source[body] = src
    return RowPlan(torch.from_numpy(targets), torch.from_numpy(source))


def row_plan(indices: list[int], offsets: list[int], lengths: list[int], width: int,
             routes: list[np.ndarray | None] | None, shape: RouteShape, layers: list[int] | None = None) -> RowPlan:
    """Lay the routes of one row's samples (routes[i] for i in indices) onto the row's positions.
    `layers`: only these MoE layers (a pipeline stage's), as columns in this order; default all."""
    layers = list(range(shape.num_moe_layers)) if layers is None else list(layers)
    seq = np.full(width, -1, dtype=np.int64)
    pos = np.zeros(width, dtype=np.int64)
    for local, (at, n) in enumerate(zip(offsets, lengths)):
        seq[at:at + n] = local
        pos[at:at + n] = np.arange(n)
    table = None
    if routes is not None:
        picked = [routes[i] for i in indices]
        table = route_table(picked, np.asarray(lengths), layers)
    return position_plan(table, seq, pos, np.asarray(lengths), shape, len(layers))


# ----------------------------------------------------------------------------- files


def save_routes(path: str | Path, routes: list[np.ndarray]) -> None:
    """ROUTES.npz with keys "0", "1", ... (one per input line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **{str(i): np.asarray(r, dtype=np.int32) for i, r in enumerate(routes)})


def load_routes(path: str | Path, count: int) -> list[np.ndarray | None]:
    """Read ROUTES.npz for `count` samples; a missing key is a sample without routes."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    with np.load(path) as data:
        extra = [k for k in data.files if not (k.isdigit() and int(k) < count)]
        if extra:
            raise ValueError(f"{path}: unexpected keys {extra[:5]} (expected '0'..'{count - 1}', one per input line)")
        return [data[str(i)] if str(i) in data.files else None for i in range(count)]
