"""The GPU kit's compat section: megapo.compat.apply() is a no-op on CUDA and active on the CPU, read from the
attributes of torch and Megatron it patches.
"""

from __future__ import annotations

from tools.gpu_kit.context import Context
from tools.gpu_kit.helpers import with_checks


def section_compat(ctx: Context) -> dict:
    """megapo.compat.apply() (what the learner calls) changes nothing on CUDA; on CPU its redirects are active."""
    import torch

    from megapo import compat

    changes = compat.apply()
    patched = compat_patched_attributes()
    result = {"changes": changes, "patched_attributes": patched, "applied": compat.applied()}
    if ctx.device == "cuda":
        result["summary"] = f"no-op on CUDA: {len(changes)} changes, {len(patched)} patched attributes"
        return with_checks(result, {
            "apply_returns_no_changes": changes == [] and compat.CHANGES == [],
            "not_applied": not compat.applied(),
            "no_attribute_from_compat": patched == [],
            "no_torch_function_mode": torch._C._len_torch_function_stack() == 0,
            "current_device_is_cuda_index": isinstance(torch.cuda.current_device(), int)})
    result["summary"] = f"cpu: {len(changes)} redirects active"
    return with_checks(result, {"applied": compat.applied(), "changes_listed": len(changes) > 0,
                                "attributes_patched": len(patched) > 0,
                                "current_device_is_cpu": torch.cuda.current_device() == "cpu"})


COMPAT_MODULES = ("megatron.core.tensor_parallel.random", "megatron.core.tensor_parallel.mappings",
                  "megatron.core.transformer.torch_norm", "megatron.core.transformer.moe.moe_utils",
                  "megatron.core.transformer.moe.token_dispatcher",
                  "megatron.core.dist_checkpointing.strategies.filesystem_async",
                  "megatron.core.models.common.embeddings.rope_utils")


def compat_patched_attributes() -> list[str]:
    """Attributes of torch.cuda, torch.Tensor and the Megatron modules compat patches whose value megapo.compat
    defined (what `apply` installs)."""
    import importlib

    import torch

    owners = [torch.cuda, torch.Tensor]
    for module in COMPAT_MODULES:  # (a module another megatron-core release lacks has nothing patched)
        try:
            owners.append(importlib.import_module(module))
        except ImportError:
            continue
    owners += [getattr(m, cls) for m in list(owners) for cls in ("WrappedTorchNorm", "FileSystemWriterAsync")
               if hasattr(m, cls)]
    found = []
    for owner in owners:
        for name, value in list(vars(owner).items()):
            if getattr(value, "__module__", None) == "megapo.compat":
                found.append(f"{getattr(owner, '__name__', owner)}.{name}")
    return sorted(found)
