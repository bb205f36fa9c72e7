"""Routing replay for MoE stability: the learner routes tokens to the experts a rollout engine (R3) or
its own old-log-prob pass (R2) chose, through Megatron-core's RouterReplay.

- routes.py  route data (int [num_tokens-1, num_moe_layers, topk] per sample), checks, a batch's route
             table and the targets of a micro-batch's positions (given / missing -> own choice / last token /
             padding -> distinct dummies), a pipeline stage's columns (PP > 1: what the trainer sends a
             stage's ranks, megapo.trainer.handout), .npz files;
- hook.py    the learner's `route_hook`: per-micro-batch targets set inside the forward step, TP/SP
             slices, pipeline stages, activation-recompute FIFO, routes actually used, metrics;
- modes.py   off / r2 / r3 for the trainer: `old_logprobs`, `mismatch_kl`, `logprobs_with_routes`, and
             `on_policy_step` (no separate old-log-prob pass when π_old is the policy being trained);
- cli.py     `megapo logprobs --routes-in / --routes-out`.

Trainer use (learner built with routing_replay=True for r2/r3):
    old, m = old_logprobs(learner, samples, mode)      # r2/r3: sets sample.routes for training
    m |= learner.train_step(samples, objective)        # "replay/disagree_post" == 0 under replay
    m |= mismatch_kl(learner, samples, old)            # "replay/kl_k3", "replay/kl_k3_free" (needs rollout_logp)
On-policy (one update on one mini-batch, π_old from the learner), the same metrics from one forward:
    train, m = on_policy_step(learner, samples, mode, objective, measure_kl=True,
                              free_logps=free_logprobs(learner, samples, mode))
"""
