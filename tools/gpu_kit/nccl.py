"""The GPU kit's nccl_group section: collectives of a single-rank NCCL group (GPU only)."""

from __future__ import annotations

import datetime

from tools.gpu_kit.context import Context
from tools.gpu_kit.helpers import first_line, with_checks


def section_nccl_group(ctx: Context) -> dict:
    """A single-rank NCCL group (the learner's default group when it made one): collectives on CUDA tensors,
    and whether a CPU tensor's all_reduce works on it (a learner that reduces a host flag needs that)."""
    ctx.need_cuda()
    import torch
    import torch.distributed as dist

    from megapo.net import free_port

    made_here = not dist.is_initialized()
    if made_here:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    ref = x.clone()
    dist.all_reduce(x)
    dist.broadcast(x, src=0)
    gathered = torch.empty_like(x)
    dist.all_gather_into_tensor(gathered, x)
    torch.cuda.synchronize()
    try:
        host = torch.ones(1)
        dist.all_reduce(host)
        cpu_tensor = "ok"
    except Exception as exc:
        cpu_tensor = first_line(exc)
    result = {"backend": str(dist.get_backend()), "world_size": dist.get_world_size(),
              "group_made_by": "this section" if made_here else "the learner (init_distributed)",
              "nccl": ".".join(map(str, torch.cuda.nccl.version())), "cpu_tensor_all_reduce": cpu_tensor,
              "summary": f"{dist.get_backend()} world 1, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
                         f"CPU-tensor all_reduce: {cpu_tensor[:60]}"}
    same = bool(torch.equal(x, ref) and torch.equal(gathered, ref))
    return with_checks(result, {"backend_is_nccl": dist.get_backend() == "nccl", "collectives_exact": same})
