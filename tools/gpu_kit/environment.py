"""The GPU kit's environment section: Python, torch, CUDA, the GPU, megatron-core and the packages' versions, and
whether Transformer Engine imports (te_import, which the te_fp8 section asks too).
"""

from __future__ import annotations

import os
import platform
import subprocess

from tools.gpu_kit.context import Context
from tools.gpu_kit.helpers import first_line, with_checks


PACKAGES = ("megatron-core", "transformers", "tokenizers", "safetensors", "numpy", "einops", "psutil", "PyYAML",
            "nvidia-nccl-cu13", "transformer-engine")


def package_version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def section_environment(ctx: Context) -> dict:
    import importlib.util

    import megatron.core
    import torch
    from packaging.version import Version

    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "packages": {n: package_version(n) for n in PACKAGES},
            "megatron_core_file": megatron.core.__file__}
    if ctx.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=list(torch.cuda.get_device_capability(0)),
                    multiprocessors=props.multi_processor_count, memory_gib=props.total_memory / 2 ** 30,
                    nccl=".".join(map(str, torch.cuda.nccl.version())), driver=nvidia_smi("driver_version"),
                    cudnn=torch.backends.cudnn.version())
        info["transformer_engine"] = te_import()
    else:
        info["transformer_engine"] = ("not imported: no CUDA (TE needs libcuda, and on CPU it breaks megatron.core); "
                                      f"installed: {importlib.util.find_spec('transformer_engine') is not None}")
    info["summary"] = (f"{info.get('gpu', 'cpu')}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
                       f"megatron-core {info['packages']['megatron-core']}, TE: {str(info['transformer_engine'])[:60]}")
    return with_checks(info, {"megatron_core_at_least_0.16.1":
                              Version(megatron.core.__version__) >= Version("0.16.1")})


def nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.strip() or out.stderr.strip()[:200]
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi: {first_line(exc)}"


def te_import() -> str:
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401

        return f"imported {getattr(transformer_engine, '__version__', '?')}"
    except Exception as exc:  # TE raises more than ImportError when its CUDA libraries are missing
        return ("not importable (its wheels exceed the 64 MiB the device machine takes, so the kit cannot carry "
                f"it): {first_line(exc)}")
