"""DUET's in-engine abort (Hu et al. 2026, DUET: Optimize Token-Budget Allocation for Reinforcement Learning with
Verifiable Rewards, arXiv:2605.08441): the embedded engine stops a rollout with no answer marker at horizon + grace
tokens unless it drew keep. Checked against the same rollouts generated without the rule and cut here, against the
post-hoc rule (an engine that cannot stop a request) and a loop written out here on the same draws, by the engine's
decode-token counter, and across a resume."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest

from megapo.config import load_config
from megapo.engines.base import AbortRule, EngineCapabilities, SamplingParams
from megapo.engines.embedded import EmbeddedEngine
from megapo.tasks.base import Example
from megapo.trainer.config import RunConfig
from megapo.trainer.length_stage import LengthStage
from megapo.trainer.rollout import Group, generate_counts
from preemption import generate_preempted

CONFIG = Path(__file__).resolve().parents[1] / "megapo/configs/stability_base.yaml"
SEED, HORIZON, GRACE, KEEP = 3, 4, 2, 0.3
AT = HORIZON + GRACE
MAX_NEW = 16
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26]]
EXAMPLES = [Example(f"q{i}", "a") for i in range(len(PROMPTS))]


def text_of(i: int) -> str:
    """The test tokenizer's text of token i: the marker "#" for every 16th id, else one letter."""
    return "#" if i % 16 == 0 else chr(ord("a") + i % 26)


class Tokenizer:
    eos_token_id = 1

    def decode(self, ids, skip_special_tokens=False):
        return "".join(text_of(int(i)) for i in ids)


class PostHocEngine:
    """The embedded engine behind an interface that cannot stop a request on a marker rule (vLLM / SGLang)."""

    capabilities = EngineCapabilities()

    def __init__(self, inner):
        self.inner = inner

    def generate(self, prompts, params):
        assert params.abort is None
        return self.inner.generate(prompts, params)


def _cfg() -> RunConfig:
    options = f"{{marker: '#', horizon: {HORIZON}, grace: {GRACE}, keep_prob: {KEEP}}}"
    return load_config(RunConfig, CONFIG, ["data.group_filter=duet", "data.dynamic_sampling=false",
                                           f"rollout.max_new_tokens={MAX_NEW}", f"train.seed={SEED}",
                                           f"data.group_filter_options={options}"])


@pytest.fixture(scope="module")
def engine(tiny_moe):
    return EmbeddedEngine(tiny_moe)


def _params(engine) -> SamplingParams:
    """Some rows end early at a stop token (one the model draws without it)."""
    free = engine.generate(PROMPTS, SamplingParams(n=1, max_new_tokens=MAX_NEW, seed=9))
    return SamplingParams(n=1, max_new_tokens=MAX_NEW, seed=9, stop_token_ids=(free[0][0].output_ids[3],),
                          return_routes=True)


def _round(stage: LengthStage, engine, params: SamplingParams):
    """One trainer round (megapo.trainer.rollout.collect_rollouts' one_round): counts, the abort params, one engine
    call, rewards (parity of the token ids), the length stage."""
    stage.begin_batch()
    counts = stage.rollout_counts(EXAMPLES, 8)
    drawn = generate_counts(engine, stage.abort_params(engine, params, counts), PROMPTS, counts)
    groups = [Group(ex, samples, [float(sum(s.output_ids) % 2) for s in samples], prompt_index=i)
              for i, (ex, samples) in enumerate(zip(EXAMPLES, drawn))]
    return counts, drawn, stage.apply(groups)


def _expected(free_flat, uniforms):
    """The abort rule written out on full rollouts: judged = ran past H + G tokens with no "#" in the first H + G;
    a judged one is kept at 1/q when its uniform < q, else aborted (weight 0)."""
    weights = []
    for s, u in zip(free_flat, uniforms):
        marker = "#" in "".join(text_of(t) for t in s.output_ids[:AT])
        judged = len(s.output_ids) > AT and not marker
        weights.append((1.0 / KEEP if u < KEEP else 0.0) if judged else 1.0)
    return weights


def test_engine_abort_truncates_matches_the_post_hoc_rule_and_decodes_fewer_tokens(engine):
    params = _params(engine)
    engine_stage = LengthStage(_cfg(), tokenizer=Tokenizer())
    post_stage = LengthStage(_cfg(), tokenizer=Tokenizer())
    before = engine.tokens_decoded
    counts, drawn, out = _round(engine_stage, engine, params)
    in_engine = engine.tokens_decoded - before
    before = engine.tokens_decoded
    counts_p, free, out_p = _round(post_stage, PostHocEngine(engine), params)
    full = engine.tokens_decoded - before
    assert counts == counts_p and sum(counts) == 24

    rng = random.Random(f"duet/{SEED}/1/0")  # the draws: train.seed, step 1, round 0, one per rollout in order
    uniforms = [rng.random() for _ in range(sum(counts))]
    flat, free_flat = [s for g in drawn for s in g], [s for g in free for s in g]
    weights = _expected(free_flat, uniforms)
    cases = {"aborted": 0, "kept": 0, "other": 0}
    for s, f, u, w in zip(flat, free_flat, uniforms, weights):
        if w == 0.0:  # aborted in the engine: the full rollout cut at H + G, token for token
            cases["aborted"] += 1
            assert s.finish_reason == "abort" and s.output_ids == f.output_ids[:AT]
            assert np.allclose(s.logprobs, f.logprobs[:AT], atol=1e-6)
            assert np.array_equal(s.routes, f.routes[:len(f.prompt_ids) + AT - 1])
        else:  # kept (drew keep: w = 1/q), or marker in time, or ended first: runs to its end
            cases["kept" if w > 1 else "other"] += 1
            assert s.finish_reason == f.finish_reason != "abort" and s.output_ids == f.output_ids
            assert np.allclose(s.logprobs, f.logprobs, atol=1e-6)
    assert min(cases.values()) >= 1, cases
    assert any(f.finish_reason == "stop" for f in free_flat)

    # the selection: the same kept rollouts and weights on both paths, and the loop's
    starts = np.cumsum([0] + counts)
    expected = []
    for gi in range(len(counts)):
        w = weights[starts[gi]:starts[gi + 1]]
        idx = [i for i, x in enumerate(w) if x > 0]
        if len(idx) >= 2:  # min_rollouts
            expected.append((gi, idx, [w[i] for i in idx]))
    for got in (out, out_p):
        assert [(g.prompt_index, g.sample_ids, g.weights) for g in got] == expected
    assert [[s.output_ids for s in g.samples] for g in out] == [[s.output_ids for s in g.samples] for g in out_p]
    assert engine_stage.filter.state_dict() == post_stage.filter.state_dict()  # the tracker saw the same verdicts
    m, m_p = engine_stage.metrics(), post_stage.metrics()
    assert m["length/duet_aborted"] == m_p["length/duet_aborted"] == m["length/duet_engine_aborted"] == \
        cases["aborted"] and m_p["length/duet_engine_aborted"] == 0
    assert m["length/duet_tokens_charged"] == m_p["length/duet_tokens_charged"]

    # fewer decode tokens: the counter drops by what the aborted rollouts would have run past H + G
    assert in_engine == sum(len(s.output_ids) for s in flat)
    saved = sum(len(f.output_ids) - AT for f, w in zip(free_flat, weights) if w == 0.0)
    assert full - in_engine == saved > 0


def test_the_post_hoc_path_is_logged_once_and_leaves_params_alone(engine, caplog):
    stage = LengthStage(_cfg(), tokenizer=Tokenizer())
    post, params = PostHocEngine(engine), SamplingParams(n=1, max_new_tokens=MAX_NEW, seed=1)
    with caplog.at_level(logging.INFO, logger="megapo.trainer.length_stage"):
        for _ in range(2):
            assert stage.abort_params(post, params, [2, 2]) is params
            assert stage.abort_params(engine, params, [2, 2]).abort.at == AT
    messages = [r.getMessage() for r in caplog.records]
    assert sum("after generation" in m for m in messages) == 1 and not any("in the engine" in m for m in messages)


def test_a_resumed_filter_draws_the_same_keeps(engine):
    """The draws follow (train.seed, step, round), which the checkpoint already holds: a filter resumed after two
    steps gives the third step's rollouts the keep draws of the unstopped one."""
    whole, first = LengthStage(_cfg(), tokenizer=Tokenizer()), LengthStage(_cfg(), tokenizer=Tokenizer())
    params = SamplingParams(n=1, max_new_tokens=MAX_NEW, seed=4)
    for stage in (whole, first):
        for _ in range(2):
            _round(stage, engine, params)
    resumed = LengthStage(_cfg(), state=json.loads(json.dumps(first.state_dict())), tokenizer=Tokenizer())
    keeps = []
    for stage in (whole, resumed):
        stage.begin_batch()
        keeps.append(stage.abort_params(engine, params, stage.rollout_counts(EXAMPLES, 8)).abort.keep)
    assert keeps[0] == keeps[1]
    rng = random.Random(f"duet/{SEED}/3/0")
    assert list(keeps[0]) == [rng.random() < KEEP for _ in range(len(keeps[0]))]


def test_the_engine_refuses_keep_draws_of_another_batch(engine):
    rule = AbortRule(AT, (False,) * 2, lambda ids: False)
    with pytest.raises(ValueError, match="SamplingParams.abort"):
        engine.generate(PROMPTS, SamplingParams(n=1, max_new_tokens=MAX_NEW, abort=rule))
    with pytest.raises(ValueError, match="AbortRule.at"):
        AbortRule(0, (), lambda ids: False)


def _preempted_run(model_dir, preempt_at_call: int):
    """Every row marker-less and not kept (all would be aborted at H + G), the batch preempted inside the
    preempt_at_call-th model call (the prefill is the first), then the trainer's sync played: pause, the same
    weights as version 1, resume."""
    engine = EmbeddedEngine(model_dir, seed=2)
    params = SamplingParams(n=2, max_new_tokens=MAX_NEW, abort=AbortRule(AT, (False,) * 4, lambda ids: False))
    same = [(k, v.clone()) for k, v in engine.weight_buffers().items()]
    return [s for g in generate_preempted(engine, PROMPTS[:2], params, same, preempt_at_call) for s in g]


def test_a_preempted_batch_keeps_its_aborts_and_continues_the_rest_without_the_rule(tiny_moe):
    """Preempted at the abort check: the rows it ended stay ended (not continued); preempted before it: the rows
    continue on the new weights to their end (the selection then judges them on the same draws)."""
    at_check = _preempted_run(tiny_moe, AT)  # the flag is seen after the AT-th token, once the check has run
    assert [(s.finish_reason, len(s.output_ids), s.weight_version) for s in at_check] == [("abort", AT, 0)] * 4
    before = _preempted_run(tiny_moe, 3)  # seen after the 3rd token
    assert [(s.finish_reason, len(s.output_ids)) for s in before] == [("length", MAX_NEW)] * 4
    assert all(s.token_versions == [0] * 3 + [1] * (MAX_NEW - 3) for s in before)
