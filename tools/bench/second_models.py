"""Benchmark: what each second model of issue 31 costs per step beside the policy's own train step, measured side
by side in one process on the main job's step (megapo/configs/tiny_moe_addition.yaml: its tiny Qwen3-MoE, 64
prompts x 8 samples of 8-token prompts and 8-token responses, routing replay r3 with the engine's routes).

    megapo bench second-models --out benchmarks/results/second_models.json [--rounds 5]

Timed, each round in alternating order on a fresh batch: the policy's on-policy train step (the step every role is
added to); the teacher's log-probs of the batch (algorithm.distill.teacher: a tiny model of the policy's shape with
other weights, built by megapo.trainer.distill.build_teacher, replaying the routes); the reward model's scores of
every sequence (data.reward_model.path: a tiny *ForSequenceClassification, megapo.trainer.reward_model); the critic's
values, GAE and its update (algorithm.critic.path=policy, algorithm.advantage=gae: megapo.trainer.critic_step's
critic_advantages), and its values alone. Reported: medians (wall seconds), each role as a fraction of the policy's
step, the step with every role, and the bytes each role keeps (parameters; with grads and Adam's moments for the two
trained ones, the policy and the critic).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
from pathlib import Path

from tools.bench.side_by_side import alternating_rounds, param_bytes, routed_batch

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "megapo" / "configs" / "tiny_moe_addition.yaml"
PROMPT_LEN = 8
ROLES = ("teacher", "reward_model", "critic")  # each added to the policy's step


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up round); medians reported")


def write_models(cfg, folder: Path) -> dict[str, Path]:
    """The policy (the config's tiny model), a teacher of its shape with other weights, a tiny reward model."""
    from megapo.models.tiny import write_tiny_model

    t = cfg.model.tiny
    shape = dict(layers=t.layers, experts=t.experts, topk=t.topk, hidden=t.hidden, heads=t.heads, kv_heads=t.kv_heads,
                 head_dim=t.head_dim, ffn=t.ffn, moe_ffn=t.moe_ffn, vocab=t.vocab)
    return {"policy": write_tiny_model(folder / "policy", t.family, seed=t.seed, **shape),
            "teacher": write_tiny_model(folder / "teacher", t.family, seed=t.seed + 1, **shape),
            "reward_model": write_tiny_model(folder / "reward_model", t.family, seed=t.seed + 2, head="score", **shape)}


def run_config(models: dict[str, Path]):
    """The main job's config with every role on: a teacher, a reward model, a critic from the policy (GAE)."""
    from megapo.config import load_config
    from megapo.trainer.config import RunConfig

    return load_config(RunConfig, str(CONFIG), [
        f"model.path={models['policy']}", "sft.enabled=false", f"algorithm.distill.teacher={models['teacher']}",
        f"data.reward_model.path={models['reward_model']}", "algorithm.advantage=gae", "algorithm.critic.path=policy",
        "algorithm.critic.lr=1e-5", "optim.lr=1e-6", "optim.warmup_steps=0"])


def random_batch(cfg, rng: random.Random) -> tuple[list[dict], list[float]]:
    """One step's samples (tokens, prompt_len, advantage, the engine's routes) and a 0/1 reward each."""
    batch = routed_batch(rng, cfg.data.prompts_per_step * cfg.rollout.n_samples,
                         PROMPT_LEN + cfg.rollout.max_new_tokens, PROMPT_LEN, cfg.model.tiny)
    return batch, [float(rng.random() < 0.5) for _ in batch]


def build_roles(cfg, policy_dir: Path) -> dict:
    """The policy's learner (replaying routes, as under r3) and the three roles the run config turns on."""
    from megapo.learner.learner import Learner
    from megapo.trainer.critic_step import build_critic
    from megapo.trainer.distill import build_teacher
    from megapo.trainer.reward_model import build_reward_model

    return {"policy": Learner(policy_dir, cfg.parallel, cfg.optim, seed=cfg.train.seed,
                              micro_batch_tokens=cfg.train.micro_batch_tokens, routing_replay=True),
            "teacher": build_teacher(cfg, policy_dir), "reward_model": build_reward_model(cfg),
            "critic": build_critic(cfg, policy_dir)}


def timed_passes(cfg, m: dict, batch: list[dict], rewards: list[float]) -> list[tuple[str, object]]:
    """(name, callable) of each pass timed: the policy's step, each role's work on the same batch."""
    from megapo.algorithms.sample import as_train_samples
    from megapo.replay import modes
    from megapo.trainer.critic_step import critic_advantages

    a = cfg.algorithm
    return [("policy_step", lambda: modes.on_policy_step(m["policy"], [dict(s) for s in batch], a.routing_replay,
                                                         a.objective, "seq-mean-token-mean")),
            ("teacher", lambda: m["teacher"].response_logprobs(batch)),
            ("reward_model", lambda: m["reward_model"].scores([s["tokens"] for s in batch])),
            ("critic", lambda: critic_advantages(m["critic"], as_train_samples([dict(s) for s in batch]), rewards,
                                                 a.critic)),
            ("critic_values", lambda: m["critic"].values(batch))]


def measure(rounds: int, seed: int = 0) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Seconds of each pass per round (after a warm-up round, alternating order) and the bytes of each role."""
    from megapo.config import load_config
    from megapo.trainer.config import RunConfig

    with tempfile.TemporaryDirectory(prefix="bench_second_models_") as folder:
        models = write_models(load_config(RunConfig, str(CONFIG), ["sft.enabled=false"]), Path(folder))
        cfg = run_config(models)
        m = build_roles(cfg, models["policy"])
    rng = random.Random(seed)
    out = alternating_rounds(rounds, lambda: timed_passes(cfg, m, *random_batch(cfg, rng)))
    memory = {"policy_with_grads_and_adam": param_bytes(m["policy"].module, trained=True),
              "teacher": param_bytes(m["teacher"].model.module),
              "reward_model": param_bytes(m["reward_model"].learner.module),
              "critic_with_grads_and_adam": param_bytes(m["critic"].module, trained=True)}
    return out, memory


def summary(samples: dict[str, list[float]]) -> tuple[dict[str, float], dict[str, float]]:
    """(medians, ratios to the policy's step: each role's, the critic's values alone, and the step with all)."""
    med = {k: statistics.median(v) for k, v in samples.items()}
    base = med["policy_step"]
    ratios = {f"{k}_of_policy_step": med[k] / base for k in (*ROLES, "critic_values")}
    ratios["step_with_all_roles_over_policy_step"] = (base + sum(med[k] for k in ROLES)) / base
    return med, ratios


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise SystemExit("megapo bench second-models: --rounds must be >= 1")
    samples, memory = measure(args.rounds)
    med, ratios = summary(samples)
    report = {"benchmark": "second_models", "config": str(CONFIG.relative_to(ROOT)), "rounds": args.rounds,
              "routing_replay": "r3", "threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or None,
              "load_avg": os.getloadavg(), "median_s": med, "ratios": ratios, "bytes": memory, "samples_s": samples}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"median_s": {k: round(v, 4) for k, v in med.items()},
                      "ratios": {k: round(v, 3) for k, v in ratios.items()}, "bytes": memory}, indent=1))
    return 0
