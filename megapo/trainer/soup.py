"""Stage soup's mixed samples (SOUP, megapo/algorithms/soup.py): rank 0's side of a step, the prefix buffer and the
config's refusals.

After the step's groups are sampled and scored, each group whose prompt the buffer holds from an earlier step (the
historical policy: the one that drew it then) gets its last k = `mix` samples replaced by mixed ones: a prefix of a
stored response (its tokens and the log-probs μ the engine gave them then) and a continuation the engine draws now
behind x ⊕ prefix (one engine call per continuation budget, the whole step's). The mixed sample's tokens are prefix ⊕
continuation, its log-probs μ ⊕ the engine's, its routes the continuation call's (they cover every fed position,
the prefix's from its prefill: what r3 replays), its token versions the prefix's then the continuation's, its reward
the verifier's on the whole. Group.prefix_lens says how many tokens of each sample are a historical prefix (stage soup
sets π_old := μ there). The replaced samples were drawn and are dropped.

The buffer then keeps, per prompt, the first `mix` responses of this step's kept groups as drawn (all on-policy),
with the trainer step and weight version: a prompt's entry is replaced at each visit. It is kept in the checkpoint
(state_dict) so a resumed run mixes as the unstopped one.

The update's engine-vs-learner metrics (the old-log-prob pass's mismatch/* and replay/kl_k3*, the learner's
train/mismatch_* through TrainSample.mismatch_mask, which stage soup sets) count the tokens this step's engine
sampled only: a prefix's μ is the historical policy's, so its gap to π_old is staleness, not mismatch;
soup/prefix_k3 measures the prefixes apart (batch_prefix_lens, prefix_split, prefix_mismatch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megapo.algorithms.soup import STAGE, SoupOptions, mixed_slots, prefix_fractions, prefix_length
from megapo.config import ConfigError
from megapo.engines.base import Sample, SamplingParams, versions_of


@dataclass
class PrefixBuffer:
    """Per prompt (its place in the pool), the responses of the last step that drew it: output ids, the engine's
    log-probs μ, whether it ended with end-of-sequence, its weight version, and that step."""

    keep: int  # responses kept per prompt (the stage's mix)
    entries: dict[int, dict] = field(default_factory=dict)

    def earlier(self, prompt_index: int | None, step: int) -> list[dict] | None:
        """The prompt's stored responses when drawn at a step before `step` (None: none)."""
        e = self.entries.get(prompt_index) if prompt_index is not None else None
        return e["responses"] if e is not None and e["step"] < step and e["responses"] else None

    def put(self, prompt_index: int | None, step: int, samples: list[Sample]) -> None:
        if prompt_index is None:
            return
        self.entries[int(prompt_index)] = {"step": int(step), "responses": [
            {"ids": [int(t) for t in s.output_ids], "logp": [float(v) for v in s.logprobs],
             "stop": s.finish_reason == "stop", "version": int(s.weight_version)} for s in samples[:self.keep]]}

    def state_dict(self) -> dict:
        return {"keep": self.keep, "entries": {str(k): v for k, v in self.entries.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.entries = {int(k): v for k, v in (state or {}).get("entries", {}).items()}


@dataclass(frozen=True)
class MixRequest:
    """One mixed sample to draw: group gi, slot, the stored response, its prefix length."""

    gi: int
    slot: int
    stored: dict
    prefix: int


def mixed_requests(groups: list, buffer: PrefixBuffer, o: SoupOptions, seed: int, step: int,
                   max_new_tokens: int) -> list[MixRequest]:
    """The mixed samples of a step, in group and slot order: slot j of a group's mixed slots takes stored response
    j (cycling) of its prompt, cut at a share from prefix_fractions."""
    out = []
    for gi, g in enumerate(groups):
        stored = buffer.earlier(g.prompt_index, step)
        if stored is None:
            continue
        slots = mixed_slots(len(g.samples), o.mix)
        fracs = prefix_fractions(seed, step, g.prompt_index, len(slots), o.prefix_min, o.prefix_max)
        for j, (slot, f) in enumerate(zip(slots, fracs)):
            r = stored[j % len(stored)]
            L = prefix_length(len(r["ids"]), r["stop"], f, max_new_tokens)
            if L:
                out.append(MixRequest(gi, slot, r, L))
    return out


def mixed_sample(prompt_ids: list[int], r: MixRequest, cont: Sample) -> Sample:
    """prefix ⊕ continuation as one sample behind the original prompt: μ of the prefix then the engine's, the
    continuation call's routes (every fed position), the prefix's weight version on its tokens."""
    L = r.prefix
    versions = [int(r.stored["version"])] * L + versions_of(cont)
    return Sample(prompt_ids=list(prompt_ids), output_ids=list(r.stored["ids"][:L]) + list(cont.output_ids),
                  logprobs=[float(v) for v in r.stored["logp"][:L]] + list(cont.logprobs),
                  finish_reason=cont.finish_reason, weight_version=min(versions), routes=cont.routes,
                  token_versions=versions)


@dataclass
class SoupRollouts:
    """Rank 0: the mixed samples of one step (__call__) and the prefix buffer, as stage soup's options ask."""

    params: SamplingParams  # the run's; n becomes 1, max_new_tokens the budget left after the prefix
    options: SoupOptions
    seed: int  # train.seed: the prefix draws'
    threshold: float  # data.correct_threshold (a group's verdicts, where set)
    step: int = 1  # the trainer step the next call belongs to (Run.generate sets it)
    buffer: PrefixBuffer = None

    def __post_init__(self):
        if self.buffer is None:
            self.buffer = PrefixBuffer(self.options.mix)

    def __call__(self, engine, groups: list, reward_fn) -> tuple[list, dict, int]:
        """`groups` with their mixed samples in place (Group.prefix_lens set on every group), the metrics
        soup/mixed, soup/mixed_groups, soup/prefix_len, soup/mixed_reward, and the tokens generated."""
        requests = mixed_requests(groups, self.buffer, self.options, self.seed, self.step, self.params.max_new_tokens)
        for g in groups:  # this step's responses, as drawn, for the prompts' next visits
            self.buffer.put(g.prompt_index, self.step, list(g.samples))
        drawn = self._continuations(engine, groups, requests)
        mixed = [mixed_sample(groups[q.gi].samples[q.slot].prompt_ids, q, c) for q, c in zip(requests, drawn)]
        scores = reward_fn([(groups[q.gi].example, s) for q, s in zip(requests, mixed)]) if mixed else []
        out = [self._replaced(gi, g, requests, mixed, scores) for gi, g in enumerate(groups)]
        metrics = {"soup/mixed": float(len(mixed)), "soup/mixed_groups": float(len({q.gi for q in requests})),
                   "soup/prefix_len": sum(q.prefix for q in requests) / len(requests) if requests else 0.0,
                   "soup/mixed_reward": sum(scores) / len(scores) if scores else 0.0}
        return out, metrics, sum(len(c.output_ids) for c in drawn)

    def _continuations(self, engine, groups: list, requests: list[MixRequest]) -> list[Sample]:
        """Each request's continuation behind x ⊕ prefix, one engine call per budget left (max_new_tokens − L)."""
        out: list[Sample | None] = [None] * len(requests)
        for budget in sorted({self.params.max_new_tokens - q.prefix for q in requests}):
            idx = [i for i, q in enumerate(requests) if self.params.max_new_tokens - q.prefix == budget]
            prompts = [list(groups[requests[i].gi].samples[requests[i].slot].prompt_ids)
                       + list(requests[i].stored["ids"][:requests[i].prefix]) for i in idx]
            params = dataclasses.replace(self.params, n=1, max_new_tokens=budget)
            for i, samples in zip(idx, engine.generate(prompts, params)):
                out[i] = samples[0]
        return out

    def _replaced(self, gi: int, g, requests: list[MixRequest], mixed: list[Sample], scores: list[float]):
        """Group gi with its mixed samples in their slots (reward, score and verdict too) and its prefix lengths."""
        samples, rewards = list(g.samples), list(g.rewards)
        scores_g = list(g.scores) if g.scores is not None else None
        correct = list(g.correct) if g.correct is not None else None
        prefix = [0] * len(samples)
        for q, s, r in zip(requests, mixed, scores):
            if q.gi != gi:
                continue
            samples[q.slot], rewards[q.slot], prefix[q.slot] = s, float(r), q.prefix
            if scores_g is not None:
                scores_g[q.slot] = float(r)
            if correct is not None:
                correct[q.slot] = float(r) >= self.threshold
        return dataclasses.replace(g, samples=samples, rewards=rewards, scores=scores_g, correct=correct,
                                   prefix_lens=prefix)


def prefix_lens(groups: list) -> list[int]:
    """Each sample's historical prefix length in batch order (Group.prefix_lens; 0 on a group without them): stage
    soup's input soup_prefix."""
    return [int(n) for g in groups for n in (g.prefix_lens or [0] * len(g.samples))]


def batch_prefix_lens(groups: list) -> list[int] | None:
    """prefix_lens, or None when no sample of the step has a prefix."""
    lens = prefix_lens(groups)
    return lens if any(lens) else None


def prefix_split(samples: list, prefix_lens: list[int], prefix: bool) -> list:
    """Copies of `samples` whose loss_mask keeps, of the policy's response tokens, those the current engine sampled
    (each sample's tokens from its historical prefix of prefix_lens tokens on), or with `prefix` the prefix's only:
    what the engine-vs-learner comparisons (megapo.replay.modes: policy_token_mask) count."""
    from megapo.algorithms.sample import MappingSample, as_train_samples

    out = []
    for s, L in zip(as_train_samples(samples), prefix_lens):
        given = s.loss_mask if s.loss_mask is not None else [1] * (len(s.tokens) - s.prompt_len)
        mask = [int(m) if (t < L) == prefix else 0 for t, m in enumerate(given)]
        out.append(MappingSample({**s.data, "loss_mask": mask}) if isinstance(s, MappingSample)
                   else dataclasses.replace(s, loss_mask=mask))
    return out


def prefix_mismatch(samples: list, logps: list, prefix_lens: list[int]) -> dict:
    """soup/prefix_k3: k3 = mean(ρ − 1 − log ρ), ρ = π_old/μ, over the historical prefixes' tokens (μ: the
    historical policy's log-probs, so staleness as well as engine-vs-learner mismatch), which the mismatch/*
    metrics leave out; {} when the step mixed no sample."""
    from megapo.replay.modes import engine_mismatch

    if not any(prefix_lens):
        return {}
    return {"soup/prefix_k3": engine_mismatch(prefix_split(samples, prefix_lens, prefix=True), logps)["k3"]}


def soup_stage_index(cfg) -> int | None:
    """The place of stage soup in algorithm.stages (None: not listed)."""
    return next((i for i, s in enumerate(cfg.algorithm.pipeline()) if s.name == STAGE), None)


def soup_rollouts(cfg, params: SamplingParams) -> SoupRollouts | None:
    """Stage soup's mixed samples for this run (rank 0), None when algorithm.stages has no soup."""
    i = soup_stage_index(cfg)
    if i is None:
        return None
    return SoupRollouts(params, cfg.algorithm.pipeline()[i].options, cfg.train.seed, cfg.data.correct_threshold)


def check_soup(cfg) -> None:
    """Stage soup's refusals at config time, each naming its field: mix below rollout.n_samples (one sample of each
    group stays on-policy and refills the buffer), room for a prefix and a continuation (rollout.max_new_tokens >= 2),
    sync rollouts (the buffer and the draws follow the trainer step), single-turn, no length reward or group filter
    (the mixed samples replace slots of whole groups and keep the verifier's reward), the first token stage (the
    others read π_old after it set μ on the prefixes) and not beside hdpo or anytime (they add groups from the
    samples soup replaces)."""
    i = soup_stage_index(cfg)
    if i is None:
        return
    o, where, stages = cfg.algorithm.pipeline()[i].options, f"algorithm.stages[{i}]", cfg.algorithm.pipeline()
    if o.mix >= cfg.rollout.n_samples:
        raise ConfigError(f"{where}.mix", f"soup mixes {o.mix} of rollout.n_samples={cfg.rollout.n_samples} samples; "
                          "keep at least one on-policy (it refills the prefix buffer): mix < n_samples")
    if cfg.rollout.max_new_tokens < 2:
        raise ConfigError("rollout.max_new_tokens", "soup needs room for a prefix and a continuation: >= 2")
    if cfg.train.mode != "sync":
        raise ConfigError("train.mode", f"stage soup ({where}) keeps a prefix buffer by trainer step and draws its "
                          "prefix lengths from it, which async rollouts do not follow; use sync")
    if cfg.env_factory() is not None:
        raise ConfigError(where, "soup mixes single responses; multi-turn trajectories (env) are not supported")
    for name in ("length_reward", "group_filter"):
        if getattr(cfg.data, name) != "none":
            raise ConfigError(f"data.{name}", f"stage soup ({where}) replaces slots of whole groups and scores them "
                              "with the verifier only; use none")
    first = next(j for j, s in enumerate(stages) if s.kind == "token")
    if first != i:
        raise ConfigError(where, f"soup sets π_old := μ on the historical prefixes; list it before the token stage "
                          f"{stages[first].name} (algorithm.stages[{first}]), which reads π_old")
    other = next((s.name for s in stages if s.name in ("hdpo", "anytime")), None)
    if other is not None:
        raise ConfigError(where, f"soup and {other} both change the step's groups after sampling; list one of them")
