"""What the trainer may call on a learner (docs/CONTRACTS.md "## Learner"), beside the KL reference's protocol
(megapo.learner.reference.Reference) and the environments' (megapo.envs.base.Environment).

megapo.learner.learner.Learner (the Megatron one) is both a `Learner` and an `OnPolicyLearner`; a stand-in (tests,
a plain PyTorch learner) is one when it has these members. The trainer types its `learner` parameters with
`Learner` and asks `isinstance(learner, OnPolicyLearner)` whether the train forward can also be the old-log-prob
pass (megapo.trainer.update.on_policy), so that capability is declared here, not guessed from attribute names.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor, nn

    from megapo.algorithms.spec import LossSpec
    from megapo.algorithms.sample import TrainSample
    from megapo.models.family import Family, ModelSpec
    from megapo.replay.hook import RouteReplayHook


@runtime_checkable
class Learner(Protocol):
    """The policy being trained: one per process, every rank calls every method collectively."""

    route_hook: RouteReplayHook | None  # routing replay's hook (megapo/replay/hook.py) when built to replay routes
    module: nn.Module  # the model, its family's rename rules and architecture: what weights.gather exports
    family: Family
    spec: ModelSpec

    def logprobs(self, sequences: list[list[int]], routes: Any = None, with_entropy: bool = False,
                 prompt_lens: Any = None) -> Any:
        """Per-token log-probs of each whole sequence (and with_entropy their entropies), on every rank;
        `prompt_lens`: samples of one prompt may hold it once in the micro-batches (train.share_prefix)."""
        ...

    def response_sum_p2(self, sequences: list[list[int]], prompt_lens: list[int], routes: Any = None) -> list[Tensor]:
        """Σ_v p(v)² of the next-token distribution at each response token, on every rank (OTB's stage)."""
        ...

    def response_logp_at(self, sequences: list[list[int]], prompt_lens: list[int], ids: list[int],
                         routes: Any = None) -> list[Tensor]:
        """log p(v) for the given token ids at each response token, on every rank (the stage thr)."""
        ...

    def response_hidden(self, sequences: list[list[int]], prompt_lens: list[int], routes: Any = None) -> list[Tensor]:
        """The LM head's input [tokens, hidden] at each response token, on every rank (the stage delta)."""
        ...

    def response_hidden_logp_at(self, sequences: list[list[int]], prompt_lens: list[int], ids: list[int],
                                routes: Any = None) -> tuple[list[Tensor], list[Tensor]]:
        """(response_hidden, response_logp_at) from one forward, on every rank (the stage thr)."""
        ...

    def response_js_distance(self, sequences: list[list[int]], prompt_lens: list[int],
                             context_sequences: list[list[int]], context_prompt_lens: list[int],
                             routes: Any = None) -> list[Tensor]:
        """The Jensen-Shannon distance between the next-token distributions of each sequence and its context
        sequence (the same response behind x ⊕ c) at each response token, on every rank (the stage mrtpo)."""
        ...

    def response_js_distances(self, sequences: list[list[int]], prompt_lens: list[int],
                              contexts: list[list[list[int]]], context_prompt_lens: list[list[int]],
                              routes: Any = None) -> list[Tensor]:
        """Per sequence [K, tokens]: response_js_distance against each of K context lists, each sequence forwarded
        once beside its K context sequences (fewer passes than K), on every rank (the stage mrtpo)."""
        ...

    def response_attention_entropy(self, sequences: list[list[int]], prompt_lens: list[int], layer: int = -1,
                                   routes: Any = None) -> list[Tensor]:
        """The entropy of one layer's head-averaged attention at each response token, on every rank (the stage
        attention_entropy)."""
        ...

    def response_tempered_logp(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float,
                               routes: Any = None) -> list[Tensor]:
        """log softmax(z/T) of each response token, on every rank (the stage distribution_centric)."""
        ...

    def train_step(self, batch: list[TrainSample], loss: LossSpec) -> dict:
        """One optimizer step on `batch` under `loss`; whole-batch metrics on every rank."""
        ...

    def hf_state_dict(self) -> Iterator[tuple[str, Tensor]]:
        """Full HF-named tensors, gathered over TP/EP/PP."""
        ...

    def stage_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """This pipeline stage's HF-named tensors (what a per-stage weight transport sends)."""
        ...

    def sync_stage(self) -> tuple[int, int, bool]:
        """(this rank's pipeline stage, number of stages, whether it is its stage's root in a weight sync)."""
        ...

    def save(self, ckpt_dir: str | Path) -> None:
        ...

    def load(self, ckpt_dir: str | Path) -> None:
        ...


@runtime_checkable
class OnPolicyLearner(Protocol):
    """A learner whose train forward can be the old-log-prob pass too (π_old = that forward's detached
    log-probs): megapo.replay.modes.on_policy_step calls it when π_old is the policy being trained."""

    def train_step_on_policy(self, batch: list[TrainSample], loss: LossSpec, *, keep_logprobs: bool = False,
                             keep_entropy: bool = False) -> tuple[dict, dict]:
        """(train metrics, what the old-log-prob pass would have given: "metrics", and with keep_logprobs
        "logprobs", with keep_entropy "entropies")."""
        ...
