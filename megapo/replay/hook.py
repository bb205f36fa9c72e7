"""Routing replay inside the learner's forward passes, through Megatron-core's own RouterReplay.

Megatron (moe_enable_routing_replay=True) gives every TopKRouter a `router_replay` (RouterReplay): with
action REPLAY_FORWARD the router takes its top-k experts from `target_topk_idx` and gathers the gate
scores at those experts (so the router weights still get gradients); REPLAY_BACKWARD pops targets from a
FIFO filled by `set_target_indices`, for the forward that activation recompute re-runs in backward.

`RouteReplayHook` is the learner's `route_hook`. It is told the batch's routes (`set_routes`) and, for
every micro-batch, the [rows x width] layout about to run (`before_forward`). A forward pre-hook on each
router of this rank then sets that router's target for exactly the positions the router sees:
- its layer: routers are this pipeline stage's MoE layers, mapped by their global layer number;
- its positions: Megatron's router sees the micro-batch's tokens flattened [width, rows] (position
  major), and with sequence parallelism this TP rank's contiguous slice of the positions, i.e. a
  contiguous slice of that flattening;
- positions without a route (see routes.py) get the router's own top-k, computed in the hook from the
  same logits with Megatron's own routing function, so partial routes replay the given rows and route
  the rest freely, all in one pass;
- activation recompute: a checkpointed forward runs with grad disabled in training mode, and pushes its
  target onto the FIFO; the recompute (grad enabled) pops it with REPLAY_BACKWARD, so a recompute
  that happens after later micro-batches' forwards (pipeline 1F1B) still gets its own routes.
A forward hook on the router checks the routing map Megatron actually used against the target, and
keeps what was used (`routes_used`). Counts for the metrics are summed over all ranks (`metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megapo.replay.routes import (GIVEN, LAST, MISSING, PAD, RouteShape, RouteTable, RowPlan, check_batch_routes,
                                  given_columns, position_plan, route_table)

# counts per MoE layer (columns): positions with a given route, of which the router's own choice differs
# (before replay); positions routed (not padding), of which Megatron's routing map differs from the
# target (after replay); positions that fell back to the router's own choice for want of a route.
GIVEN_N, DISAGREE_PRE, ROUTED_N, MISMATCH_POST, FALLBACK_N = range(5)


@dataclass
class _Record:
    micro_batch: int
    layer: int  # MoE layer index
    start: int  # first flattened [width, rows] position seen by this rank
    used: torch.Tensor  # [T, k] experts Megatron routed to


class RouteReplayHook:
    def __init__(self, model, config, shape: RouteShape):
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        _check_config(config)
        self.shape = shape
        self.config = config
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if any(r.router_replay is None for r in routers):
            raise ValueError("routing replay: routers were built without moe_enable_routing_replay")
        pattern = moe_layer_pattern(config)
        self.layer_of = {}  # router -> MoE layer index
        for r in routers:
            global_layer = r.layer_number - 1  # Megatron's layer_number is global and 1-based
            self.layer_of[r] = sum(pattern[:global_layer])
        # Megatron keeps every RouterReplay ever built in one global list (a second model would double
        # it); keep exactly this model's, in construction order, so its static helpers see this model.
        RouterReplay.clear_global_router_replay_instances()
        RouterReplay.global_router_replay_instances.extend(r.router_replay for r in routers)
        self.routers = routers
        self.layers = sorted(set(self.layer_of.values()))  # this stage's MoE layers
        self._column = {layer: j for j, layer in enumerate(self.layers)}  # layer -> column of a RowPlan
        self._handles = []
        for r in routers:
            self._handles.append(r.register_forward_pre_hook(self._pre_hook))
            self._handles.append(r.register_forward_hook(self._post_hook))
        self._table: RouteTable | None = None  # the routes of this pass
        self._lengths = np.zeros(0, dtype=np.int64)  # tokens of each sequence of this pass
        self._maps: list[tuple[np.ndarray, np.ndarray]] = []  # per micro-batch: (sequence, position) of
        # each flattened [width, rows] position, in micro-batch order
        self._shared: list = []  # shared-prefix units of this pass: (first member, the others, shared positions)
        self._plan: RowPlan | None = None
        self._records: list[_Record] = []
        self._recomputing: dict = {}  # router -> the target its recompute replays
        self._counts = torch.zeros(shape.num_moe_layers, 5, dtype=torch.float64)
        self.given_columns: int | None = None  # MoE-layer columns of the routes the last set_routes got (None: none)

    # ----------------------------------------------------------------------------- learner calls

    def set_routes(self, routes, sequences: list[list[int]], name: str = "routes") -> None:
        """Start a pass over `sequences` replaying `routes` (None, or one array/None per sequence), each holding
        every MoE layer's columns or only this pipeline stage's (`self.layers`, in order; routes.given_columns)."""
        self._lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        self._table = None
        if routes is not None:
            if len(routes) != len(sequences):
                raise ValueError(f"{name}: {len(routes)} entries for {len(sequences)} sequences")
            # every MoE layer's columns (rank 0, recorded routes) or only this stage's (what the trainer sends the
            # stage's other ranks with PP > 1, megapo.trainer.handout); any other width is refused
            shape, columns, self.given_columns = given_columns(routes, self.shape, self.layers, name)
            routes = check_batch_routes(routes, self._lengths.tolist(), shape, name)
            if any(r is not None for r in routes):
                self._table = route_table(routes, self._lengths, columns)
        else:
            self.given_columns = None
        self._maps = []
        self._shared = []
        self._plan = None
        self._records = []
        self._recomputing.clear()
        for r in self.routers:  # targets and the recompute FIFO are per pass
            r.router_replay.clear_indices()

    def before_forward(self, mb) -> None:
        """Called by the learner's forward step with the micro-batch about to run: its sequence map
        (mb.seq, mb.pos: [rows, width]) laid out as the routers see it, [width, rows] flattened."""
        seq, pos = mb.seq.T.reshape(-1), mb.pos.T.reshape(-1)
        self._maps.append((seq, pos))
        self._shared.extend(mb.shared)
        self._plan = position_plan(self._table, seq, pos, self._lengths, self.shape, len(self.layers))

    # ----------------------------------------------------------------------------- router hooks

    def _slice(self, num_tokens: int) -> int:
        """First flattened position this rank's routers see (sequence parallel: a contiguous slice per TP rank)."""
        from megatron.core import parallel_state

        if not self.config.sequence_parallel:
            return 0
        return parallel_state.get_tensor_model_parallel_rank() * num_tokens

    def _pre_hook(self, router, args):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        replay = router.router_replay
        if router.training and torch.is_grad_enabled() and replay.replay_backward_list:
            # activation recompute of a checkpointed forward: replay what that forward used (FIFO)
            self._recomputing[router] = replay.replay_backward_list[0]  # the target it is about to pop
            replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            return None
        self._recomputing.pop(router, None)
        if self._plan is None:
            raise RuntimeError("routing replay: a router ran outside a learner forward step (no micro-batch set)")
        hidden = args[0]
        layer = self.layer_of[router]
        num_tokens = hidden.numel() // hidden.shape[-1]
        start = self._slice(num_tokens)
        if start + num_tokens > len(self._plan.source):
            raise RuntimeError(f"routing replay: the router sees positions {start}..{start + num_tokens - 1}, "
                               f"the micro-batch has {len(self._plan.source)}")
        column = self._column[layer]
        source = self._plan.source[start:start + num_tokens, column]  # on the host: no device syncs here
        target = self._plan.targets[start:start + num_tokens, column].to(hidden.device)
        free_rows = (source == MISSING) | (source == LAST)
        given = source == GIVEN
        if free_rows.any() or given.any():
            with torch.no_grad():
                own = own_topk(router, hidden)
            free_rows, given = free_rows.to(hidden.device), given.to(hidden.device)
            target = torch.where(free_rows[:, None], own, target)
            counts = self._layer_counts(layer, hidden.device)
            counts[GIVEN_N] += given.sum()
            counts[DISAGREE_PRE] += (given & ~same_sets(own, target)).sum()
            counts[FALLBACK_N] += (source == MISSING).sum().to(hidden.device)
        replay.set_target_indices(target)  # the REPLAY_FORWARD target, also queued for REPLAY_BACKWARD
        checkpointed = router.training and not torch.is_grad_enabled()  # its recompute comes in backward
        if not checkpointed:
            replay.replay_backward_list.clear()  # no recompute follows this forward
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        self._pending = (router, layer, start, target, source)
        return None

    def _post_hook(self, router, args, output):
        _, routing_map = output
        k = self.shape.topk
        if router in self._recomputing:  # a recompute: check it routed exactly as its forward did
            target = self._recomputing.pop(router).to(routing_map.device)
            hit = routing_map.gather(1, target).all(1) & (routing_map.sum(1) == k)
            counts = self._layer_counts(self.layer_of[router], routing_map.device)
            counts[ROUTED_N] += hit.numel()
            counts[MISMATCH_POST] += (~hit).sum()
            return None
        pending_router, layer, start, target, source = self._pending
        assert pending_router is router
        hit = routing_map.gather(1, target).all(1) & (routing_map.sum(1) == k)
        routed = (source != PAD).to(routing_map.device)
        counts = self._layer_counts(layer, routing_map.device)
        counts[ROUTED_N] += routed.sum()
        counts[MISMATCH_POST] += (routed & ~hit).sum()
        # what Megatron routed to, in the target's order where it matches (ascending ids where not);
        # kept on the device until routes_used asks
        actual = torch.sort(routing_map.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :k]
        used = torch.where(hit[:, None], target, actual)
        self._records.append(_Record(len(self._maps) - 1, layer, start, used.detach()))
        return None

    def _layer_counts(self, layer: int, device) -> torch.Tensor:
        if self._counts.device != torch.device(device):
            self._counts = self._counts.to(device)
        return self._counts[layer]

    # ----------------------------------------------------------------------------- results

    def routes_used(self, num_sequences: int) -> list[np.ndarray]:
        """Routes every sequence of the last pass was routed with, [n-1, L, k] of RouteShape.dtype, on every rank
        (collective: gathers the pieces of all TP slices, pipeline stages and DP ranks)."""
        used_all = torch.cat([rec.used for rec in self._records]).cpu().numpy() if self._records else None
        pieces, at = [], 0  # (MoE layer, sequences, positions, [T, k] experts)
        for rec in self._records:
            size = len(rec.used)
            seq, pos = (a[rec.start:rec.start + size] for a in self._maps[rec.micro_batch])
            fed = seq >= 0
            fed[fed] = pos[fed] < self._lengths[seq[fed]] - 1  # a sequence's last token is not fed
            pieces.append((rec.layer, seq[fed], pos[fed], used_all[at:at + size][fed].astype(self.shape.dtype)))
            at += size
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, (pieces, self._shared))
        fed_lengths = self._lengths[:num_sequences] - 1
        starts = np.cumsum(fed_lengths) - fed_lengths
        out = np.full((int(fed_lengths.sum()), self.shape.num_moe_layers, self.shape.topk), -1, dtype=self.shape.dtype)
        for part, _ in gathered:
            for layer, seq, pos, used in part:
                out[starts[seq] + pos, layer] = used
        for _, shared in gathered:  # a shared prefix was routed once, for its unit's first member
            for first, others, n in shared:
                for other in others:
                    out[starts[other]:starts[other] + n] = out[starts[first]:starts[first] + n]
        unrouted = np.flatnonzero((out < 0).any(axis=(1, 2)))
        if unrouted.size:
            i = int(np.searchsorted(np.cumsum(fed_lengths), unrouted[0], side="right"))
            raise RuntimeError(f"routing replay: sequence {i} has positions no rank routed in the last pass")
        return np.split(out, np.cumsum(fed_lengths)[:-1])

    def take_counts(self) -> torch.Tensor:
        """The counts since the last call, summed over all ranks (collective), on the host; then reset."""
        counts = self._counts.clone()
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            counts = counts.to("cuda" if torch.cuda.is_available() else "cpu")  # nccl needs device tensors
            torch.distributed.all_reduce(counts)
        self._counts.zero_()
        return counts.cpu()

    def metrics(self, prefix: str = "replay/") -> dict:
        """fractions(take_counts()): the routing metrics since the last call (collective), then reset."""
        return fractions(self.take_counts(), prefix)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def fractions(counts: torch.Tensor, prefix: str = "replay/") -> dict:
    """Per-layer and overall fractions of counts [L, 5]:
    disagree_pre: the router's own top-k set differs from the given route (before replay);
    disagree_post: Megatron's routing differs from the target (after replay; 0 when replay works);
    fallback_frac: positions without a given route, routed by the router's own choice."""
    out = {}
    total = counts.sum(0)
    out[prefix + "disagree_pre"] = _frac(total[DISAGREE_PRE], total[GIVEN_N])
    out[prefix + "disagree_post"] = _frac(total[MISMATCH_POST], total[ROUTED_N])
    out[prefix + "fallback_frac"] = _frac(total[FALLBACK_N], total[FALLBACK_N] + total[GIVEN_N])
    for layer in range(counts.shape[0]):
        out[f"{prefix}disagree_pre/layer{layer}"] = _frac(counts[layer, DISAGREE_PRE], counts[layer, GIVEN_N])
    return out


def as_replayed(counts: torch.Tensor) -> torch.Tensor:
    """The counts a second pass replaying the routes this pass used would have, on the same weights: every
    position this pass routed (given or fallen back) is given, the router's own choice matches it wherever
    this pass chose freely, so only this pass's disagreements remain (an on-policy step's train counts)."""
    out = counts.clone()
    out[:, GIVEN_N] = counts[:, GIVEN_N] + counts[:, FALLBACK_N]
    out[:, FALLBACK_N] = 0
    return out


def _frac(num, den) -> float:
    return float(num / den) if float(den) > 0 else 0.0


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise: do a [T, k] and b [T, k] hold the same set of experts?"""
    return (a.sort(dim=1).values == b.sort(dim=1).values).all(1)


def own_topk(router, hidden: torch.Tensor) -> torch.Tensor:
    """The router's own top-k experts for `hidden` [T, 1, H], with Megatron's routing function (same
    score function, pre-softmax, groups, expert bias, scaling), ordered by score: [T, k]."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    cfg = router.config
    logits = router.gating(hidden).view(-1, cfg.num_moe_experts)
    probs, routing_map = topk_routing_with_score_function(
        logits, router.topk, use_pre_softmax=cfg.moe_router_pre_softmax, num_groups=cfg.moe_router_num_groups,
        group_topk=cfg.moe_router_group_topk, scaling_factor=cfg.moe_router_topk_scaling_factor,
        score_function=router.score_function, expert_bias=router.expert_bias, fused=False, router_replay=None)
    ranked = probs.float().masked_fill(~routing_map, float("-inf"))
    return ranked.topk(router.topk, dim=1).indices


def moe_layer_pattern(config) -> list[int]:
    """1 for each (global) layer that is an MoE layer, from TransformerConfig.moe_layer_freq."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    return list(freq)


def _check_config(config) -> None:
    """Settings under which Megatron would ignore or alter the replayed routes."""
    if not config.moe_enable_routing_replay:
        raise ValueError("routing replay: TransformerConfig.moe_enable_routing_replay is False")
    if config.moe_router_fusion:
        raise ValueError("routing replay: moe_router_fusion=True returns before the replay hook (replay ignored)")
    if config.moe_expert_capacity_factor is not None:
        raise ValueError("routing replay: expert capacity (token dropping) would drop replayed routes")
    if config.moe_input_jitter_eps is not None:
        raise ValueError("routing replay: input jitter makes the router's own choice random")
    if config.moe_router_load_balancing_type == "sinkhorn":
        raise ValueError("routing replay: sinkhorn routing has no replay hook")


def attach(model, config, spec) -> RouteReplayHook:
    """The learner's route_hook for `model` (unwrapped GPTModel of this rank)."""
    if not spec.num_experts:
        raise ValueError(f"routing_replay: the {spec.family} model has no MoE layers")
    return RouteReplayHook(model, config, RouteShape.from_spec(spec))
