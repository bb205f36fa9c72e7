"""Stage anytime's config-time refusals (megapo/trainer/anytime.py draws its summaries): each names its field.

Apart from megapo/trainer/anytime.py so that RunConfig's validation imports no rollout code (which imports the
config)."""

from __future__ import annotations

from megapo.algorithms.anytime import STAGE, AnytimeOptions
from megapo.config import ConfigError


def stage_index(cfg) -> int | None:
    """The place of stage anytime in algorithm.stages (None: not listed)."""
    return next((i for i, s in enumerate(cfg.algorithm.pipeline()) if s.name == STAGE), None)


def trigger_text(cfg, options: AnytimeOptions) -> str:
    """The summary trigger: the stage's `trigger`, else data.task's summary_trigger ("" when neither has one)."""
    if options.trigger:
        return options.trigger
    if not cfg.data.task:
        return ""
    from megapo.tasks.registry import get_task

    return get_task(cfg.data.task, cfg.data.task_options).summary_trigger or ""


def check_anytime(cfg) -> None:
    """Stage anytime's refusals at config time, each naming its field: a summary trigger (the stage's or the task's),
    budgets within rollout.max_new_tokens, sync rollouts (the draws follow the trainer step), a group estimator (a
    critic would value the summaries as the policy's own responses), no length reward (the advantages read the
    verifier's scores) and not beside hdpo (both add groups); eval_budgets within rollout.max_new_tokens too."""
    i = stage_index(cfg)
    if i is None:
        return
    o = cfg.algorithm.pipeline()[i].options
    where = f"algorithm.stages[{i}]"
    if not trigger_text(cfg, o):
        raise ConfigError(f"{where}.trigger", "anytime appends a summary trigger (the text that ends the thinking "
                          f"and asks for the answer) to each truncated response; data.task {cfg.data.task!r} has no "
                          "summary_trigger, so give one")
    for name in ("budgets", "eval_budgets"):
        too_long = [b for b in getattr(o, name) if b > cfg.rollout.max_new_tokens]
        if too_long:
            raise ConfigError(f"{where}.{name}", f"budget {too_long[0]} exceeds rollout.max_new_tokens="
                              f"{cfg.rollout.max_new_tokens}: no response is that long")
    if cfg.train.mode != "sync":
        raise ConfigError("train.mode", f"stage anytime ({where}) draws its budgets from train.seed and the trainer "
                          "step, which async rollouts do not know when they sample; use sync")
    if cfg.algorithm.advantage == "gae":
        raise ConfigError("algorithm.advantage", f"gae's critic would value anytime's summaries ({where}) as the "
                          "policy's own responses; use a group estimator (grpo, ...)")
    if cfg.data.length_reward != "none":
        raise ConfigError("data.length_reward", f"stage anytime ({where}) computes its advantages from the "
                          "verifier's scores at each budget, so a shaped reward would be ignored; use none")
    if any(s.name == "hdpo" for s in cfg.algorithm.pipeline()):
        raise ConfigError(where, "anytime and hdpo both add groups of their own to the step; list one of them")
