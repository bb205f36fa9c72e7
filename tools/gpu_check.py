"""GPU validation kit (issue 21): one script that proves megapo's GPU paths on one GPU in a few minutes.

    bash tools/gpu_check.sh                               # on the device machine (docs/gpu.md)
    python -m tools.gpu_check --out DIR                   # the check itself (needs CUDA)
    python -m tools.gpu_check --out DIR --cpu-dry-run     # every section at toy sizes on the CPU (CI)

Writes DIR/gpu_check.json (every number) and DIR/gpu_check.txt (one line per section). Sections, in order:
environment, compat (a no-op on CUDA), logprobs (learner vs transformers on the same device, fp32 and bf16),
train_step (one RL step), checkpoint (save/load round trip), bf16_step (the bf16 learner: log-probs, one step),
routing_replay, nccl_group (one rank), large_train (a ~1.5 B
random Qwen3-MoE: tokens/s, MFU, peak memory), engine_decode (the embedded engine on that model), broadcast
(the weight-sync transport between two processes: NCCL on a GPU, gloo in the dry run), te_fp8.

Each section records a status: "ok"; "failed: <checks>" (it ran and a number is out of its bound); "error"
(an exception, its traceback kept); "timeout"; "skipped: no CUDA" (GPU-only sections without a GPU);
"unavailable: <why>" (Transformer Engine, which cannot be carried); "skipped: time budget spent".
The sections run in one worker process that this process watches: a section past its timeout (or the
global budget) gets the worker killed, and a new worker runs the sections still to go, so one hung or
crashed section never stops the others. The dry run hides CUDA from the worker (CUDA_VISIBLE_DEVICES="").
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BF16_PEAK_TFLOPS = 790.0  # H200 bf16 matrix product measured on this workplace's machine (device KINDS.md)
DEFAULT_BUDGET_S = 450.0  # the whole check on the H200: within the 8 minutes issue 21 allows
# |learner - transformers| per-token log-prob bounds. fp32: the same bound as `megapo convert --verify`.
# bf16: transformers in bf16 against the fp32 learner; bf16 keeps 8 significant bits (a logit of size 1 rounds by
# up to 4e-3 and each layer adds its own), so the bound is a few times the gap seen on CPU (9e-3 to 1.2e-2); the
# control column shows transformers' own fp32-vs-bf16 gap on the same device.
TOL_FP32 = 1e-4
TOL_BF16 = 5e-2
TOL_RELOAD = 1e-6  # log-probs of a learner loaded from a checkpoint vs the learner that saved it


class Skip(Exception):
    """A section that did not run, with its status ("skipped: no CUDA", "unavailable: ...")."""


# ----------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class LargeShape:
    layers: int
    experts: int
    topk: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    moe_ffn: int
    vocab: int


@dataclass(frozen=True)
class Sizes:
    large: LargeShape
    train_sequences: int  # sequences of the large model's train batch
    train_length: int  # tokens per sequence (prompt + response)
    micro_batch_tokens: int
    warmup_steps: int
    timed_steps: int
    engine_prompts: int
    engine_prompt_length: int
    engine_new_tokens: int


# 16 layers, 64 experts top-8, 1.50 B parameters (0.53 B active), Qwen3's vocabulary and head size
GPU_SIZES = Sizes(LargeShape(layers=16, experts=64, topk=8, hidden=1024, heads=16, kv_heads=4, head_dim=128,
                             moe_ffn=352, vocab=151936),
                  train_sequences=16, train_length=512, micro_batch_tokens=8192, warmup_steps=1, timed_steps=3,
                  engine_prompts=16, engine_prompt_length=64, engine_new_tokens=32)
DRY_SIZES = Sizes(LargeShape(layers=2, experts=8, topk=2, hidden=64, heads=4, kv_heads=2, head_dim=16, moe_ffn=64,
                             vocab=512),
                  train_sequences=4, train_length=32, micro_batch_tokens=128, warmup_steps=1, timed_steps=2,
                  engine_prompts=2, engine_prompt_length=8, engine_new_tokens=8)


# ----------------------------------------------------------------------------- worker context


class Context:
    """What sections share inside one worker: the work folder, sizes, tiny models on disk and the one Learner
    this process may hold (Megatron's state is per process: a new one replaces the old)."""

    def __init__(self, work: Path, dry_run: bool, peak_tflops: float):
        import torch

        self.work, self.dry_run, self.peak_tflops = work, dry_run, peak_tflops
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.sizes = DRY_SIZES if dry_run else GPU_SIZES
        self._learner = None
        self._learner_key = None

    def need_cuda(self) -> None:
        if self.device != "cuda":
            raise Skip("skipped: no CUDA")

    def tiny_model(self, family: str = "qwen3_moe") -> Path:
        from megapo.models.tiny import write_tiny_model

        out = self.work / f"tiny_{family}"
        if not (out / "config.json").is_file():  # (a restarted worker reuses what the last one wrote)
            tmp = self.work / f".tmp_tiny_{family}_{os.getpid()}"
            write_tiny_model(tmp, family)
            os.replace(tmp, out)
        return out

    def learner(self, model_dir: Path, *, fresh: bool = False, **kwargs):
        """The Learner of `model_dir` (built once and reused unless `fresh`)."""
        from megapo.config import OptimConfig, ParallelConfig
        from megapo.learner.learner import Learner

        key = (str(model_dir), tuple(sorted(kwargs.items())))
        if fresh or key != self._learner_key:
            self.release()
            parallel = kwargs.pop("parallel", None) or ParallelConfig()
            optim = kwargs.pop("optim", None) or OptimConfig(lr=1e-3)
            self._learner = Learner(model_dir, parallel, optim, **kwargs)
            self._learner_key = key
        return self._learner

    def release(self) -> None:
        import torch

        if self._learner is not None:
            self._learner.close()
        self._learner = self._learner_key = None
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def synchronize(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()


# ----------------------------------------------------------------------------- helpers


def max_abs_diff(a: list, b: list) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def transformers_logprobs(model_dir: Path, sequences: list[list[int]], device: str, dtype) -> list:
    """log p(seq[t] | seq[:t]) from transformers' own forward in `dtype` on `device` (fp32 log-softmax), on CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq], device=device)
            logits = model(input_ids=ids).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].cpu())
    del model
    return out


def rl_batch(learner, vocab: int, *, groups: int, group_size: int, length: int, seed: int) -> list[dict]:
    """An RL batch as the trainer builds it: prompts x samples of random tokens, GRPO advantages of random
    rewards, π_old and rollout log-probs from the learner itself (on-policy)."""
    import torch

    from megapo.algorithms import compute_advantages

    gen = torch.Generator().manual_seed(seed)
    prompt_len = max(1, length // 4)
    sequences = []
    for _ in range(groups):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        for _ in range(group_size):
            sequences.append(prompt + torch.randint(0, vocab, (length - prompt_len,), generator=gen).tolist())
    rewards = torch.randint(0, 2, (groups, group_size), generator=gen).float()
    rewards[:, 0], rewards[:, -1] = 0.0, 1.0  # every group mixed: non-zero advantages
    advantages = compute_advantages("grpo", rewards).reshape(-1).tolist()
    old = learner.logprobs(sequences)
    return [dict(tokens=s, prompt_len=prompt_len, advantage=a, old_logp=o[prompt_len - 1:].tolist(),
                 rollout_logp=o[prompt_len - 1:].tolist()) for s, a, o in zip(sequences, advantages, old)]


def snapshot(learner) -> dict:
    return {name: t.detach().to("cpu", copy=True) for name, t in learner.hf_state_dict()}


def finite_metrics(metrics: dict) -> bool:
    return all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))


def cuda_memory() -> dict:
    import torch

    gib = 2 ** 30
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / gib,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / gib,
            "device_total_gib": torch.cuda.get_device_properties(0).total_memory / gib}


def with_checks(result: dict, checks: dict[str, bool]) -> dict:
    result["checks"] = {k: bool(v) for k, v in checks.items()}
    failed = [k for k, v in checks.items() if not v]
    result["status"] = "failed: " + ", ".join(failed) if failed else "ok"
    return result


def first_line(exc: BaseException, limit: int = 400) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__


# ----------------------------------------------------------------------------- sections


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
                  "megatron.core.transformer.moe.token_dispatcher")


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
    owners += [getattr(m, "WrappedTorchNorm") for m in owners if hasattr(m, "WrappedTorchNorm")]
    found = []
    for owner in owners:
        for name, value in list(vars(owner).items()):
            if getattr(value, "__module__", None) == "megapo.compat":
                found.append(f"{getattr(owner, '__name__', owner)}.{name}")
    return sorted(found)


def section_logprobs(ctx: Context) -> dict:
    """Per-token log-probs of the learner vs transformers' forward on the same device: fp32 (tight) and
    transformers in bf16 (the learner computes in fp32 only), for every family `megapo tiny-model` writes."""
    import torch

    from megapo.convert.verify import sequences as fixed_sequences
    from megapo.models.tiny import tiny_families

    families, checks = {}, {}
    for family in ("qwen3_moe", *[f for f in tiny_families() if f != "qwen3_moe"]):
        model_dir = ctx.tiny_model(family)
        learner = ctx.learner(model_dir)
        seqs = fixed_sequences(learner.spec.vocab_size, seed=0)
        got = learner.logprobs(seqs)
        ref32 = transformers_logprobs(model_dir, seqs, ctx.device, torch.float32)
        ref16 = transformers_logprobs(model_dir, seqs, ctx.device, torch.bfloat16)
        entry = {"tokens": sum(len(s) - 1 for s in seqs), "learner_dtype": "float32",
                 "fp32": {"max_abs_diff": max_abs_diff(got, ref32), "tol": TOL_FP32},
                 "bf16": {"max_abs_diff": max_abs_diff(got, ref16), "tol": TOL_BF16,
                          "transformers_fp32_vs_bf16": max_abs_diff(ref32, ref16)}}
        families[family] = entry
        checks[f"{family}_fp32"] = entry["fp32"]["max_abs_diff"] <= TOL_FP32
        checks[f"{family}_bf16"] = entry["bf16"]["max_abs_diff"] <= TOL_BF16
    main = families["qwen3_moe"]
    result = {"device": ctx.device, "families": families,
              "note": "the fp32 learner; bf16 = transformers in bf16 vs the fp32 learner, the gap a bf16 engine would "
                      "show (the bf16 learner: section bf16_step)",
              "summary": f"qwen3_moe fp32 {main['fp32']['max_abs_diff']:.2e} (tol {TOL_FP32:g}), bf16 "
                         f"{main['bf16']['max_abs_diff']:.2e} (tol {TOL_BF16:g}); families {', '.join(families)}"}
    return with_checks(result, checks)


def section_train_step(ctx: Context) -> dict:
    """One RL step (GSPO on GRPO advantages) of the tiny Qwen3-MoE: finite, and it moves the weights."""
    import torch

    learner = ctx.learner(ctx.tiny_model())
    batch = rl_batch(learner, learner.spec.vocab_size, groups=4, group_size=4, length=24, seed=1)
    before = snapshot(learner)
    metrics = learner.train_step(batch, "gspo", "auto")
    ctx.synchronize()
    after = snapshot(learner)
    changed = [n for n in before if not bool((before[n] == after[n]).all())]
    deltas = {n: float((after[n] - before[n]).abs().max()) for n in before}
    new_logp = learner.logprobs([s["tokens"] for s in batch])
    moved = max(float((new[s["prompt_len"] - 1:] - torch.tensor(s["old_logp"])).abs().max())
                for new, s in zip(new_logp, batch))
    result = {"metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
              "tensors": len(before), "tensors_changed": len(changed), "max_weight_delta": max(deltas.values()),
              "max_logprob_change": moved,
              "summary": f"loss {metrics['loss']:.4g}, grad_norm {metrics['grad_norm']:.3g}, {len(changed)}/"
                         f"{len(before)} tensors changed, max |Δ log-prob| {moved:.3g}"}
    return with_checks(result, {
        "metrics_finite": finite_metrics(metrics), "update_applied": metrics.get("update_ok") is True,
        "not_skipped": metrics.get("skipped_nonfinite") == 0,
        "grad_norm_positive": metrics["grad_norm"] > 0, "every_tensor_changed": len(changed) == len(before),
        "weights_finite": all(math.isfinite(v) for v in deltas.values()), "logprobs_changed": moved > 0})


def section_checkpoint(ctx: Context) -> dict:
    """Learner.save after a step, a fresh Learner's load, the same log-probs, and a step after the load."""
    from megapo.convert.verify import sequences as fixed_sequences

    model_dir = ctx.tiny_model()
    learner = ctx.learner(model_dir)
    batch = rl_batch(learner, learner.spec.vocab_size, groups=2, group_size=2, length=16, seed=2)
    learner.train_step(batch, "gspo", "auto")  # so Adam has state to save
    seqs = fixed_sequences(learner.spec.vocab_size, seed=0)
    ref, step = learner.logprobs(seqs), learner.step
    ckpt = ctx.work / "checkpoint"
    shutil.rmtree(ckpt, ignore_errors=True)
    learner.save(ckpt)
    fresh = ctx.learner(model_dir, fresh=True)
    fresh.load(ckpt)
    loaded_step = fresh.step
    diff = max_abs_diff(fresh.logprobs(seqs), ref)
    metrics = fresh.train_step(batch, "gspo", "auto")  # Adam's loaded state in use
    result = {"max_abs_diff": diff, "tol": TOL_RELOAD, "step_saved": step, "step_loaded": loaded_step,
              "summary": f"reloaded log-probs within {diff:.2e} (tol {TOL_RELOAD:g}), step {loaded_step}"}
    return with_checks(result, {"logprobs_equal": diff <= TOL_RELOAD, "step_restored": loaded_step == step,
                                "step_after_load": finite_metrics(metrics) and metrics.get("update_ok") is True})


def section_routing_replay(ctx: Context) -> dict:
    """R3 on this device: the embedded engine's samples and routes, the learner's old-log-prob pass replaying
    them (equal to the engine's log-probs in fp32), and a train step that follows the routes exactly."""
    import torch

    from megapo.algorithms import compute_advantages
    from megapo.engines.base import SamplingParams
    from megapo.engines.embedded import EmbeddedEngine
    from megapo.replay import modes

    model_dir = ctx.tiny_model()
    engine = EmbeddedEngine(model_dir)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, engine.spec.vocab_size, (8,), generator=gen).tolist() for _ in range(4)]
    groups = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=12, return_routes=True, seed=7))
    rewards = torch.tensor([[0.0, 1.0]] * len(groups))
    advantages = compute_advantages("grpo", rewards).reshape(-1).tolist()
    samples = [dict(tokens=x.prompt_ids + x.output_ids, prompt_len=len(x.prompt_ids), routes=x.routes,
                    rollout_logp=list(x.logprobs)) for g in groups for x in g]
    learner = ctx.learner(model_dir, routing_replay=True)
    old, old_metrics = modes.old_logprobs(learner, samples, "r3")
    for sample, logp, adv in zip(samples, old, advantages):
        sample.update(old_logp=logp.tolist(), advantage=adv)
    diff = max(float((lp - torch.tensor(s["rollout_logp"])).abs().max()) for lp, s in zip(old, samples))
    kl = modes.mismatch_kl(learner, samples, old)
    metrics = learner.train_step(samples, "gspo", "auto")
    result = {"samples": len(samples), "replayed_vs_engine_max_abs": diff, "tol": TOL_FP32, "old_pass": old_metrics,
              "mismatch": kl, "train_disagree_post": metrics.get("replay/disagree_post"),
              "summary": f"replayed log-probs within {diff:.2e} of the engine's (tol {TOL_FP32:g}), train "
                         f"disagree_post {metrics.get('replay/disagree_post')}"}
    return with_checks(result, {"replayed_logprobs_match_engine": diff <= TOL_FP32,
                                "train_follows_routes": metrics.get("replay/disagree_post") == 0,
                                "step_finite": finite_metrics(metrics) and metrics.get("update_ok") is True})


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


def large_model_dir(ctx: Context) -> Path:
    """config.json of the large random Qwen3-MoE (no weights: the learner initialises it, hf_weights=False)."""
    from megapo.models.tiny import build_config

    shape = ctx.sizes.large
    out = ctx.work / "large_qwen3_moe"
    if not (out / "config.json").is_file():
        config = build_config("qwen3_moe", vocab_size=shape.vocab, hidden=shape.hidden, layers=shape.layers,
                              experts=shape.experts, topk=shape.topk, heads=shape.heads, kv_heads=shape.kv_heads,
                              head_dim=shape.head_dim, ffn=shape.moe_ffn, moe_ffn=shape.moe_ffn, eos_id=1, pad_id=0,
                              max_positions=max(1024, ctx.sizes.train_length))
        out.mkdir(parents=True, exist_ok=True)
        config.to_json_file(str(out / "config.json"))
    return out


def large_learner(ctx: Context):
    from megapo.config import OptimConfig

    return ctx.learner(large_model_dir(ctx), hf_weights=False, optim=OptimConfig(lr=1e-5),
                       micro_batch_tokens=ctx.sizes.micro_batch_tokens)


def model_shape(model_dir: Path):
    from megapo.layout import read_hf_config
    from tools.bench.projection import ModelShape

    return ModelShape.from_hf_config(read_hf_config(model_dir), name="gpu_check_large")


def section_large_train(ctx: Context) -> dict:
    """Train-step tokens/s, MFU against the bf16 peak and peak memory of the large random Qwen3-MoE."""
    import statistics

    import torch

    s = ctx.sizes
    ctx.release()
    if ctx.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model_dir = large_model_dir(ctx)
    learner = large_learner(ctx)
    ctx.synchronize()
    build_s = time.perf_counter() - start
    groups = max(1, s.train_sequences // 4)
    start = time.perf_counter()
    batch = rl_batch(learner, learner.spec.vocab_size, groups=groups, group_size=s.train_sequences // groups,
                     length=s.train_length, seed=3)  # includes the old-log-prob pass
    ctx.synchronize()
    logprob_pass_s = time.perf_counter() - start
    step_s, metrics = timed_steps(ctx, learner, batch, s.warmup_steps, s.timed_steps)
    tokens = sum(len(b["tokens"]) for b in batch)
    shape = model_shape(model_dir)
    # mean keys per query of causal attention over whole sequences: (L + 1) / 2, token-weighted
    context = sum(len(b["tokens"]) * (len(b["tokens"]) + 1) / 2 for b in batch) / tokens
    flops = tokens * shape.flops_per_token(context, train=True)
    median = statistics.median(step_s)
    result = {
        "device": ctx.device, "model": asdict(s.large), "total_params": shape.total_params,
        "active_params": shape.active_params, "matmul_active_params": shape.matmul_active_params,
        "sequences": len(batch), "tokens_per_step": tokens, "micro_batch_tokens": s.micro_batch_tokens,
        "build_s": build_s, "logprob_pass_s": logprob_pass_s, "logprob_pass_tokens_per_s": tokens / logprob_pass_s,
        "step_s": step_s, "step_s_median": median, "tokens_per_s": tokens / median,
        "flops_per_step": flops, "achieved_tflops": flops / median / 1e12, "peak_tflops": ctx.peak_tflops,
        "mfu": flops / median / 1e12 / ctx.peak_tflops,
        "flop_formula": "tokens * 3 * (2 * matmul_active_params + 4 * layers * heads * head_dim * attn_context); "
                        "matmul_active_params = per layer q,k,v,o + router + top-k experts' gate/up/down, plus lm_head "
                        "(tools.bench.projection.ModelShape.flops_per_token); attn_context = token-weighted mean of "
                        "(L + 1) / 2; training = 3 x forward",
        "learner_dtype": "float32 (the Learner has no bf16 path: MFU against the bf16 peak is bounded by fp32 rates)",
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "last_metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
    if ctx.device == "cuda":
        result["memory"] = cuda_memory()
        result["tf32"] = tf32_steps(ctx, learner, batch, flops)
    mem = result.get("memory", {}).get("peak_allocated_gib")
    result["summary"] = (f"{shape.total_params / 1e6:.1f} M params ({shape.active_params / 1e6:.1f} M active): "
                         f"{result['tokens_per_s']:.0f} tok/s, {result['achieved_tflops']:.1f} TFLOP/s, MFU "
                         f"{result['mfu']:.3f} of {ctx.peak_tflops:g}" + (f", peak {mem:.1f} GiB" if mem else ""))
    return with_checks(result, {"metrics_finite": finite_metrics(metrics),
                                "updates_applied": metrics.get("update_ok") is True})


def timed_steps(ctx: Context, learner, batch, warmup: int, timed: int) -> tuple[list[float], dict]:
    metrics = {}
    for _ in range(warmup):
        metrics = learner.train_step(batch, "gspo", "auto")
    times = []
    for _ in range(timed):
        ctx.synchronize()
        start = time.perf_counter()
        metrics = learner.train_step(batch, "gspo", "auto")
        ctx.synchronize()
        times.append(time.perf_counter() - start)
    return times, metrics


def tf32_steps(ctx: Context, learner, batch, flops: float) -> dict:
    """The same step with TF32 matrix products allowed (a process setting, restored after): what the fp32
    learner gains from tensor cores without a bf16 path."""
    import statistics

    import torch

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        times, metrics = timed_steps(ctx, learner, batch, 1, 2)
    finally:
        torch.set_float32_matmul_precision(previous)
    median = statistics.median(times)
    return {"step_s": times, "tokens_per_s": sum(len(b["tokens"]) for b in batch) / median,
            "achieved_tflops": flops / median / 1e12, "mfu": flops / median / 1e12 / ctx.peak_tflops,
            "metrics_finite": finite_metrics(metrics)}


def section_engine_decode(ctx: Context) -> dict:
    """The embedded engine (in-process, CPU) on the large model: weights from the learner, a weight sync,
    decode tokens/s from two batches that differ only in new tokens, and its log-probs vs the learner's."""
    import torch

    from megapo.engines.base import SamplingParams
    from megapo.engines.embedded import EmbeddedEngine
    from megapo.layout import read_hf_config
    from megapo.weights import TensorTransport, bucket_bytes, sync_learner

    s = ctx.sizes
    learner = large_learner(ctx)
    hf = read_hf_config(large_model_dir(ctx))
    start = time.perf_counter()
    engine = EmbeddedEngine(config=hf, named_tensors=learner.hf_state_dict())
    load_s = time.perf_counter() - start
    stats = sync_learner(learner, [engine], TensorTransport(), bucket_bytes(512, "bucket_mb"), 1)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, hf["vocab_size"], (s.engine_prompt_length,), generator=gen).tolist()
               for _ in range(s.engine_prompts)]

    def generate(new_tokens):
        start = time.perf_counter()
        out = engine.generate(prompts, SamplingParams(n=1, temperature=1.0, max_new_tokens=new_tokens, seed=5))
        return time.perf_counter() - start, [g[0] for g in out]

    generate(2)  # warm-up: the KV cache is allocated and kept
    first_s, _ = generate(1)
    full_s, samples = generate(s.engine_new_tokens)
    decode_tokens = s.engine_prompts * (s.engine_new_tokens - 1)
    decode_s = max(full_s - first_s, 1e-9)
    learner_logp = learner.logprobs([x.prompt_ids + x.output_ids for x in samples])
    gaps = [(lp[len(x.prompt_ids) - 1:] - torch.tensor(x.logprobs)).abs() for lp, x in zip(learner_logp, samples)]
    result = {"engine_device": "cpu (the embedded engine has no CUDA path)", "engine_dtype": "float32",
              "torch_threads": torch.get_num_threads(), "rows": s.engine_prompts,
              "prompt_length": s.engine_prompt_length, "new_tokens": s.engine_new_tokens,
              "load_s": load_s, "sync": stats.to_dict(), "prefill_and_first_token_s": first_s, "batch_s": full_s,
              "decode_tokens_per_s": decode_tokens / decode_s,
              "end_to_end_tokens_per_s": s.engine_prompts * s.engine_new_tokens / full_s,
              "engine_vs_learner_logprob_max_abs": max(float(g.max()) for g in gaps),
              "engine_vs_learner_logprob_mean_abs": float(torch.cat(gaps).mean())}
    result["summary"] = (f"decode {result['decode_tokens_per_s']:.1f} tok/s ({s.engine_prompts} rows, CPU), sync "
                         f"{stats.gb_per_s:.2f} GB/s, engine vs learner mean |Δ log-prob| "
                         f"{result['engine_vs_learner_logprob_mean_abs']:.2e}")
    engine.close()
    return with_checks(result, {"all_tokens_generated": all(len(x.output_ids) == s.engine_new_tokens for x in samples),
                                "logprobs_finite": all(math.isfinite(v) for x in samples for v in x.logprobs),
                                "sync_version": engine.weight_version == 1})


def section_broadcast(ctx: Context) -> dict:
    """The broadcast weight-sync transport between two processes: a learner's sender and an embedded engine's
    receiver, NCCL on one GPU (gloo in the dry run); the engine's weights must equal the learner's."""
    from safetensors.torch import load_file

    from megapo.net import free_port

    ctx.release()  # the two processes need the GPU's memory, not this one's learner
    backend = "nccl" if ctx.device == "cuda" else "gloo"
    model_dir = ctx.tiny_model()
    folder = ctx.work / "broadcast"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    port = free_port()
    roles = {role: spawn_role(role, folder, model_dir, port, backend) for role in ("send", "recv")}
    deadline = time.time() + 150
    outcome = {role: wait_role(proc, folder / f"{role}.json", deadline) for role, proc in roles.items()}
    result = {"backend": backend, "processes": 2, "device": ctx.device, "sender": outcome["send"],
              "receiver": outcome["recv"]}
    errors = [o.get("error", "") for o in outcome.values() if not o.get("ok")]
    if errors:
        text = " | ".join(errors)
        if backend == "nccl" and ("Duplicate GPU" in text or "ncclInvalidUsage" in text):
            # NCCL refuses two ranks of one communicator on one device
            result.update(status="unavailable: NCCL refused two processes on one GPU", error=text[:3000],
                          summary=f"NCCL refused two processes on one GPU: {text[:100]}")
            return result
        result.update(status="error", error=text[:2000], summary=f"{backend}: {text[:120]}")
        return result
    sent, received = load_file(str(folder / "sent.safetensors")), load_file(str(folder / "received.safetensors"))
    unequal = [n for n in sent if n not in received or not bool((sent[n] == received[n]).all())]
    result.update(tensors=len(sent), unequal_count=len(unequal), unequal=unequal[:10],
                  summary=f"{backend} 2 processes: {len(sent) - len(unequal)}/{len(sent)} tensors equal, "
                          f"{outcome['send'].get('gb_per_s', 0):.3f} GB/s")
    return with_checks(result, {"all_tensors_equal": not unequal and len(sent) > 0})


def spawn_role(role: str, folder: Path, model_dir: Path, port: int, backend: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tools.gpu_check", "--role", role, "--work", str(folder), "--model", str(model_dir),
           "--port", str(port), "--backend", backend]
    env = dict(os.environ, NCCL_DEBUG=os.environ.get("NCCL_DEBUG", "WARN"))  # NCCL's reason for a refusal
    return subprocess.Popen(cmd, cwd=REPO, env=env)  # in the worker's process group: killed with it


def wait_role(proc: subprocess.Popen, result_file: Path, deadline: float) -> dict:
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return {"ok": False, "error": "timed out (killed)"}
    if result_file.is_file():
        return json.loads(result_file.read_text())
    return {"ok": False, "error": f"exited with code {code} before writing its result"}


def role_main(args) -> int:
    """One end of the broadcast section, in a process of its own; writes <work>/<role>.json."""
    out = Path(args.work) / f"{args.role}.json"
    try:
        result = (broadcast_send if args.role == "send" else broadcast_receive)(args)
        result["ok"] = True
    except Exception as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:3000],  # NCCL's reason is on later lines
                  "traceback": traceback.format_exc()[-3000:]}
    out.write_text(json.dumps(result, indent=1, default=str))
    return 0 if result["ok"] else 1


def sync_address(args):
    from megapo.weights.broadcast import GroupAddress

    return GroupAddress("127.0.0.1", args.port, workers=1, backend=args.backend, timeout_s=90)


def broadcast_send(args) -> dict:
    from safetensors.torch import save_file

    from megapo.config import ParallelConfig
    from megapo.learner.learner import Learner
    from megapo.weights import bucket_bytes, sync_learner
    from megapo.weights.broadcast import BroadcastSender, BroadcastTransport, join_group

    learner = Learner(args.model, ParallelConfig())
    group = join_group(sync_address(args), 0, rank=0)
    transport = BroadcastTransport(BroadcastSender(group, device=learner.device))
    stats = sync_learner(learner, [], transport, bucket_bytes(64, "bucket_mb"), 1)
    save_file({n: t.cpu().contiguous() for n, t in learner.hf_state_dict()}, str(Path(args.work) / "sent.safetensors"))
    return {**stats.to_dict(), "device": learner.device}


def broadcast_receive(args) -> dict:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from megapo.engines.embedded import EmbeddedEngine
    from megapo.weights.broadcast import BroadcastReceiver, join_group

    engine = EmbeddedEngine(args.model)
    for buffer in engine.weight_buffers().values():
        buffer.zero_()  # so that only what arrives can match the sender
    device = "cuda" if args.backend == "nccl" else "cpu"
    receiver = BroadcastReceiver([join_group(sync_address(args), 0, rank=1)], device=device)
    engine.pause()
    version, moved = receiver.receive(engine.update_weights, engine.weight_buffers())
    engine.resume()
    receiver.finish(version)
    with safe_open(str(Path(args.model) / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    views = engine.weight_buffers()
    save_file({n: views[n].clone().contiguous() for n in names}, str(Path(args.work) / "received.safetensors"))
    return {"version": version, "bytes": moved.bytes, "tensors": moved.tensors, "device": device}


def section_bf16_step(ctx: Context) -> dict:
    """The bf16 learner (train.precision=bf16): log-probs vs transformers' bf16 forward on the same device within
    TOL_BF16 (transformers' own fp32-vs-bf16 gap shown beside it), then one RL step: finite, applied, the fp32 main
    parameters moved and the model's bf16 weights their rounding."""
    import torch

    from megapo.convert.verify import sequences as fixed_sequences
    from megapo.learner.precision import Precision

    model_dir = ctx.tiny_model()
    learner = ctx.learner(model_dir, precision=Precision("bf16"))
    seqs = fixed_sequences(learner.spec.vocab_size, seed=0)
    got = learner.logprobs(seqs)
    ref16 = transformers_logprobs(model_dir, seqs, ctx.device, torch.bfloat16)
    ref32 = transformers_logprobs(model_dir, seqs, ctx.device, torch.float32)
    diff, gap = max_abs_diff(got, ref16), max_abs_diff(ref32, ref16)
    batch = rl_batch(learner, learner.spec.vocab_size, groups=4, group_size=4, length=24, seed=7)
    metrics = learner.train_step(batch, "gspo", "auto")
    ctx.synchronize()
    pairs = [(model, main) for opt in learner.optimizer.chained_optimizers
             for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups) for model, main in zip(models, mains)]
    rounded = all(torch.equal(model, main.to(model.dtype)) for model, main in pairs)
    dtypes = sorted({str(p.dtype) for p in learner.module.parameters()})
    result = {"bf16_vs_transformers_bf16_max_abs": diff, "transformers_fp32_vs_bf16": gap, "tol": TOL_BF16,
              "model_dtypes": dtypes, "main_params": len(pairs),
              "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
              "summary": f"bf16 learner vs transformers bf16 {diff:.2e} (their fp32-vs-bf16 gap {gap:.2e}), step loss "
                         f"{metrics['loss']:.4g}, {len(pairs)} fp32 main parameters"}
    return with_checks(result, {"logprobs_close": diff <= TOL_BF16, "step_finite": finite_metrics(metrics),
                                "update_applied": metrics.get("update_ok") is True,
                                "model_in_bf16": dtypes == ["torch.bfloat16"], "weights_rounded_main": rounded})


def section_te_fp8(ctx: Context) -> dict:
    """Transformer Engine FP8 layers (train.fp8=hybrid, delayed scaling, with train.precision=bf16): only where TE
    imports; the kit cannot carry it."""
    ctx.need_cuda()
    import torch

    from megapo.convert.verify import sequences as fixed_sequences
    from megapo.learner.precision import Precision

    status = te_import()
    if not status.startswith("imported"):
        raise Skip(f"unavailable: transformer_engine {status}")
    model_dir = ctx.tiny_model()
    learner = ctx.learner(model_dir, precision=Precision("bf16", fp8="hybrid", fp8_recipe="delayed"))
    seqs = fixed_sequences(learner.spec.vocab_size, seed=0, lengths=(16, 32, 48, 64))  # FP8 GEMMs: multiples of 16
    diff = max_abs_diff(learner.logprobs(seqs), transformers_logprobs(model_dir, seqs, ctx.device, torch.float32))
    batch = rl_batch(learner, learner.spec.vocab_size, groups=2, group_size=2, length=32, seed=6)
    metrics = learner.train_step(batch, "gspo", "auto")
    result = {"te": status, "fp8_vs_transformers_fp32_max_abs": diff, "tol": 10 * TOL_BF16,
              "summary": f"FP8 log-probs within {diff:.3g} of fp32 transformers, step loss {metrics['loss']:.4g}"}
    return with_checks(result, {"logprobs_close": diff <= 10 * TOL_BF16, "step_finite": finite_metrics(metrics)})


@dataclass(frozen=True)
class Section:
    name: str
    run: object  # Callable[[Context], dict]
    timeout_s: float


SECTIONS = [
    Section("environment", section_environment, 60),
    Section("compat", section_compat, 30),
    Section("logprobs", section_logprobs, 150),
    Section("train_step", section_train_step, 90),
    Section("checkpoint", section_checkpoint, 90),
    Section("bf16_step", section_bf16_step, 90),
    Section("routing_replay", section_routing_replay, 90),
    Section("nccl_group", section_nccl_group, 60),
    Section("large_train", section_large_train, 200),
    Section("engine_decode", section_engine_decode, 150),
    Section("broadcast", section_broadcast, 180),
    Section("te_fp8", section_te_fp8, 90),
]
BY_NAME = {s.name: s for s in SECTIONS}


# ----------------------------------------------------------------------------- worker


FAULTS_ENV = "MEGAPO_GPU_CHECK_FAULTS"  # "section=raise|hang|exit,...": tests of the isolation between sections


def injected_fault(name: str) -> None:
    faults = dict(item.split("=", 1) for item in os.environ.get(FAULTS_ENV, "").split(",") if "=" in item)
    kind = faults.get(name)
    if kind == "raise":
        raise RuntimeError(f"fault injected into {name} ({FAULTS_ENV})")
    if kind == "hang":
        time.sleep(1e6)
    if kind == "exit":
        os._exit(3)


def run_section(section: Section, ctx: Context) -> dict:
    start = time.perf_counter()
    try:
        injected_fault(section.name)
        result = section.run(ctx)
    except Skip as skip:
        result = {"status": str(skip)}
    except Exception as exc:
        result = {"status": "error", "error": first_line(exc, 2000), "traceback": traceback.format_exc()[-4000:]}
    result["seconds"] = time.perf_counter() - start
    result.setdefault("summary", result.get("error", ""))
    return result


def append_event(progress: Path, event: dict) -> None:
    with progress.open("a") as f:
        f.write(json.dumps(event, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def worker_main(args) -> int:
    import torch

    torch.manual_seed(0)
    ctx = Context(Path(args.work), args.cpu_dry_run, args.peak_tflops)
    progress = Path(args.progress)
    for name in args.sections:
        append_event(progress, {"event": "start", "section": name, "time": time.time()})
        result = run_section(BY_NAME[name], ctx)
        append_event(progress, {"event": "end", "section": name, "result": result})
        print(f"[gpu_check] {name}: {result['status']} ({result['seconds']:.1f} s) {result.get('summary', '')}",
              flush=True)
    ctx.release()
    return 0


# ----------------------------------------------------------------------------- orchestration


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def start_worker(args, names: list[str], work: Path, progress: Path) -> subprocess.Popen:
    # (no progress bars of model writes and loads: the log keeps to the sections' lines)
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error")
    if args.cpu_dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the CPU path even where a GPU is present
    cmd = [sys.executable, "-m", "tools.gpu_check", "--worker", "--work", str(work), "--progress", str(progress),
           "--sections", ",".join(names), "--peak-tflops", str(args.peak_tflops)]
    if args.cpu_dry_run:
        cmd.append("--cpu-dry-run")
    return subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)


def read_events(progress: Path, seen: int) -> tuple[list[dict], int]:
    if not progress.is_file():
        return [], seen
    lines = progress.read_text().splitlines()
    complete = [json.loads(line) for line in lines[seen:] if line.endswith("}")]
    return complete, seen + len(complete)


def watch_worker(proc, progress: Path, results: dict, deadline: float, max_section_s: float) -> None:
    """Record the worker's results until it exits or must be killed (a section past its timeout or the
    global deadline); a section it was running then gets "timeout" or an error naming the exit code."""
    seen, current, started = 0, None, 0.0
    while True:
        events, seen = read_events(progress, seen)
        for e in events:
            if e["event"] == "start":
                current, started = e["section"], time.time()
            else:
                results[e["section"]], current = e["result"], None
        code = proc.poll()
        if code is not None:
            events, seen = read_events(progress, seen)
            for e in events:
                if e["event"] == "end":
                    results[e["section"]], current = e["result"], None
            if current is not None:
                results[current] = {"status": "error", "error": f"worker process exited with code {code} "
                                    f"({signal_name(code)}) during this section", "seconds": time.time() - started}
            return
        now = time.time()
        limit = min(BY_NAME[current].timeout_s, max_section_s) if current is not None else 0.0
        if current is not None and (now - started > limit or now > deadline):
            kill_group(proc)
            why = "global budget" if now > deadline else f"section timeout {limit:.0f} s"
            results[current] = {"status": "timeout", "error": f"killed after {now - started:.0f} s ({why})",
                                "seconds": now - started}
            return
        if current is None and now > deadline:
            kill_group(proc)
            return
        time.sleep(0.2)


def signal_name(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return "signal"
    return "exit"


def orchestrate(args, work: Path) -> dict:
    names = [s.name for s in SECTIONS if not args.sections or s.name in args.sections]
    results: dict[str, dict] = {}
    deadline = time.time() + args.budget_s
    attempt = 0
    while True:
        pending = [n for n in names if n not in results]
        if not pending:
            break
        if time.time() > deadline - 5:
            for n in pending:
                results[n] = {"status": "skipped: time budget spent", "seconds": 0.0}
            break
        progress = work / f"progress_{attempt}.jsonl"
        attempt += 1
        worker = start_worker(args, pending, work, progress)
        try:
            watch_worker(worker, progress, results, deadline, args.max_section_s)
        finally:
            if worker.poll() is None:  # (this process was interrupted)
                kill_group(worker)
        if all(n not in results for n in pending) and time.time() <= deadline:  # it died before finishing any
            results[pending[0]] = {"status": "error", "error": "worker exited before this section ended",
                                   "seconds": 0.0}
    return {n: results[n] for n in names}


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def summary_text(report: dict) -> str:
    lines = [f"gpu_check {report['mode']} {report['started']} total {report['total_s']:.0f} s "
             f"(budget {report['budget_s']:.0f} s)"]
    for name, r in report["sections"].items():
        lines.append(f"{name:14s} {r['status'][:60]:24s} {r.get('seconds', 0):6.1f} s  {r.get('summary', '')}")
    return "\n".join(lines) + "\n"


def check_request(args, parser) -> None:
    import torch

    unknown = sorted(set(args.sections or ()) - set(BY_NAME))
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    for flag in ("budget_s", "max_section_s", "peak_tflops"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if not args.cpu_dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on the GPU machine, or pass --cpu-dry-run for the toy-size CPU run")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for gpu_check.json and gpu_check.txt")
    parser.add_argument("--cpu-dry-run", action="store_true", help="toy sizes on the CPU (gloo, no CUDA)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the whole check's time budget")
    parser.add_argument("--peak-tflops", type=float, default=BF16_PEAK_TFLOPS, help="bf16 peak the MFU is against")
    parser.add_argument("--sections", type=lambda v: v.split(","), default=None, help="comma-separated subset")
    parser.add_argument("--max-section-s", type=float, default=math.inf, help="caps every section's own timeout")
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--progress", help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=("send", "recv"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        return role_main(args)
    if args.worker:
        return worker_main(args)
    if not args.out:
        parser.error("--out is required")
    check_request(args, parser)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="megapo_gpu_check_"))
    start = time.time()
    try:
        sections = orchestrate(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"kit": "tools/gpu_check.py", "mode": "cpu-dry-run" if args.cpu_dry_run else "gpu",
              "git_commit": git_commit(), "started": datetime.datetime.fromtimestamp(start).isoformat("T", "seconds"),
              "budget_s": args.budget_s, "total_s": time.time() - start, "sections": sections}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    text = summary_text(report)
    (out / "gpu_check.txt").write_text(text)
    print(text, end="")
    return 0 if all(r["status"] == "ok" or r["status"].startswith(("skipped: no CUDA", "unavailable"))
                    for r in sections.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
