"""Partial rollouts (rollout.partial, issue 18): a weight update preempts the embedded engine's batch in flight;
its samples keep their tokens and continue on the new weights.

Independent checks: every output token's log-prob equals transformers' fp32 log-prob of that token under the
weights of the version the engine says produced it (1e-5); a preempted sample's routes are the old weights'
router choice up to its last fed token and the new weights' after it (each computed by a fresh full forward
under those weights); the version bound restarts a sample instead of letting it span more versions; in a
`megapo train` async run with partial rollouts some responses span two versions and each token's engine
log-prob equals the learner's log-prob under the version that produced it."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from megapo.engines.base import SamplingParams  # noqa: E402
from megapo.engines.embedded import EmbeddedEngine, versions_of  # noqa: E402
from preemption import generate_preempted  # noqa: E402


def _perturbed(model_dir, seed=1):
    """The model's HF tensors with noise on every weight: the version-1 weights."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return hf, {k: v.clone() for k, v in hf.state_dict().items()}


def _hf_token_logprobs(model, tokens, prompt_len):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return lp[prompt_len - 1:]


def test_preempted_samples_continue_on_the_new_weights(tiny_moe):
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    new, new_weights = _perturbed(tiny_moe)
    engine = EmbeddedEngine(tiny_moe, seed=3)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, stop_token_ids=(10**6 - 1,), return_routes=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    groups = generate_preempted(engine, prompts, params, new_weights.items(), preempt_at_call=5)  # 1 prefill + 3 decode

    spanning = 0
    for prompt, group in zip(prompts, groups):
        for s in group:
            assert s.finish_reason == "length" and len(s.output_ids) == 12
            versions = versions_of(s)
            assert versions == sorted(versions) and set(versions) <= {0, 1} and s.weight_version == min(versions)
            spanning += len(set(versions)) == 2
            tokens = prompt + s.output_ids
            want = torch.where(torch.tensor(versions) == 0, _hf_token_logprobs(old, tokens, len(prompt)),
                               _hf_token_logprobs(new, tokens, len(prompt)))
            assert torch.allclose(torch.tensor(s.logprobs), want, atol=1e-5), (versions, s.logprobs, want)
            # routes: each fed position as the weights that fed it chose
            fed_old = len(prompt) + versions.count(0) - 1
            assert s.routes.shape[0] == len(tokens) - 1
            for weights, lo, hi in ((None, 0, fed_old), (new_weights, fed_old, len(tokens) - 1)):
                fresh = EmbeddedEngine(tiny_moe)
                if weights is not None:
                    fresh.update_weights(weights.items(), 1)
                _, routes = fresh.model.logits(torch.tensor([tokens]), with_routes=True)
                assert (torch.as_tensor(s.routes[lo:hi]) == routes[0, lo:hi].to(torch.int32)).all(), (lo, hi)
    assert spanning == 4  # every sample was mid-response at the preemption


def test_a_sample_spans_at_most_max_versions(tiny_dense):
    """max_versions 1: a preempted sample is drawn again from its prompt on the new weights."""
    _, new_weights = _perturbed(tiny_dense)
    engine = EmbeddedEngine(tiny_dense, seed=0)
    engine.max_versions = 1
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=8, stop_token_ids=(10**6 - 1,))
    [[s]] = generate_preempted(engine, [[4, 5, 6]], params, new_weights.items(), preempt_at_call=3)
    assert s.weight_version == 1 and set(versions_of(s)) == {1} and len(s.output_ids) == 8
    assert s.prompt_ids == [4, 5, 6]


def test_partial_refused_without_async(tiny_moe, tmp_path):
    from megapo.config import ConfigError, load_config
    from megapo.trainer.config import RunConfig

    base = [f"model.path={tiny_moe}", "data.task=addition", "rollout.n_samples=4", "data.prompts_per_step=8",
            f"train.output_dir={tmp_path / 'run'}", "rollout.partial=true"]
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, base)
    assert err.value.field == "rollout.partial" and "train.mode=async" in str(err.value)
    assert load_config(RunConfig, None, base + ["train.mode=async"]).rollout.partial


def test_async_run_with_partial_rollouts(tmp_path, tiny_dense, reward_module):
    """Long generations, the learner's first sync lands mid-batch: batch 2 stops at its 6th token until the sync
    preempts it (no timing race, whatever the machine's load). Every trained token's engine log-prob equals the
    learner's (transformers) log-prob under the version that drew it."""
    from test_trainer_async import SnapshotLearner, _cfg

    from megapo.trainer.loop import train

    class GatedEngine:
        """Batch 2 holds at its 6th token until preempt() is called; the learner's first update waits for that."""

        GATE_TOKEN = 6

        def __init__(self):
            self.inner = EmbeddedEngine(tiny_dense, seed=0)
            self.samples, self.calls, self.tokens = {}, 0, 0
            self.at_gate, self.preempted = threading.Event(), threading.Event()
            step = self.inner.model.step

            def gated(*a, **kw):
                self.tokens += 1
                if self.calls == 2 and self.tokens == self.GATE_TOKEN:
                    self.at_gate.set()
                    if not self.preempted.wait(120):
                        raise TimeoutError("batch 2 was never preempted")
                return step(*a, **kw)

            self.inner.model.step = gated

        def generate(self, prompts, params):
            self.calls, self.tokens = self.calls + 1, 0
            out = self.inner.generate(prompts, params)
            for g in out:
                for s in g:
                    self.samples[tuple(s.prompt_ids + s.output_ids)] = s
            return out

        def preempt(self):
            self.inner.preempt()
            self.preempted.set()

        def __getattr__(self, name):
            return getattr(self.inner, name)

    engine = GatedEngine()

    class Learner(SnapshotLearner):
        def train_step(self, batch, loss):
            out = super().train_step(batch, loss)
            if len(self.snapshots) == 2 and not engine.at_gate.wait(120):  # the first update: its sync comes next
                raise TimeoutError("batch 2 never reached its gate")
            return out

    learner = Learner(tiny_dense)
    cfg = _cfg(tiny_dense, tmp_path / "run", reward_module,
               **{"rollout.partial": True, "rollout.max_new_tokens": 24, "train.steps": 5, "train.staleness": 1})
    train(cfg, learner=learner, engine=engine, print_fn=lambda *_: None)
    from transformers import AutoModelForCausalLM

    check = AutoModelForCausalLM.from_pretrained(tiny_dense, dtype=torch.float32)
    spanning = 0
    for batch in learner.batches:
        for t in batch:
            s = engine.samples[tuple(t["tokens"])]
            versions = torch.tensor(versions_of(s))
            spanning += len(set(versions.tolist())) > 1
            want = torch.zeros(len(versions))
            for v in set(versions.tolist()):
                lp = _hf_token_logprobs(check.eval() if check.load_state_dict(learner.snapshots[v]) else check,
                                        t["tokens"], t["prompt_len"])
                want = torch.where(versions == v, lp, want)
            assert torch.allclose(torch.tensor(t["rollout_logp"]), want, atol=1e-5)
    assert spanning > 0
