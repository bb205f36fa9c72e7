"""A train sample: one sequence of a train batch, what the trainer hands the learner (docs/CONTRACTS.md).

It lives here, at the bottom of the import graph, because the trainer, routing replay (megapo.replay.modes) and
the learner all take it; megapo.learner.sample re-exports it under its old address.

The trainer builds TrainSample records (megapo.trainer.update.train_samples) and the stages after the
estimator fill their fields; megapo reads and sets them as attributes (`sample.old_logp`), a field left None
being absent. Every function that takes train samples (the learner's train steps, the reference, replay.modes,
the trainer's stages) takes `list[TrainSample]` and passes its argument through `as_train_samples` once, so a
plain dict with the same keys is accepted there too (tests and tools write them that way): it is seen through
a `MappingSample`, whose attribute reads and writes go to the dict (an absent key reads None). A name that is
not a field is refused, naming it. The by-name reads below (`__getitem__`, `get`, `keys`, `items`) are kept for
tests and tools only; megapo itself does not use them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass, fields, replace
from typing import Any, Iterator


@dataclass
class TrainSample:
    tokens: list[int]  # prompt + response token ids
    prompt_len: int  # tokens[:prompt_len] is the prompt
    advantage: float | list[float]  # one per sample, or one per response token (a token stage of algorithm.stages)
    rollout_logp: list[float] | None = None  # μ: the engine's log-prob of each response token
    old_logp: list[float] | None = None  # π_old per response token: the old-log-prob pass (or μ, old_policy=engine)
    old_entropy: list[float] | None = None  # π_old's entropy at each response token (stages that read it)
    ref_logp: list[float] | None = None  # π_ref per response token (KL terms)
    token_weight: list[float] | None = None  # >= 0 per response token, multiplies the loss (token_select / mask)
    loss_mask: list[int] | None = None  # per response token: 1 the policy sampled it, 0 an observation (multi-turn)
    sentence_end: list[int] | None = None  # per response token: 1 where a sentence ends (sspo)
    # [m, moe_layers, topk] the routes every train step replays (r3: the engine's; r2: recorded); with PP > 1 a rank
    # other than 0 gets the engine's with its pipeline stage's MoE layers only (megapo.trainer.handout)
    routes: Any = None
    engine_routes: Any = None  # the engine's routes vs the learner's own (router/disagree; PP > 1: rank 0's only)
    own_routes: Any = None  # the learner's free routes (the stability metrics' other side)
    # algorithm.distill.mode topk_forward_kl (megapo/algorithms/topk_distill.py): per response token the teachers'
    # top-k token ids and their log-probs, [response tokens, J·k] (teacher j in columns j·k..(j+1)·k-1; a tensor or
    # nested lists); set by megapo.trainer.distill.attach_teacher_topk, read by the learner's train step
    teacher_topk_ids: Any = None
    teacher_topk_logp: Any = None
    # >= 0 per response token: the coefficient of its KL to π_old, |log π_θ − log π_old| (stage low_entropy_kl)
    kl_weight: list[float] | None = None
    # per response token: 1.0 where lp_reg's batch-global low-probability quantile selects it (π_old at or below the
    # ρ-quantile of its advantage sign's tokens over the whole train batch; megapo.trainer.update.set_low_prob)
    low_prob: list[float] | None = None
    # per response token: HAPO's signed entropy score ĥ in [-1, 1] of π_old's entropy over the whole train batch
    # (objectives.hapo_entropy_scores; megapo.trainer.update.set_entropy_scores), read by ppo's clip_mode hapo
    entropy_score: list[float] | None = None
    # per response token: 1 where this step's engine sampled it, 0 where μ (rollout_logp) is an older policy's (stage
    # soup's historical prefixes, set by megapo.algorithms.soup.run_soup_stage); the learner's engine-vs-learner
    # metrics train/mismatch_* count the 1s only (corrections.mismatch_from_batch); None: every policy token counts
    mismatch_mask: list[int] | None = None

    # ------------------------------------------------------------------------- read and set by field name

    def __getitem__(self, name: str) -> Any:
        value = getattr(self, _field(name))
        if value is None:
            raise KeyError(name)
        return value

    def __setitem__(self, name: str, value: Any) -> None:
        setattr(self, _field(name), value)

    def __contains__(self, name: object) -> bool:
        return name in FIELDS and getattr(self, name) is not None

    def get(self, name: str, default: Any = None) -> Any:
        value = getattr(self, _field(name))
        return default if value is None else value

    def keys(self) -> Iterator[str]:
        return (name for name in FIELDS if getattr(self, name) is not None)

    def items(self) -> Iterator[tuple[str, Any]]:
        return ((name, getattr(self, name)) for name in self.keys())


FIELDS = tuple(f.name for f in fields(TrainSample))
# per-token fields: one value per response token (advantage: or one per sample), laid end to end by the learner
TOKEN_FIELDS = ("old_logp", "advantage", "rollout_logp", "ref_logp", "token_weight", "old_entropy", "sentence_end",
                "loss_mask", "kl_weight", "low_prob", "entropy_score", "mismatch_mask")
# optional ones: every sample of a batch has it or none does
OPTIONAL_FIELDS = ("rollout_logp", "ref_logp", "token_weight", "old_entropy", "sentence_end", "loss_mask",
                   "kl_weight", "low_prob", "entropy_score", "mismatch_mask")
# per-token rows: k values per response token (every sample of a batch has them or none does)
TOPK_FIELDS = ("teacher_topk_ids", "teacher_topk_logp")


class MappingSample:
    """A dict train sample seen as a TrainSample: attribute reads and writes go to the dict, an absent key reads
    None, a name that is not a field is refused (AttributeError naming it). What `as_train_samples` makes of a
    dict, so that the stages' writes (old_logp, routes, token_weight, ...) land in the caller's dict."""

    __slots__ = ("data",)

    def __init__(self, data: MutableMapping[str, Any]):
        object.__setattr__(self, "data", data)

    def __getattr__(self, name: str) -> Any:
        if name not in FIELDS:
            raise AttributeError(f"TrainSample has no field {name!r} (fields: {', '.join(FIELDS)})")
        return self.data.get(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in FIELDS:
            raise AttributeError(f"TrainSample has no field {name!r} (fields: {', '.join(FIELDS)})")
        self.data[name] = value


def as_train_samples(batch: Iterable[TrainSample | Mapping[str, Any]]) -> list[TrainSample]:
    """`batch` as train samples: a TrainSample (or a MappingSample) as it is, a dict seen through a MappingSample
    (its writes land in the dict). Called once at the boundary of every function that takes train samples."""
    return [s if isinstance(s, (TrainSample, MappingSample)) else MappingSample(s) for s in batch]  # type: ignore


def without_routes(sample: TrainSample) -> TrainSample:
    """A copy of `sample` with no routes (what a step that records its own routing trains on)."""
    if isinstance(sample, MappingSample):
        return MappingSample({k: v for k, v in sample.data.items() if k != "routes"})  # type: ignore[return-value]
    return replace(sample, routes=None)


def _field(name: str) -> str:
    if name not in FIELDS:
        raise KeyError(f"TrainSample has no field {name!r} (fields: {', '.join(FIELDS)})")
    return name
