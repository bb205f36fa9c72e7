"""Stream a Megatron learner's weights as full HF-named tensors, one parameter at a time.

The one export of a sharded model (the reverse of megapo.weights.hf_load.load_hf_weights: the family's
rename rules, QKV split per KV group, gate/up halves, vocabulary padding stripped, experts renamed to
their global ids), used by Learner.hf_state_dict, weight sync and `megapo convert`. A generator: at any
moment only the current parameter's gathered shards are alive, so a weight sync's extra memory is
bounded by its bucket, not by the model.

- `iter_stage_tensors(module, family, spec)`: this pipeline stage's tensors (collective over the
  stage's tensor- and expert-parallel groups: every rank of the stage calls it and gets them all).
- `iter_model_tensors(...)`: every stage's tensors on every rank (stages take turns broadcasting
  theirs over the pipeline group, described first by a JSON manifest).
- `stage_manifest(...)`: names, shapes and dtypes a stage will yield, computed on the meta device (no
  data, no communication).

With TP=1 and no conversion a tensor is a view of the live parameter, not a copy: consume it
(copy it out) before advancing the generator and before the next optimizer step. owned=True instead
makes every tensor fresh memory the caller may keep (Learner.hf_state_dict); only a parameter that is
not all-gathered is copied for it, since a gather already writes into a new buffer.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megapo.weights.hf_load import Located, locate, tp_shard, weight_tensors
from megapo.models.family import Family, ModelSpec, from_shards
from megapo.weights.buckets import DTYPE_NAMES, DTYPES


@dataclass(frozen=True)
class ManifestItem:
    name: str
    shape: tuple[int, ...]
    dtype: str  # key of buckets.DTYPES


def _groups():
    from megatron.core import parallel_state

    return parallel_state


def _gather_flat(t: torch.Tensor, group) -> torch.Tensor:
    """[group size, *t.shape]: every rank's `t` in rank order, in one buffer."""
    out = torch.empty(group.size() * t.numel(), dtype=t.dtype, device=t.device)
    gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    gather(out, t.contiguous().view(-1), group=group)
    return out.view(group.size(), *t.shape)


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Shards of `t` from every rank of group, in rank order, as views of one gathered buffer."""
    if group is None or group.size() == 1:
        return [t]
    return list(_gather_flat(t, group).unbind(0))


def _tp_shards(local: torch.Tensor, group, dim: int | None, kind: str) -> list[torch.Tensor]:
    """Shards for `from_shards`. Split along dim 0, the gathered buffer already is the concatenation
    (one tensor instead of a list that from_shards would copy into place again); gate/up keeps the
    per-rank list because each shard holds a slice of both halves."""
    if group is None or group.size() == 1:
        return [local]
    gathered = _gather_flat(local, group)
    if dim == 0 and kind != "gate_up":
        return [gathered.view(-1, *local.shape[1:])]
    return list(gathered.unbind(0))


def _to_hf(where: Located, spec: ModelSpec, shards: list[torch.Tensor], dim: int | None) -> list[torch.Tensor]:
    """from_shards, except that an unsplit gate/up parameter becomes two views of its halves instead
    of two copies (from_shards concatenates the halves of every shard, a copy even for one shard)."""
    if where.rule.kind == "gate_up" and len(shards) == 1:
        return list(shards[0].chunk(2, dim=0))
    return from_shards(where.rule, spec, shards, dim=dim)


def _params(module, family: Family, spec: ModelSpec):
    for name, param in weight_tensors(module, family):
        if name == "output_layer.weight" and spec.tied_embeddings:
            continue  # the embedding carries it
        yield name, param


@dataclass(frozen=True)
class _Step:
    """How one parameter is exported: where it goes, how it is sharded, and for an expert parameter the HF
    names of its tensors on every expert-parallel rank ([tensor i][ep rank])."""
    param: torch.nn.Parameter
    where: Located
    dim: int | None
    group: object  # its tensor-parallel group, or None
    expert_names: tuple[tuple[str, ...], ...] | None


# The export plan of a module: name lookups and rules computed once, not on every weight sync (they cost
# about as much as sending a small model). Parameters are held by object, so their storage may move.
_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _plan(module, family: Family, spec: ModelSpec) -> list[_Step]:
    key = (family.name, spec)
    cached = _PLANS.get(module)
    if cached is not None and cached[0] == key:
        return cached[1]
    ps = _groups()
    ep_size, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    per_rank = spec.num_experts // ep_size if spec.num_experts else 0
    steps = []
    for name, param in _params(module, family, spec):
        where = locate(name, module, family, spec)
        dim, group = tp_shard(param)
        names = None
        if where.expert is not None:
            local_index = where.expert - ep_rank * per_rank
            names = tuple(tuple(Located(where.rule, where.layer, r * per_rank + local_index).hf_names()[i]
                                for r in range(ep_size)) for i in range(len(where.rule.hf)))
        steps.append(_Step(param, where, dim, group, names))
    _PLANS[module] = (key, steps)
    return steps


def iter_stage_tensors(module, family: Family, spec: ModelSpec, *, meta: bool = False, dtype: torch.dtype | None = None,
                       owned: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's full HF tensors, gathered over TP and EP (all ranks of the stage call it).
    meta=True: the same names and shapes on the meta device, without communication.
    dtype: convert each parameter to it first (None: keep the parameter's dtype).
    owned: no tensor is a view of a parameter (see the module docstring).
    A family storing tensors fused across experts (Family.pack) gets them fused, as its files hold them."""
    named = _stage_tensors(module, family, spec, meta=meta, dtype=dtype, owned=owned)
    return named if family.pack is None else family.pack(spec, named)


def _stage_tensors(module, family: Family, spec: ModelSpec, *, meta: bool, dtype: torch.dtype | None,
                   owned: bool) -> Iterator[tuple[str, torch.Tensor]]:
    ep_group = _groups().get_expert_model_parallel_group()
    ep_size = ep_group.size()
    with torch.no_grad():
        for step in _plan(module, family, spec):
            param, where, dim, group = step.param, step.where, step.dim, step.group
            target = dtype or param.dtype
            if meta:
                local = torch.empty(param.shape, dtype=target, device="meta")
                shards = [local] * (group.size() if group is not None else 1)
            else:
                gathered = group is not None and group.size() > 1  # the gather's buffer is new memory
                local = param.detach().to(target, copy=owned and not gathered)
                shards = _tp_shards(local, group, dim, where.rule.kind)
            tensors = _to_hf(where, spec, shards, dim)
            del local, shards  # (the `del`s: a generator frame keeps its locals alive across yields)
            if step.expert_names is None:
                yield from zip(where.hf_names(), tensors)
                del tensors
                continue
            for i in range(len(tensors)):
                gathered = [tensors[i]] * ep_size if meta else _all_gather(tensors[i], ep_group)
                yield from zip(step.expert_names[i], gathered)
                del gathered
            del tensors


def stage_manifest(module, family: Family, spec: ModelSpec, *, dtype: torch.dtype | None = None) -> list[ManifestItem]:
    return [ManifestItem(n, tuple(t.shape), DTYPE_NAMES[t.dtype])
            for n, t in iter_stage_tensors(module, family, spec, meta=True, dtype=dtype)]


def encode_manifest(items: list[ManifestItem]) -> torch.Tensor:
    data = json.dumps([[i.name, list(i.shape), i.dtype] for i in items]).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_manifest(data: torch.Tensor) -> list[ManifestItem]:
    return [ManifestItem(n, tuple(s), d) for n, s, d in json.loads(bytes(data.cpu().numpy()).decode())]


def _broadcast_bytes(payload: torch.Tensor | None, src: int, group, device) -> torch.Tensor:
    """Length-prefixed byte broadcast (JSON metadata travels as raw uint8, never as a pickle)."""
    n = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=device)
    torch.distributed.broadcast(n, src=src, group=group)
    buf = payload.to(device) if payload is not None else torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    torch.distributed.broadcast(buf, src=src, group=group)
    return buf


def iter_model_tensors(module, family: Family, spec: ModelSpec, *, dtype: torch.dtype | None = None,
                       owned: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stage's full HF tensors on every rank, one tensor at a time (collective: all ranks call).
    dtype, owned: as in iter_stage_tensors (a received tensor is always new memory)."""
    ps = _groups()
    pp_group = ps.get_pipeline_model_parallel_group()
    if pp_group.size() == 1:
        yield from iter_stage_tensors(module, family, spec, dtype=dtype, owned=owned)
        return
    device = next(module.parameters()).device
    ranks = torch.distributed.get_process_group_ranks(pp_group)
    mine = pp_group.rank()
    for stage, src in enumerate(ranks):
        own = stage == mine
        manifest = encode_manifest(stage_manifest(module, family, spec, dtype=dtype)) if own else None
        items = decode_manifest(_broadcast_bytes(manifest, src, pp_group, device))
        local = iter_stage_tensors(module, family, spec, dtype=dtype, owned=owned) if own else None
        for item in items:
            if own:
                name, t = next(local)
                t = t.contiguous()
            else:
                name, t = item.name, torch.empty(item.shape, dtype=DTYPES[item.dtype], device=device)
            torch.distributed.broadcast(t, src=src, group=pp_group)
            yield name, t
        if own:
            for _ in local:  # exhausted; keeps the generator protocol tidy
                raise RuntimeError("stage yielded more tensors than its manifest")


def is_stage_root() -> bool:
    """The rank that speaks for its pipeline stage: tensor-parallel rank 0 of data-parallel replica 0."""
    ps = _groups()
    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0


def learner_parts(learner):
    """(module, family, spec) of a megapo Learner."""
    return learner.module, learner.family, learner.spec
