"""Small collectives every part of megapo shares (no-ops in a single process)."""

from __future__ import annotations

import torch


def multi_process() -> bool:
    """Whether torch.distributed runs with more than one rank."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on any (collective when distributed). The flag lives on the device
    the default group's backend reduces: CUDA for NCCL (which refuses CPU tensors), CPU for gloo."""
    if not multi_process():
        return flag
    dist = torch.distributed
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    box = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return bool(box.item() > 0)


def min_over_ranks(values: list[int]) -> list[int]:
    """The element-wise minimum of `values` over every rank (collective when distributed; same device rule as
    any_rank)."""
    if not multi_process():
        return list(values)
    dist = torch.distributed
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    box = torch.tensor(list(values), dtype=torch.int64, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MIN)
    return box.tolist()


def rank() -> int:
    """This process's rank (0 without torch.distributed)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def broadcast_object(obj):
    """Rank 0's `obj` on every rank (collective; no-op in a single process)."""
    if not multi_process():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def scatter_object(objs: list | None):
    """Rank 0's objs[r] on rank r (collective over the default group, as broadcast_object; rank 0 passes one
    object per rank and keeps objs[0] itself, unpickled and unsent; the others pass None). torch's
    scatter_object_list pads every rank's message to the largest pickled object. A single process: objs[0]."""
    if not multi_process():
        return objs[0]
    first = torch.distributed.get_rank() == 0
    if first and len(objs) != torch.distributed.get_world_size():
        raise ValueError(f"scatter_object: {len(objs)} objects for {torch.distributed.get_world_size()} ranks")
    box = [None]
    torch.distributed.scatter_object_list(box, [None, *objs[1:]] if first else None, src=0)
    return objs[0] if first else box[0]


def all_gather_object(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank (collective; [obj] in a single process)."""
    if not multi_process():
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if multi_process():
        torch.distributed.barrier()
