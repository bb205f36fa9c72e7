"""SPO's prioritised prompt sampling (Xu & Ding 2025, Single-stream Policy Optimization, arXiv:2509.13232):
megapo.trainer.data.PrioritizedPromptSource draws each batch from a window of shuffled candidates with probability
∝ √(v̂(1 − v̂)) + ε, v̂ the value tracker's success rate; deterministic given train.seed and the draw count, and a
run restored from its saved state draws what the uninterrupted one would."""

from __future__ import annotations

import json
import math
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from megapo.algorithms.value_tracker import SPOOptions, ValueTracker, priority_weights, spo_advantages
from megapo.trainer.data import PrioritizedPromptSource, PromptSource, prompt_source

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from algorithm_configs import config_data, make_cfg  # noqa: E402


def test_weights_are_the_papers_formula():
    values = [0.0, 1.0, 0.5, 0.1, 0.93]
    eps = 0.05
    got = priority_weights(values, eps).tolist()
    for v, w in zip(values, got):
        assert w == pytest.approx(math.sqrt(v * (1 - v)) + eps, abs=1e-15)
    p = ValueTracker().priorities(["a", "b"], SPOOptions())  # unseen prompts: the prior 0.5, equal
    assert p.tolist() == pytest.approx([0.5, 0.5])


def test_draws_follow_the_weights():
    """One prompt per draw out of all four (a window of the whole epoch): its frequency is w / Σw."""
    values = [0.0, 0.5, 0.9, 1.0]
    src = PrioritizedPromptSource(4, lambda idx: [values[i] for i in idx], seed=3, candidates=4, eps=0.05)
    draws = 6000
    counts = np.bincount([src.next_batch(1)[0] for _ in range(draws)], minlength=4) / draws
    w = [math.sqrt(v * (1 - v)) + 0.05 for v in values]
    for freq, wi in zip(counts, w):
        assert freq == pytest.approx(wi / sum(w), abs=0.02)


def test_batches_are_distinct_prompts_from_the_shuffles_window():
    src = PrioritizedPromptSource(10, lambda idx: [0.5] * len(idx), seed=0, candidates=2)
    window = PromptSource(10, seed=0).next_batch(8)
    batch = src.next_batch(4)
    assert len(set(batch)) == 4 and set(batch) <= set(window)


def test_deterministic_given_the_seed():
    def run(seed):
        src = PrioritizedPromptSource(13, lambda idx: [(i % 5) / 4 for i in idx], seed=seed, candidates=3)
        return [src.next_batch(3) for _ in range(8)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def _rewards(index: int, step: int) -> list[float]:
    return [float((index * 7 + step * 3 + j) % 3 == 0) for j in range(2)]


def _run(steps: int, src: PrioritizedPromptSource, tracker: ValueTracker, first_step: int = 1) -> list[list[int]]:
    """`steps` trainer steps: draw a batch, then update the tracker with the batch's rewards (as the trainer does)."""
    batches = []
    for step in range(first_step, first_step + steps):
        batch = src.next_batch(3)
        batches.append(batch)
        spo_advantages([_rewards(i, step) for i in batch], [f"p{i}" for i in batch], tracker, step)
    return batches


def _source(tracker_of) -> PrioritizedPromptSource:
    o = SPOOptions()
    return PrioritizedPromptSource(11, lambda idx: [tracker_of().value(f"p{i}", o) for i in idx], seed=5,
                                   candidates=2)


def test_resumed_sampler_draws_what_the_uninterrupted_one_would():
    whole = {"t": ValueTracker()}
    uninterrupted = _run(12, _source(lambda: whole["t"]), whole["t"])

    first = {"t": ValueTracker()}
    src = _source(lambda: first["t"])
    before = _run(5, src, first["t"])
    saved = json.loads(json.dumps({"cursor": src.state_dict(), "tracker": first["t"].state_dict()}))  # checkpoint

    second = {"t": ValueTracker(saved["tracker"])}
    resumed = _source(lambda: second["t"])
    resumed.load_state_dict(saved["cursor"])
    after = _run(7, resumed, second["t"], first_step=6)
    assert before + after == uninterrupted
    assert saved["cursor"]["draws"] == 5 and set(saved["cursor"]) == {"epoch", "index", "seed", "draws"}


def test_the_run_picks_the_prioritised_source_and_reads_the_tracker_live():
    cfg = make_cfg(advantage="spo", n_samples=1, advantage_options={"prioritized_sampling": True,
                                                                   "sampling_candidates": 2})
    pool = [(SimpleNamespace(prompt=f"q{i}"), [i]) for i in range(6)]
    holder = {"t": ValueTracker()}
    src = prompt_source(cfg, pool, tracker=lambda: holder["t"])
    assert isinstance(src, PrioritizedPromptSource) and src.candidates == 2 and src.cursor.seed == cfg.train.seed
    assert src.values([0, 1]) == [0.5, 0.5]  # the prior
    from megapo.algorithms.stages import prompt_key

    holder["t"] = ValueTracker({prompt_key("q1"): [3.0, 1.0, 1.0]})  # a resume replaces the tracker: read at draw
    assert src.values([1]) == [0.75]
    assert type(prompt_source(make_cfg(advantage="spo", n_samples=1), pool)) is PromptSource


@pytest.mark.parametrize("options, start", [
    ({"sampling_candidates": 0}, "sampling_candidates:"), ({"sampling_candidates": 1.5}, "sampling_candidates:"),
    ({"sampling_eps": 0}, "sampling_eps:"), ({"prioritized_sampling": "yes"}, "prioritized_sampling:"),
])
def test_option_refusals_name_the_field(options, start):
    from megapo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        make_cfg(advantage="spo", n_samples=1, advantage_options=options)
    assert err.value.field == "algorithm.advantage_options" and str(err.value.message).startswith(start)


def test_async_and_a_second_order_refused():
    from megapo.config import ConfigError, from_dict
    from megapo.trainer.config import RunConfig, _check_prompt_order

    def cfg(train=None, data=None):
        d = config_data(advantage="spo", n_samples=1, advantage_options={"prioritized_sampling": True})
        d["train"].update(train or {})
        d["data"].update(data or {})
        return from_dict(RunConfig, d)

    _check_prompt_order(cfg())
    with pytest.raises(ConfigError) as err:
        _check_prompt_order(cfg(train={"mode": "async"}))
    assert err.value.field == "algorithm.advantage_options.prioritized_sampling"
    with pytest.raises(ConfigError) as err:
        _check_prompt_order(cfg(data={"curriculum": "semantic_entropy"}))
    assert err.value.field == "data.curriculum"


def test_a_checkpoint_saved_under_another_prompt_order_is_refused_naming_the_option():
    from megapo.config import ConfigError
    from megapo.trainer.data import (CurriculumPromptSource, PrioritizedPromptSource, PromptSource,
                                     check_prompt_order)

    plain, curriculum = PromptSource(8, seed=1), CurriculumPromptSource(8, seed=1)
    spo = PrioritizedPromptSource(8, lambda idx: [0.5] * len(idx), seed=1)
    check_prompt_order(spo, spo.state_dict(), "ckpt")  # the same order: accepted
    check_prompt_order(plain, PromptSource(8, seed=1).state_dict(), "ckpt")
    for source, saved, field in [(plain, spo.state_dict(), "algorithm.advantage_options.prioritized_sampling"),
                                 (spo, plain.state_dict(), "algorithm.advantage_options.prioritized_sampling"),
                                 (plain, curriculum.state_dict(), "data.curriculum"),
                                 (curriculum, plain.state_dict(), "data.curriculum")]:
        with pytest.raises(ConfigError) as info:
            check_prompt_order(source, saved, "ckpt")
        assert info.value.field == field and "ckpt" in str(info.value)
