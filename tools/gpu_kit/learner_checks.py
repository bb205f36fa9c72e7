"""The GPU kit's sections on the learner of the tiny models: log-probs against transformers (fp32 and bf16), one
RL step, a checkpoint's save/load round trip, the bf16 learner, and Transformer Engine's FP8 layers.
"""

from __future__ import annotations

import math
import shutil

from tools.gpu_kit.context import TOL_BF16, TOL_FP32, TOL_RELOAD, Context, Skip
from tools.gpu_kit.environment import te_import
from tools.gpu_kit.helpers import finite_metrics, max_abs_diff, rl_batch, snapshot, transformers_logprobs, with_checks


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
