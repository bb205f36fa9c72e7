"""Probe cases of the class 'poor: rewards': reward functions that raise, return NaN, None or a word, take
the wrong arguments, hang, or fail mid-run.
"""

from __future__ import annotations

from tools.probe.inputs import _metrics_rows
from tools.probe.outcomes import CONFIG_TIMEOUT_S, RUN_TIMEOUT_S, classify
from tools.probe.registry import case, refused


REWARD = "poor: rewards"


def _reward_case(name: str, fn: str, *names, extra: tuple[str, ...] = (), timeout: float = CONFIG_TIMEOUT_S):
    def probe(ctx):
        folder = ctx.fresh(name)
        out = ctx.train(ctx.config(folder), f"data.reward=probe_rewards:{fn}", *extra)
        return refused(ctx, out, *names, forbid=(folder / "run",))
    probe.__name__ = name
    case(REWARD)(probe)


_reward_case("reward_raises", "raises", "data.reward", "raises", "reward exploded")


_reward_case("reward_returns_nan", "nan", "data.reward", "nan")


_reward_case("reward_returns_none", "none", "data.reward", "none", "None")


_reward_case("reward_returns_a_word", "string_word", "data.reward", "string_word", "'yes'")


_reward_case("reward_wrong_signature", "one_arg", "data.reward", "one_arg", "(response, answer)")


_reward_case("reward_hangs", "hangs", "data.reward", "hangs", "2", extra=("data.reward_timeout_s=2",))


@case(REWARD, cheap=False)
def reward_fails_mid_run(ctx):
    """Fine on the start-up call, raises on the first rollout: exit 1, one line naming the reward and its
    error, no traceback, no checkpoint."""
    folder = ctx.fresh("reward_mid_run")
    out = ctx.train(ctx.config(folder), "data.reward=probe_rewards:fails_on_wrong", timeout=RUN_TIMEOUT_S)
    ckpts = folder / "run" / "checkpoints"
    saved = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
    return out, classify(out, rc=1, names=("fails_on_wrong", "reward exploded mid-run"),
                         wrong_state=f"checkpoint(s) written: {saved}" if saved else None)


@case(REWARD, cheap=False)
def reward_fails_mid_run_scored_zero(ctx):
    """data.reward_errors=zero: the failures score 0 and are counted (reward/errors), the run finishes."""
    folder = ctx.fresh("reward_mid_run_zero")
    out = ctx.train(ctx.config(folder), "data.reward=probe_rewards:fails_on_wrong", "data.reward_errors=zero",
                    "train.steps=1", timeout=RUN_TIMEOUT_S)
    rows = _metrics_rows(folder / "run")
    errors = [r.get("reward/errors") for r in rows if "reward/errors" in r]
    if out.rc != 0:
        return out, classify(out, rc=0)
    if not errors or not errors[0]:
        return out, ("wrong", f"failures not counted in reward/errors: {errors}")
    return out, ("good", f"exit 0, reward/errors={errors[0]}")
