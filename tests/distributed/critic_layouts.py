"""Run by tests/test_critic.py (plain python for one process, torchrun for more): a Megatron critic
(megapo/learner/critic.py) for each layout of the spec, replaying the samples' routes where the layout says r3:

- "values": V at every response token of each sample;
- "metrics", "grads": backward's clipped value loss and the gradient it left (spec_io.hf_grads), before any step;
- then that step, a save, a second step on the spec's second returns: "uninterrupted" weights (and "lr", "steps");
- a fresh critic loading the save and taking the second step: "resumed" weights (and its "lr", "steps");
- "errors": the messages of train_step on bad returns (the spec's "bad" cases);
- with "lm_model" (one process): a critic from that causal-LM folder, "from_lm": its initial weights and values,
  and its values after one step;
- with "policy" (a layout): "beside_policy": a policy learner on that folder built first, then a critic in its
  process groups (both replaying the routes): the critic's values, the policy's log-probs before the critic's step,
  after it and after the critic is closed.
Rank 0 saves everything to --out.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.critic import Critic
from spec_io import finish, hf_grads, read_spec  # this script's folder is on sys.path


def build(spec: dict, layout: dict, r3: bool) -> Critic:
    return Critic(spec["model"], ParallelConfig(**layout), OptimConfig(**spec["optim"]), total_steps=4,
                  micro_batch_tokens=spec["micro_batch_tokens"], routing_replay=r3)


def samples_of(spec: dict, r3: bool) -> list[dict]:
    return [dict(tokens=s["tokens"], prompt_len=s["prompt_len"],
                 routes=np.asarray(s["routes"], dtype=np.int64) if r3 else None) for s in spec["samples"]]


def bad_returns(critic: Critic, samples: list[dict], spec: dict) -> dict:
    """train_step's refusal of each bad case (raised before any collective)."""
    errors = {}
    for name, returns in spec["bad"].items():
        try:
            critic.train_step(samples, returns, spec["old_values"], spec["clip"])
            errors[name] = None
        except ValueError as err:
            errors[name] = str(err)
    return errors


def run_layout(spec: dict, layout: dict, r3: bool, ckpt: Path) -> dict:
    samples, clip = samples_of(spec, r3), spec["clip"]
    critic = build(spec, layout, r3)
    out = {"errors": bad_returns(critic, samples, spec), "values": critic.values(samples)}
    out["metrics"] = critic.backward(samples, spec["returns"], spec["old_values"], clip)
    out["grads"] = hf_grads(critic.learner)
    out["metrics"].update(critic.learner._optimizer_step(True))  # step 1: the gradient above (as train_step)
    out["first"] = dict(critic.hf_state_dict())
    critic.save(ckpt)
    out["second"] = critic.train_step(samples, spec["returns2"], spec["old_values"], clip)
    out.update(uninterrupted=dict(critic.hf_state_dict()), steps=critic.step)
    critic.close()
    resumed = build(spec, layout, r3)
    resumed.load(ckpt)
    out["resumed_second"] = resumed.train_step(samples, spec["returns2"], spec["old_values"], clip)
    out.update(resumed=dict(resumed.hf_state_dict()), resumed_steps=resumed.step)
    resumed.close()
    return out


def run_from_lm(spec: dict) -> dict:
    """A critic started from a causal LM (the value head at zeros): its weights and values, one step, its values."""
    samples = samples_of(spec, False)
    optim = OptimConfig(**{**spec["optim"], "warmup_steps": 0})  # (a warm-up step would take lr 0)
    critic = Critic(spec["lm_model"], ParallelConfig(), optim, total_steps=4,
                    micro_batch_tokens=spec["micro_batch_tokens"])
    out = {"initial": dict(critic.hf_state_dict()), "values": critic.values(samples)}
    out["metrics"] = critic.train_step(samples, spec["returns"], spec["old_values"], spec["clip"])
    out["values_after"] = critic.values(samples)
    critic.close()
    return out


def run_beside_policy(spec: dict) -> dict:
    """A critic in a policy learner's process groups, as the trainer holds them; the policy's log-probs around it."""
    from megapo.learner.learner import Learner

    layout = ParallelConfig(**spec["policy"]["layout"])
    samples = samples_of(spec, True)
    sequences, routes = [s["tokens"] for s in samples], [s["routes"] for s in samples]
    policy = Learner(spec["policy"]["model"], layout, OptimConfig(**spec["optim"]), routing_replay=True,
                     micro_batch_tokens=spec["micro_batch_tokens"])
    out = {"logp_before": policy.logprobs(sequences, routes=routes)}
    critic = build(spec, spec["policy"]["layout"], True)
    out["values"] = critic.values(samples)
    out["metrics"] = critic.train_step(samples, spec["returns"], spec["old_values"], spec["clip"])
    out["logp_beside"] = policy.logprobs(sequences, routes=routes)
    critic.close()
    out["logp_after_close"] = policy.logprobs(sequences, routes=routes)
    policy.close()
    return out


def main() -> None:
    spec, out_path = read_spec()
    results = {"from_lm": run_from_lm(spec)} if spec.get("lm_model") else {}
    for case in spec["layouts"]:
        layout, r3 = case["layout"], case["r3"]
        name = "_".join(f"{k}{v}" for k, v in layout.items()) + f"_r3{r3}"
        results[name] = run_layout(spec, layout, r3, Path(spec["ckpt"]) / name)
    if spec.get("policy"):
        results["beside_policy"] = run_beside_policy(spec)
    finish(results, out_path)


if __name__ == "__main__":
    main()
