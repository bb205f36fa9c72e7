"""Route data: what a sample's routes look like, how they are checked, laid onto packed rows and stored.

A sample of n tokens carries routes as an integer array [m, num_moe_layers, topk] with m <= n - 1: row t
holds, for every MoE layer, the top-k experts chosen at position t (the rollout engine's convention:
every position fed to the model; the last token is never fed). A row may be partial:
- m < n - 1: positions m..n-2 have no route;
- a (position, layer) entry holding any negative id (e.g. -1) has no route.
Positions without a route fall back to the learner router's own choice (counted in the metrics).

On a packed row (megapo/learner/packing.py) every position gets a target and a source:
  GIVEN   the sample's route (replayed),
  MISSING the sample has no route there: the router's own choice (counted as a fallback),
  LAST    a sample's last token (no route by convention; its output predicts nothing): own choice,
  PAD     row padding: distinct dummy experts (never duplicates, which would break the token dispatch).
"""

from __future__ import annotations

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
        """From a megapo.models.family.ModelSpec (every layer of a supported MoE family is an MoE layer)."""
        if not spec.num_experts:
            return cls(0, 0, 0)
        return cls(spec.num_layers, spec.topk, spec.num_experts)


def check_routes(routes, num_tokens: int, shape: RouteShape, name: str) -> np.ndarray | None:
    """Validate one sample's routes (None = no routes); return them as int64 [m, L, k]."""
    if routes is None:
        return None
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
    arr = arr.astype(np.int64)
    if arr.size and arr.max() >= shape.num_experts:
        raise ValueError(f"{name}: expert id {int(arr.max())} out of range [0, {shape.num_experts})")
    known = (arr >= 0).all(-1)
    ordered = np.sort(arr, axis=-1)
    duplicated = (ordered[..., 1:] == ordered[..., :-1]).any(-1) & known
    if duplicated.any():
        t, layer = map(int, np.argwhere(duplicated)[0])
        raise ValueError(f"{name}: position {t}, MoE layer {layer}: repeated expert in {arr[t, layer].tolist()}")
    return arr


def dummy_experts(positions: torch.Tensor, shape: RouteShape) -> torch.Tensor:
    """k distinct experts per position, spread over all experts: (p*k + j) mod E, j < k <= E."""
    j = torch.arange(shape.topk)
    return (positions[:, None] * shape.topk + j[None, :]) % shape.num_experts


@dataclass
class RowPlan:
    """Targets and sources of one packed row: targets [W, L, k] int64, source [W, L] int8."""

    targets: torch.Tensor
    source: torch.Tensor


def row_plan(indices: list[int], offsets: list[int], lengths: list[int], width: int,
             routes: list[np.ndarray | None] | None, shape: RouteShape, layers: list[int] | None = None) -> RowPlan:
    """Lay the routes of the row's samples (routes[i] for i in indices) onto the row's positions.
    `layers`: only these MoE layers (a pipeline stage's), as columns in this order; default all."""
    layers = list(range(shape.num_moe_layers)) if layers is None else list(layers)
    L = len(layers)
    targets = dummy_experts(torch.arange(width), shape)[:, None, :].repeat(1, L, 1)
    source = torch.full((width, L), PAD, dtype=torch.int8)
    for i, at, n in zip(indices, offsets, lengths):
        source[at:at + n - 1] = MISSING
        source[at + n - 1] = LAST
        r = routes[i] if routes is not None else None
        if r is None or len(r) == 0:
            continue
        r = torch.as_tensor(r, dtype=torch.int64)[:, layers]
        known = (r >= 0).all(-1)  # [m, L]
        m = r.shape[0]
        block = targets[at:at + m]
        block[known] = r[known]
        src = source[at:at + m]
        src[known] = GIVEN
    return RowPlan(targets, source)


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
