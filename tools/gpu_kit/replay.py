"""The GPU kit's routing_replay section: R3 on this device, the embedded engine's routes replayed by the learner."""

from __future__ import annotations

from tools.gpu_kit.context import TOL_FP32, Context
from tools.gpu_kit.helpers import finite_metrics, with_checks


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
