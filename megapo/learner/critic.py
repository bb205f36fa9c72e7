"""The critic of PPO / GAE: a trainable value model under the learner's layout, with its own optimizer, scheduler and
checkpoint.

    critic = Critic("policy/", ParallelConfig(tp=2, ep=2), OptimConfig(lr=1e-5), routing_replay=True)
    values = critic.values(samples)                                  # [V_t] per sample, on every rank (fp32, CPU)
    metrics = critic.train_step(samples, returns, old_values, clip=0.2)   # one step on the clipped value loss
    critic.save("ckpt/critic"); critic.load("ckpt/critic")

It is a ScoreModel (megapo/learner/score.py: the Megatron learner with a one-output head on the final hidden states)
read at every response position: V_t is the head at the position before response token t is generated
(prompt_len - 1 .. len - 2), the positions the policy's log-probs come from. Built from a *ForSequenceClassification
folder (its score head) or from a causal-LM folder of a registered family (the policy's checkpoint, as verl and
OpenRLHF start the critic; the value head at zeros). With routing replay it replays each sample's `routes`, as the
policy learner does: a critic sharing the policy's architecture routes as the policy did.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from megapo.algorithms.gae import clipped_value_loss
from megapo.algorithms.sample import TrainSample, as_train_samples
from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.precision import Precision
from megapo.learner.score import ScoreModel, head_source

FIELD = "algorithm.critic.path"


class Critic:
    def __init__(self, model_dir, parallel: ParallelConfig, optim: OptimConfig | None = None, *, seed: int = 0,
                 micro_batch_tokens: int = 4096, row_tokens: int = 0, total_steps: int | None = None,
                 routing_replay: bool = False, precision: Precision = Precision(), field: str = FIELD):
        """`field`: what errors about the folder name (the config key the path came from)."""
        from megapo.layout import read_hf_config
        from megapo.learner.model import layout_initialized

        head = head_source(read_hf_config(model_dir, field), field, model_dir)
        # built beside a policy learner, the critic shares its process groups and must leave them to it
        self._own_groups = not layout_initialized(parallel)
        self.model = ScoreModel(model_dir, parallel, optim, seed=seed, micro_batch_tokens=micro_batch_tokens,
                                row_tokens=row_tokens, total_steps=total_steps, frozen=False, precision=precision,
                                head=head, routing_replay=routing_replay, field=field)
        self.learner = self.model.learner
        if torch.distributed.get_rank() == 0:
            print(f"critic: {model_dir}: " + ("the value head is its score head" if head == "score" else
                  "a causal LM: its body, the value head starting at zeros (its LM head left out)"), flush=True)

    @property
    def module(self):
        return self.learner.module

    @property
    def step(self) -> int:
        return self.learner.step

    def values(self, batch: list[TrainSample]) -> list[torch.Tensor]:
        """V at each response token of every sample ([len - prompt_len] fp32, CPU), on every rank (collective)."""
        learner = self.learner
        batch = as_train_samples(batch)
        lengths, prompt_lens = _check_batch(batch, learner.spec.vocab_size)
        micro_batches = self._micro_batches(batch, lengths, prompt_lens)

        def collect(mb, out: torch.Tensor):
            if not mb.order:
                return out.new_zeros(()), {"value": None}
            return out.new_zeros(()), {"value": out.detach().reshape(-1).float(), "order": mb.order,
                                       "sizes": mb.sizes}

        learner.model.eval()
        with torch.no_grad():
            stored = learner._run(micro_batches, collect, forward_only=True)
        learner.model.train()
        if learner.route_hook is not None:
            learner.route_hook.take_counts()  # (collective) else they would pile into the next step's metrics
        pieces = [(d["order"], d["value"], d["sizes"]) for d in stored if d["value"] is not None]
        return learner._per_sequence(pieces, len(batch))

    def backward(self, batch: list[TrainSample], returns, old_values, clip: float = 0.2) -> dict:
        """The clipped value loss of `batch` (megapo.algorithms.gae.clipped_value_loss: the token mean over all
        response tokens of the batch) and its gradient in the model's gradient buffers. `returns`, `old_values`:
        one value per response token of each sample. Each micro-batch's loss is its tokens' mean times its share of
        the batch's tokens, so the sum is the batch's mean whatever the micro-batch / DP split. Metrics of the
        values before the step (collective)."""
        from megatron.core import parallel_state as ps

        learner = self.learner
        batch = as_train_samples(batch)
        lengths, prompt_lens = _check_batch(batch, learner.spec.vocab_size)
        response = lengths - prompt_lens
        target = _column(returns, response, "returns", learner.device)
        old = _column(old_values, response, "old_values", learner.device)
        global_tokens = int(response.sum())
        micro_batches = self._micro_batches(batch, lengths, prompt_lens, columns_start=np.cumsum(response) - response)
        scale = len(micro_batches) * ps.get_data_parallel_world_size()  # undo the schedule's /M and DDP's /dp

        def loss_func(mb, out: torch.Tensor):
            if not mb.order:  # an empty micro-batch (DP balancing): keep the graph connected
                return out.sum() * 0.0, {"stats": None}
            v = learner._padded(mb, out.reshape(-1).float())
            r, o = learner._padded(mb, target[mb.columns]), learner._padded(mb, old[mb.columns])
            loss = clipped_value_loss(v, o, r, mb.mask, clip) * (mb.num_tokens / global_tokens)
            stats = torch.stack([loss.detach(), v.detach()[mb.mask].sum(), _clipped(v.detach(), o, r, clip)[mb.mask]
                                 .sum(), r[mb.mask].sum()])
            return loss * scale, {"stats": stats}

        learner.model.train()
        learner.model.zero_grad_buffer()
        learner.optimizer.zero_grad()
        stored = learner._run(micro_batches, loss_func, forward_only=False)
        mine = [d["stats"] for d in stored if d["stats"] is not None]
        local = [torch.stack(mine).double().sum(0).tolist()] if mine else []
        loss, value_sum, clipped, return_sum = np.sum(learner._share_results(local), axis=0)
        metrics = {"loss": float(loss), "values_mean": float(value_sum) / global_tokens,
                   "returns_mean": float(return_sum) / global_tokens, "clip_frac": float(clipped) / global_tokens,
                   "tokens": global_tokens}
        if learner.route_hook is not None:  # routing replay: disagreement / fallback metrics (collective)
            from megapo.replay.hook import fractions

            metrics.update(fractions(learner.route_hook.take_counts()))
        return metrics

    def train_step(self, batch: list[TrainSample], returns, old_values, clip: float = 0.2) -> dict:
        """One optimizer step on the clipped value loss (backward, then the learner's guarded step): metrics."""
        start = time.perf_counter()
        metrics = self.backward(batch, returns, old_values, clip)
        metrics.update(self.learner._optimizer_step(math.isfinite(metrics["loss"])))
        metrics["step_time_s"] = time.perf_counter() - start
        return metrics

    def _micro_batches(self, batch: list[TrainSample], lengths: np.ndarray, prompt_lens: np.ndarray,
                       columns_start: np.ndarray | None = None):
        """This rank's micro-batches selecting positions prompt_len - 1 .. len - 2 of every sample; the routes
        handed to the replay hook when there is one (else ignored: the critic routes freely)."""
        learner = self.learner
        sequences = [s.tokens for s in batch]
        routes = None
        if learner.route_hook is not None:
            routes = [s.routes for s in batch]
            if all(r is None for r in routes):
                routes = None
            learner.route_hook.set_routes(routes, sequences, name="batch")
        return learner._micro_batches(sequences, prompt_lens - 1, lengths - 1, columns_start,
                                      prompt_lens=prompt_lens, routes=routes)

    def hf_state_dict(self):
        """Full HF-named tensors, the value head as score.weight (collective)."""
        return self.learner.hf_state_dict()

    def save(self, ckpt_dir) -> None:
        """Weights, optimizer and scheduler (the learner's dist_checkpointing; collective)."""
        self.learner.save(ckpt_dir)

    def load(self, ckpt_dir) -> None:
        """Resume from `save`: weights, optimizer, scheduler and step count (collective)."""
        self.learner.load(ckpt_dir)

    def close(self) -> None:
        """Its route hook removed; the process groups destroyed only if this critic made them."""
        if self.learner.route_hook is not None:
            self.learner.route_hook.close()
        if self._own_groups:
            self.learner.close()


def _clipped(values: torch.Tensor, old: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """Where the clipped term of the value loss is the larger one (PPO's value clip fraction), as 0 / 1."""
    if clip <= 0:
        return torch.zeros_like(values)
    clipped = (old + (values - old).clamp(-clip, clip) - returns) ** 2
    return (clipped > (values - returns) ** 2).to(values.dtype)


def _check_batch(batch: list[TrainSample], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, prompt_lens) after checking each sample's tokens and prompt_len (ValueError naming them)."""
    if not batch:
        raise ValueError("batch: empty")
    for i, s in enumerate(batch):
        if s.tokens is None or s.prompt_len is None:
            raise ValueError(f"batch[{i}].{'tokens' if s.tokens is None else 'prompt_len'}: missing")
        if not 1 <= s.prompt_len < len(s.tokens):
            raise ValueError(f"batch[{i}].prompt_len: must be in [1, {len(s.tokens) - 1}] for {len(s.tokens)} "
                             f"tokens, got {s.prompt_len}")
        if min(s.tokens) < 0 or max(s.tokens) >= vocab:
            raise ValueError(f"batch[{i}].tokens: ids must be in [0, {vocab})")
    lengths = np.fromiter((len(s.tokens) for s in batch), dtype=np.int64, count=len(batch))
    return lengths, np.fromiter((s.prompt_len for s in batch), dtype=np.int64, count=len(batch))


def _column(values, response: np.ndarray, name: str, device) -> torch.Tensor:
    """One fp32 value per response token of every sample, end to end (ValueError naming the entry)."""
    if values is None or len(values) != len(response):
        got = "none" if values is None else len(values)
        raise ValueError(f"{name}: expected one entry per sample ({len(response)}), got {got}")
    parts = []
    for i, (v, n) in enumerate(zip(values, response)):
        arr = torch.as_tensor(v, dtype=torch.float32).reshape(-1)
        if arr.numel() != n:
            raise ValueError(f"{name}[{i}]: expected {n} values (one per response token), got {arr.numel()}")
        if not torch.isfinite(arr).all():
            raise ValueError(f"{name}[{i}]: holds a non-finite value")
        parts.append(arr)
    return torch.cat(parts).to(device)
