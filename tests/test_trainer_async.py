"""train.mode=async: rollouts for upcoming steps are generated in a background thread while the learner
trains, at most train.staleness weight versions behind.

Independent checks (the learner is test_trainer_loop's transformers stand-in, the engine the real
embedded engine):
- every trained sample's rollout log-probs equal the log-probs of the learner's weights *of the version
  the sample reports* (snapshots kept here after every update, recomputed with transformers) -- so the
  per-sample versions are right and no sample saw half-updated weights;
- staleness (updates done when it is trained - its version) is <= k, and > 0 for some samples;
- generate calls ran while the learner was inside train_step (wall-clock intervals recorded here);
- by default the objective's π_old is the engine's log-probs (old_policy=engine, no extra correction);
  with old_policy=learner TIS weights are applied; k=0 async trains on exactly the tokens sync mode does.
"""

import copy
import json
import sys
import threading
import time

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_trainer_loop import HFLearner, run_config  # noqa: E402  (the stand-in learner, defined once)


class SnapshotLearner(HFLearner):
    """Keeps the weights of every version and the wall-clock intervals of its updates (from the
    old-log-prob pass to the end of train_step)."""

    def __init__(self, model_dir, train_sleep=0.0):
        super().__init__(model_dir, lr=1e-2)
        self.snapshots = {0: copy.deepcopy(self.model.state_dict())}
        self.train_intervals: list[tuple[float, float]] = []
        self.updates_at_train: list[int] = []
        self.losses: list = []  # the LossSpec of each train_step
        self.train_sleep = train_sleep
        self._busy_since: float | None = None

    def logprobs(self, sequences, routes=None, with_entropy=False, prompt_lens=None):
        if self._busy_since is None:
            self._busy_since = time.perf_counter()
        out = super().logprobs(sequences, routes, with_entropy)
        time.sleep(self.train_sleep)  # a slower learner, so that generation has time to overlap
        return out

    def train_step(self, batch, loss):
        t0 = self._busy_since if self._busy_since is not None else time.perf_counter()
        self._busy_since = None
        self.updates_at_train.append(len(self.snapshots) - 1)
        self.losses.append(loss)
        out = super().train_step(batch, loss)
        time.sleep(self.train_sleep)  # a slower learner, so that generation has time to overlap
        self.snapshots[len(self.snapshots)] = copy.deepcopy(self.model.state_dict())
        self.train_intervals.append((t0, time.perf_counter()))
        return out


class TimedEngine:
    """The embedded engine, recording each generate call's interval and the versions it returned."""

    def __init__(self, model_dir):
        from megapo.engines.embedded import EmbeddedEngine

        self.inner = EmbeddedEngine(model_dir, seed=0)
        self.intervals: list[tuple[float, float]] = []
        self.version_of: dict[tuple, int] = {}  # prompt+output tokens -> weight version reported
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def generate(self, prompts, params):
        t0 = time.perf_counter()
        out = self.inner.generate(prompts, params)
        with self._lock:
            self.intervals.append((t0, time.perf_counter()))
            self.threads.add(threading.current_thread().name)
            for group in out:
                for s in group:
                    self.version_of[tuple(s.prompt_ids + s.output_ids)] = s.weight_version
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _cfg(model, out, reward, **over):
    items = {
        "model.path": str(model), "algorithm.routing_replay": "off", "algorithm.objective": "ppo",
        "rollout.n_samples": 4, "rollout.max_new_tokens": 6, "data.task": "addition", "data.reward": reward,
        "data.truncated_reward": None,
        "data.prompts_per_step": 4, "data.max_prompt_tokens": 16, "data.dynamic_sampling": False,
        "train.steps": 6, "train.eval_every": 0, "train.ckpt_every": 0, "train.output_dir": str(out),
        "train.log": ["jsonl"], "train.mode": "async", "train.staleness": 2,
    }
    items.update(over)
    return run_config(items)


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _logp(model, state, tokens, prompt_len):
    model.load_state_dict(state)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return lp[prompt_len - 1:]


def test_async_k2_versions_staleness_overlap(tmp_path, tiny_dense, reward_module):
    from transformers import AutoModelForCausalLM

    from megapo.trainer.loop import train

    k = 2
    cfg = _cfg(tiny_dense, tmp_path / "run", reward_module, **{"train.staleness": k})
    learner, engine = SnapshotLearner(tiny_dense, train_sleep=0.3), TimedEngine(tiny_dense)
    train(cfg, learner=learner, engine=engine, print_fn=lambda *_: None)

    assert len(learner.batches) == 6 and engine.inner.weight_version == 6
    assert engine.threads == {"megapo-rollouts"}  # generation ran in the background thread
    # the async default: the objective's π_old is the engine's log-probs of the sampling weights (its clip is
    # the staleness correction), so no extra correction weights
    assert all(spec.correction is None for spec in learner.losses)
    assert all(s["old_logp"] == s["rollout_logp"] for b in learner.batches for s in b)

    # every trained sample: its version is <= k behind the learner, and its rollout log-probs are those of
    # that version's weights (recomputed with transformers from the snapshot)
    check = AutoModelForCausalLM.from_pretrained(tiny_dense, dtype=torch.float32)
    stale = []
    for updates, batch in zip(learner.updates_at_train, learner.batches):
        for s in batch:
            v = engine.version_of[tuple(s["tokens"])]
            stale.append(updates - v)
            want = _logp(check, learner.snapshots[v], s["tokens"], s["prompt_len"])
            assert torch.allclose(torch.tensor(s["rollout_logp"]), want, atol=1e-4), (updates, v)
    assert max(stale) <= k and min(stale) >= 0
    assert max(stale) >= 1  # really asynchronous: some samples came from older weights

    # overlap: some generate call ran while the learner was updating (old log-probs .. train_step)
    overlap = sum(max(0.0, min(g1, t1) - max(g0, t0)) for g0, g1 in engine.intervals
                  for t0, t1 in learner.train_intervals)
    assert overlap > 0.0

    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r, s_max in zip(rows, [max(updates - engine.version_of[tuple(s["tokens"])] for s in batch)
                                for updates, batch in zip(learner.updates_at_train, learner.batches)]):
        assert r["async/staleness_max"] == s_max
        assert r["async/dropped_groups"] == 0
        assert "time/generate_wait" in r and "time/generate" not in r
    # the learner waited less for rollouts than the producer spent making them (steps 2..: made ahead)
    assert sum(r["time/generate_wait"] for r in rows[1:]) < sum(r["async/generate_s"] for r in rows[1:])


def test_async_k0_trains_on_what_sync_does(tmp_path, tiny_dense, reward_module):
    """Stability: with staleness 0 the background thread changes nothing -- the same prompts, samples and
    weights as sync mode -- and the k=2 run's losses stay finite."""
    from megapo.trainer.loop import train

    runs = {}
    for mode in ("sync", "async"):
        cfg = _cfg(tiny_dense, tmp_path / mode, reward_module, **{
            "train.mode": mode, "train.staleness": 0, "train.async_correction": "none", "train.steps": 4,
            "algorithm.old_policy": "learner"})  # the same objective in both modes
        learner = SnapshotLearner(tiny_dense)
        train(cfg, learner=learner, engine=TimedEngine(tiny_dense), print_fn=lambda *_: None)
        runs[mode] = learner
    sync, asyn = runs["sync"], runs["async"]
    assert [[s["tokens"] for s in b] for b in sync.batches] == [[s["tokens"] for s in b] for b in asyn.batches]
    assert sync.updates_at_train == asyn.updates_at_train == [0, 1, 2, 3]
    for name, p in sync.model.state_dict().items():
        assert torch.allclose(p, asyn.model.state_dict()[name], atol=1e-5), name
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in _rows(tmp_path / "async"))


def _prompts(batches):
    return [sorted({tuple(s["tokens"][:s["prompt_len"]]) for s in b}) for b in batches]


def test_async_stop_and_resume_trains_every_prompt_once(tmp_path, tiny_dense, reward_module):
    """Batches made ahead (up to k) have drawn their prompts but were never trained: a run stopped after
    step 2 and resumed must train the same prompts at steps 3.. as a run never stopped (none skipped,
    none repeated), i.e. the checkpoint keeps the cursor after the last *trained* batch."""
    from megapo.trainer.loop import train
    from megapo.trainer.stop import StopFlag, TrainingStopped

    reference = SnapshotLearner(tiny_dense)
    train(_cfg(tiny_dense, tmp_path / "ref", reward_module), learner=reference, engine=TimedEngine(tiny_dense),
          print_fn=lambda *_: None)

    class StopAfter(SnapshotLearner):
        def __init__(self, model_dir, flag, after):
            super().__init__(model_dir, train_sleep=0.2)  # slow learner: the producer runs k batches ahead
            self.flag, self.after = flag, after

        def train_step(self, *a, **kw):
            out = super().train_step(*a, **kw)
            if len(self.batches) == self.after:
                self.flag.requested = True
            return out

    flag = StopFlag()
    first, first_engine = StopAfter(tiny_dense, flag, after=2), TimedEngine(tiny_dense)
    cfg = _cfg(tiny_dense, tmp_path / "run", reward_module, **{"train.ckpt_every": 1})
    with pytest.raises(TrainingStopped):
        train(cfg, learner=first, engine=first_engine, print_fn=lambda *_: None, stop=flag)
    assert len(first.batches) == 2
    second = SnapshotLearner(tiny_dense)
    train(cfg, resume=True, learner=second, engine=TimedEngine(tiny_dense), print_fn=lambda *_: None)
    assert len(second.batches) == 4
    assert _prompts(first.batches + second.batches) == _prompts(reference.batches)
    # the producer really had drawn prompts ahead when the stop came (else this test shows nothing)
    assert len(first_engine.intervals) > 2


def test_old_policy_and_correction_defaults(tmp_path, tiny_dense, reward_module):
    """sync: π_old from the learner, no correction; async: π_old = the engine's log-probs, no correction;
    async with old_policy=learner: TIS weights π_old/μ (capped) on the stale samples."""

    sync = _cfg(tiny_dense, tmp_path, reward_module, **{"train.mode": "sync"})
    asyn = _cfg(tiny_dense, tmp_path, reward_module)
    learner_ratio = _cfg(tiny_dense, tmp_path, reward_module, **{"algorithm.old_policy": "learner"})
    assert (sync.old_policy(), asyn.old_policy(), learner_ratio.old_policy()) == ("learner", "engine", "learner")
    assert sync.loss_spec().correction is None and asyn.loss_spec().correction is None
    assert learner_ratio.loss_spec().correction == "tis"


def test_engine_old_policy_metrics_and_batch():
    """use_engine_logprobs: old_logp becomes the engine's; the learner-vs-engine k3 is measured before,
    checked against the formula mean(ρ - 1 - log ρ), ρ = π_learner/μ, written out here."""
    import math

    from megapo.trainer.update import use_engine_logprobs

    batch = [{"old_logp": [-1.0, -2.0], "rollout_logp": [-1.5, -1.0]},
             {"old_logp": [-0.1], "rollout_logp": [-0.3]}]
    log_rho = [0.5, -1.0, 0.2]
    want = sum(math.exp(x) - 1 - x for x in log_rho) / 3
    m = use_engine_logprobs(batch)
    assert m["old_policy/learner_vs_engine_k3"] == pytest.approx(want, rel=1e-9)
    assert m["old_policy/learner_vs_engine_max_abs_dlogp"] == pytest.approx(1.0)
    assert [s["old_logp"] for s in batch] == [[-1.5, -1.0], [-0.3]]


def _samples(out):
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def _same_metrics(a: dict, b: dict) -> list[str]:
    """Keys whose values differ by more than 1e-6 (timings excluded: wall clock)."""
    timing = lambda k: k == "time" or k.startswith("time/") or k == "async/generate_s" or "per_s" in k  # noqa: E731
    keys = {k for k in a.keys() | b.keys() if not timing(k)}
    return sorted(k for k in keys if k not in a or k not in b
                  or (a[k] != b[k] and not (isinstance(a[k], float) and abs(a[k] - b[k]) <= 1e-6)))


def test_async_checkpoint_keeps_the_batches_made_ahead(tmp_path, tiny_dense, reward_module):
    """A run with train.staleness 2 stopped (SIGTERM's path: the StopFlag) after step 3 and resumed trains the
    very samples an uninterrupted run trains: samples.jsonl equal row for row (step, prompt id, sample index,
    tokens, rewards, weight version), metrics within 1e-6. The batches made ahead are in the checkpoint, not
    drawn again; a resume with another staleness is refused naming the field."""
    from megapo.config import ConfigError
    from megapo.trainer.loop import train
    from megapo.trainer.rollout_store import load_batches
    from megapo.trainer.stop import StopFlag, TrainingStopped

    over = {"train.log_samples": True, "train.ckpt_every": 0}
    train(_cfg(tiny_dense, tmp_path / "ref", reward_module, **over), learner=SnapshotLearner(tiny_dense),
          print_fn=lambda *_: None)

    class StopAfter(SnapshotLearner):
        def train_step(self, *a, **kw):
            out = super().train_step(*a, **kw)
            if len(self.batches) == 3:
                flag.requested = True
            return out

    flag = StopFlag()
    cfg = _cfg(tiny_dense, tmp_path / "run", reward_module, **over)
    with pytest.raises(TrainingStopped):
        train(cfg, learner=StopAfter(tiny_dense), print_fn=lambda *_: None, stop=flag)
    saved = load_batches(tmp_path / "run" / "checkpoints" / "step_00000003")
    assert len(saved) == 3  # batches of steps 4, 5, 6: what the weights after step 3 allow with k = 2
    assert [s.weight_version for b in saved for g in b.groups for s in g.samples[:1]] == [1] * 4 + [2] * 4 + [3] * 4

    with pytest.raises(ConfigError) as err:
        train(_cfg(tiny_dense, tmp_path / "run", reward_module, **over, **{"train.staleness": 1}), resume=True,
              learner=SnapshotLearner(tiny_dense), print_fn=lambda *_: None)
    assert err.value.field == "train.staleness"
    resumed = SnapshotLearner(tiny_dense)
    train(cfg, resume=True, learner=resumed, print_fn=lambda *_: None)
    assert len(resumed.batches) == 3

    ref, got = _samples(tmp_path / "ref"), _samples(tmp_path / "run")
    assert len(ref) == 6 * 4 * 4 and [r["step"] for r in got] == [r["step"] for r in ref]
    assert got == ref
    ref_rows, got_rows = _rows(tmp_path / "ref"), _rows(tmp_path / "run")
    assert [r["step"] for r in got_rows] == list(range(1, 7))
    for a, b in zip(ref_rows, got_rows):
        assert _same_metrics(a, b) == [], (a["step"], _same_metrics(a, b))
