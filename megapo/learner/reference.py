"""π_ref, the frozen starting policy of the KL terms (algorithm.kl_coef > 0), in one of two forms
(algorithm.reference; RunConfig.reference resolves auto):

- megatron: a second Megatron model under the learner's layout (TP/PP/EP/DP, the same process groups),
  loaded from the learner's HF folder and frozen: no DDP wrapper, no gradients, no optimizer state, the
  learner's dtype (float32). Its log-probs use the learner's packing and, under routing replay (r2/r3),
  replay each sample's routes (sample.routes, what the old-log-prob pass used and the train steps
  replay), so π_ref and π_θ are compared under the same routing. Collective: every rank calls it and
  gets every sample's log-probs. Each rank holds only its shard, so it fits wherever the learner does.
- plain: megapo's PyTorch model (the embedded engine's) on rank 0, routing freely; the other ranks get
  its log-probs by broadcast. One full copy on one process: for single-process CPU runs of small models.

    ref = MegatronReference(model_dir, parallel, micro_batch_tokens=4096, routing_replay=True)
    ref_logps = ref.response_logprobs(batch)      # one list per sample, its response tokens
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from megapo.algorithms.sample import TrainSample, as_train_samples
from megapo.config import ParallelConfig
from megapo.learner.precision import Precision

REFERENCES = ("auto", "megatron", "plain")


@runtime_checkable
class Reference(Protocol):
    """What the trainer calls on π_ref (megapo.trainer.update.reference_logprobs, Run.close); MegatronReference
    and PlainReference both are one, and so is any other policy with these members (docs/CONTRACTS.md)."""

    # True: every rank calls response_logprobs (collective); False: rank 0 only, the trainer broadcasts the result
    collective: bool

    def response_logprobs(self, batch: list[TrainSample]) -> list[list[float]]:
        """π_ref's log-prob of every response token of each sample (sample.tokens[sample.prompt_len:])."""
        ...

    def close(self) -> None:
        """Free what it holds (hooks, models); the run calls it once, at its end."""
        ...


@contextmanager
def _rng_kept():
    """Building a model draws initial values from torch's and Megatron's generators; put them back, so a run
    samples the same with and without a reference built in its middle."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = tracker.get_states()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield
    tracker.set_states(states)


class MegatronReference:
    collective = True  # every rank calls response_logprobs

    def __init__(self, model_dir, parallel: ParallelConfig, *, micro_batch_tokens: int = 4096, row_tokens: int = 0,
                 routing_replay: bool = False, seed: int = 0, precision: Precision = Precision(),
                 share_prefix: str = "auto"):
        from megapo.learner.learner import Learner

        with _rng_kept():
            self.model = Learner(model_dir, parallel, seed=seed, micro_batch_tokens=micro_batch_tokens,
                                 row_tokens=row_tokens, routing_replay=routing_replay, frozen=True,
                                 precision=precision, share_prefix=share_prefix)

    def response_logprobs(self, batch: list[TrainSample]) -> list[list[float]]:
        """π_ref's log-prob of every response token of each sample (collective), replaying sample.routes
        where the model replays routes and a sample has them."""
        batch = as_train_samples(batch)
        sequences = [list(s.tokens) for s in batch]
        hook = self.model.route_hook
        routes = [s.routes for s in batch] if hook is not None else None
        if routes is not None and all(r is None for r in routes):
            routes = None  # (r2 on-policy: no pass has recorded routes yet; the train forward routes freely too)
        logps = self.model.logprobs(sequences, routes=routes, prompt_lens=[s.prompt_len for s in batch])
        if hook is not None:
            hook.take_counts()  # (collective) its counts would otherwise pile up
        return [lp[s.prompt_len - 1:].tolist() for lp, s in zip(logps, batch)]

    def response_topk(self, batch: list[TrainSample], k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sample, at each response token, this model's k most likely token ids and their log-probs over the
        whole vocabulary ([response tokens, k] int64 and fp32; vocabulary-parallel, Learner.response_topk),
        replaying sample.routes as response_logprobs does (collective). A top-k distillation teacher's values."""
        batch = as_train_samples(batch)
        hook = self.model.route_hook
        routes = [s.routes for s in batch] if hook is not None else None
        if routes is not None and all(r is None for r in routes):
            routes = None
        out = self.model.response_topk([list(s.tokens) for s in batch], [s.prompt_len for s in batch], k,
                                       routes=routes)
        if hook is not None:
            hook.take_counts()
        return out

    def close(self) -> None:
        if self.model.route_hook is not None:
            self.model.route_hook.close()


class PlainReference:
    collective = False  # rank 0 only

    def __init__(self, model_dir: Path, precision: Precision = Precision()):
        from megapo.engines.torch_lm import TorchCausalLM

        self.model = TorchCausalLM.from_pretrained(model_dir, precision.dtype)  # in the policy's precision

    def response_logprobs(self, batch: list[TrainSample]) -> list[list[float]]:
        batch = as_train_samples(batch)
        by_len: dict[int, list[int]] = {}
        for i, s in enumerate(batch):
            by_len.setdefault(len(s.tokens), []).append(i)
        out: list[list[float]] = [[] for _ in batch]
        for idx in by_len.values():  # rows of one length form one unpadded batch
            ids = torch.tensor([batch[i].tokens for i in idx])
            logp = torch.log_softmax(self.model.logits(ids)[:, :-1].float(), -1).gather(2, ids[:, 1:, None])[..., 0]
            for row, i in enumerate(idx):
                out[i] = logp[row, batch[i].prompt_len - 1:].tolist()
        return out

    def close(self) -> None:
        pass
