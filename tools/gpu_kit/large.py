"""The GPU kit's sections on the large random Qwen3-MoE: large_train (tokens/s, MFU against the bf16 peak, peak
memory, the TF32 variant) and engine_decode (the embedded engine on that model: weight sync, decode tokens/s).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

from tools.gpu_kit.context import Context
from tools.gpu_kit.helpers import cuda_memory, finite_metrics, rl_batch, with_checks


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
