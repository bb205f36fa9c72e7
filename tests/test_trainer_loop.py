"""The RL loop's wiring, with the real embedded engine and a small stand-in learner written here on
Hugging Face transformers + megapo.algorithms.policy_loss (the Megatron learner has its own tests).

Checked: weights reach the engine (engine log-probs == learner log-probs after training), metrics and
held-out eval rows are written, dynamic sampling only trains on informative groups, mini-batches
split whole groups, and a resumed run continues with exactly the prompts an uninterrupted run sees.
"""

import json
from pathlib import Path

import pytest
import torch

from megapo.config import load_config
from megapo.trainer.config import RunConfig


class HFLearner:
    """The Learner contract (docs/CONTRACTS.md) on one process with a transformers model."""

    route_hook = None  # no routing replay

    def __init__(self, model_dir, lr=1e-3):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.calls: list[tuple[str, int]] = []
        self.batches: list[list[dict]] = []

    def _logp_rows(self, seqs):
        """log-probs of tokens 1.. of each sequence; one forward per group of equal length."""
        out = [None] * len(seqs)
        by_len = {}
        for i, seq in enumerate(seqs):
            by_len.setdefault(len(seq), []).append(i)
        for idx in by_len.values():
            ids = torch.tensor([seqs[i] for i in idx])
            logits = self.model(input_ids=ids).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None])[..., 0]
            for row, i in enumerate(idx):
                out[i] = logp[row]
        return out

    def logprobs(self, sequences, routes=None, with_entropy=False, prompt_lens=None):
        self.calls.append(("logprobs", len(sequences)))
        with torch.no_grad():
            return self._logp_rows([list(s) for s in sequences])

    def train_step(self, batch, loss):
        from megapo.algorithms import policy_loss

        self.calls.append(("train_step", len(batch)))
        self.batches.append(batch)
        self.opt.zero_grad()
        # packed form: every sample's response tokens one after another, cu_seqlens marking them
        rows = self._logp_rows([s["tokens"] for s in batch])
        logp = torch.cat([lp[s["prompt_len"] - 1:] for lp, s in zip(rows, batch)])
        lens = [len(s["tokens"]) - s["prompt_len"] for s in batch]
        cu = torch.tensor([0] + lens).cumsum(0)

        def cat(key):
            return torch.cat([torch.as_tensor(s[key], dtype=torch.float32) for s in batch])

        adv = torch.cat([torch.full((n,), s["advantage"]) for n, s in zip(lens, batch)])
        extra = {"ref_logp": cat("ref_logp")} if "ref_logp" in batch[0] else {}
        value, metrics = policy_loss(loss, logp, cat("old_logp"), adv, torch.ones_like(logp), cat("rollout_logp"),
                                     cu_seqlens=cu, **extra)
        value.backward()
        self.opt.step()
        return {"loss": float(value.detach()), **{k: float(v) for k, v in metrics.items()}}

    def hf_state_dict(self):
        return iter([(k, v.detach().clone()) for k, v in self.model.state_dict().items()])

    def stage_tensors(self):  # one process, one stage
        return self.hf_state_dict()

    def sync_stage(self):
        return 0, 1, True

    def save(self, d):
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict()}, Path(d) / "hf_learner.pt")

    def load(self, d):
        state = torch.load(Path(d) / "hf_learner.pt", weights_only=True)  # nothing unpickled from a run folder
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])


class RecordingEngine:
    """The embedded engine, recording the prompts it is asked for."""

    def __init__(self, model_dir, seed=0):
        from megapo.engines.embedded import EmbeddedEngine

        self.inner = EmbeddedEngine(model_dir, seed=seed)
        self.prompts: list[list[int]] = []

    def generate(self, prompts, params):
        self.prompts.extend(map(list, prompts))
        return self.inner.generate(prompts, params)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run_config(items: dict) -> RunConfig:
    """A validated RunConfig from {dotted field: value} (strings as written, the rest as JSON)."""
    return load_config(RunConfig, None, [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in items.items()])


def _cfg(tiny_dense, out, reward, **over):
    items = {
        "model.path": str(tiny_dense), "algorithm.routing_replay": "off", "algorithm.objective": "ppo",
        "rollout.n_samples": 4, "rollout.max_new_tokens": 6, "data.task": "addition", "data.reward": reward,
        "data.truncated_reward": None,
        "data.prompts_per_step": 4, "data.max_prompt_tokens": 16, "data.dynamic_sampling": True,
        "train.steps": 4, "train.eval_every": 2, "train.eval_prompts": 20, "train.ckpt_every": 2,
        "train.keep_last": 5, "train.output_dir": str(out), "train.log": ["jsonl"],
    }
    items.update(over)
    return run_config(items)


def test_loop_wiring_sync_metrics_dynamic_sampling(tmp_path, tiny_dense, reward_module):
    from megapo.trainer.loop import train

    cfg = _cfg(tiny_dense, tmp_path / "run", reward_module, **{"train.mini_batches": 2, "algorithm.kl_coef": 0.01})
    learner, engine = HFLearner(tiny_dense), RecordingEngine(tiny_dense)
    lines = []
    train(cfg, learner=learner, engine=engine, print_fn=lines.append)

    # weights reached the engine: its sampled log-probs equal the learner's on the same tokens
    from megapo.engines.base import SamplingParams

    out = engine.inner.generate([[21, 22, 13]], SamplingParams(n=2, max_new_tokens=5, temperature=1.0))[0]
    for s in out:
        ref = learner.logprobs([s.prompt_ids + s.output_ids])[0][len(s.prompt_ids) - 1:]
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-4)
    assert engine.inner.weight_version == 4  # one sync per step
    base = HFLearner(tiny_dense)
    assert not torch.allclose(base.logprobs([s.prompt_ids + s.output_ids])[0], learner.logprobs([s.prompt_ids + s.output_ids])[0])

    # dynamic sampling: every trained group has unequal rewards (so non-zero group advantages);
    # mini-batches hold whole groups (n_samples=4 consecutive rows of one prompt)
    assert learner.batches
    assert all(len(b) <= 8 for b in learner.batches)  # 2 mini-batches of at most 2 groups x 4 samples
    # KL penalty: ref_logp is the starting model's log-prob of each response token (recomputed here with HF)
    for s in learner.batches[-1]:
        want = base.logprobs([s["tokens"]])[0][s["prompt_len"] - 1:]
        assert torch.allclose(torch.tensor(s["ref_logp"]), want, atol=1e-4)
        assert len(s["old_logp"]) == len(s["rollout_logp"]) == len(s["tokens"]) - s["prompt_len"]
    for batch in learner.batches:
        assert len(batch) % 4 == 0
        for g in range(0, len(batch), 4):
            group = batch[g:g + 4]
            assert len({tuple(s["tokens"][:s["prompt_len"]]) for s in group}) == 1
            advs = [s["advantage"] for s in group]
            assert max(advs) - min(advs) > 1e-6
            assert abs(sum(advs)) < 1e-6  # GRPO advantages are centred within a group

    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[2] and "eval/accuracy" not in rows[1]
    assert all("reward" in r and "time/generate" in r for r in rows[1:])
    assert any("kl" in r and "train/kl" in r for r in rows[1:])
    assert lines[-1].startswith("step 4/4 | reward")
    from megapo.trainer.plot import plot_run

    counts = plot_run(tmp_path / "run", tmp_path / "curves.png")
    assert counts == {"reward": 4, "response_len": 4, "kl": 4, "eval/accuracy": 3}  # eval at steps 0, 2, 4


def test_resume_continues_the_prompt_order(tmp_path, tiny_dense, reward_module):
    from megapo.trainer import checkpoint as ckpt
    from megapo.trainer.loop import train

    # without dynamic sampling every step takes exactly prompts_per_step prompts, whatever the samples
    fixed = {"data.dynamic_sampling": False, "rollout.weight_sync": "disk",  # and the disk transport
             "train.log_samples": True}
    full_engine = RecordingEngine(tiny_dense)
    train(_cfg(tiny_dense, tmp_path / "full", reward_module, **fixed), learner=HFLearner(tiny_dense), engine=full_engine,
          print_fn=lambda s: None)

    part = tmp_path / "part"
    first = RecordingEngine(tiny_dense)
    train(_cfg(tiny_dense, part, reward_module, **{"train.steps": 2}, **fixed), learner=HFLearner(tiny_dense), engine=first,
          print_fn=lambda s: None)
    assert ckpt.latest_checkpoint(part / "checkpoints").name == "step_00000002"
    second = RecordingEngine(tiny_dense)
    resumed_learner = HFLearner(tiny_dense)
    train(_cfg(tiny_dense, part, reward_module, **fixed), resume=True, learner=resumed_learner, engine=second,
          print_fn=lambda s: None)
    assert second.inner.weight_version == 4
    assert any((part / "weights_sync").iterdir())  # the disk transport wrote the synced weights
    # eval prompts are the fixed test split; compare only the training prompts (8 tokens, not in the test split)
    from megapo.tasks import addition

    test_prompts = {e.prompt for e in addition.examples("test", 20)}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dense)

    def train_prompts(engine):
        return [p for p in engine.prompts if tok.decode(p) not in test_prompts]

    assert len(train_prompts(full_engine)) == 4 * 4
    assert train_prompts(first) + train_prompts(second) == train_prompts(full_engine)
    rows = [json.loads(l) for l in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    # samples.jsonl: the stopped-and-resumed run trained the same (step, prompt, sample) and tokens as the full one
    dump = lambda run: [json.loads(l) for l in (run / "samples.jsonl").read_text().splitlines()]
    key = lambda r: (r["step"], r["prompt_id"], r["sample"], tuple(r["response_ids"]), r["reward"])
    assert [key(r) for r in dump(part)] == [key(r) for r in dump(tmp_path / "full")]
    assert sorted({r["step"] for r in dump(part)}) == [1, 2, 3, 4] and len(dump(part)) == 4 * 4 * 4
    trained = [s["tokens"] for s in resumed_learner.batches[-1]]  # the last step's batch, in order
    assert [r["prompt_ids"] + r["response_ids"] for r in dump(part) if r["step"] == 4] == trained
    assert all(r["response"] == tok.decode(r["response_ids"], skip_special_tokens=True) for r in dump(part))


def test_group_filter_trains_whole_ragged_groups(tmp_path, tiny_dense, reward_module):
    """gfpo with a k per difficulty bucket: groups of 2 and 3 of the 4 drawn; mini-batches cut between whole
    groups, GRPO advantages centred within each kept group, samples.jsonl naming the kept sample indices."""
    from megapo.trainer.loop import train

    cfg = _cfg(tiny_dense, tmp_path / "run", reward_module, **{
        "train.mini_batches": 2, "data.dynamic_sampling": False, "train.log_samples": True, "train.steps": 2,
        "train.eval_every": 0, "data.group_filter": "gfpo", "data.group_filter_options": {"adaptive_keep": [2, 3]}})
    learner = HFLearner(tiny_dense)
    train(cfg, learner=learner, engine=RecordingEngine(tiny_dense), print_fn=lambda s: None)
    rows = [json.loads(l) for l in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    for step, batches in ((1, learner.batches[:2]), (2, learner.batches[2:])):
        mine = [r for r in rows if r["step"] == step]
        groups = {}
        for r in mine:
            groups.setdefault(r["prompt_id"], []).append(r)
        assert len(groups) == 4 and all(len(g) in (2, 3) for g in groups.values())
        for g in groups.values():  # kept samples in draw order, distinct indices among the 4 drawn
            assert [r["sample"] for r in g] == sorted({r["sample"] for r in g}) and g[-1]["sample"] < 4
        flat = [s for b in batches for s in b]
        assert [s["tokens"] for s in flat] == [r["prompt_ids"] + r["response_ids"] for r in mine]
        at = 0
        for b in batches:  # each mini-batch ends where a group ends
            at += len(b)
            ends = [sum(len(g) for g in list(groups.values())[:i + 1]) for i in range(len(groups))]
            assert at in ends
        for g in groups.values():
            advs = [s["advantage"] for s in flat if s["tokens"][:len(g[0]["prompt_ids"])] == g[0]["prompt_ids"]][:len(g)]
            assert abs(sum(advs)) < 1e-6
