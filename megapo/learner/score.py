"""A reward model: a registered family's Megatron model under TP/PP/EP/DP with a one-label score head, loaded from an
HF *ForSequenceClassification folder (score.weight [1, hidden], no bias), scoring each sequence at its last token,
or (prefix_scores, for dense rewards) every prefix of it from the same one forward.

    rm = ScoreModel("rm/", ParallelConfig(tp=2, ep=2))              # frozen: scores only
    rm.scores([[1, 2, 3], [4, 5]])                                   # [r0, r1] on every rank (fp32)
    rm.prefix_scores([[1, 2, 3], [4, 5]], [1, 0])                    # [[s(1 2), s(1 2 3)], [s(4), s(4 5)]]
    rm = ScoreModel("rm/", parallel, OptimConfig(lr=1e-4), frozen=False)
    rm.train_pairs([(chosen_tokens, rejected_tokens), ...])          # one Bradley-Terry step

It is the Megatron learner (megapo.learner.learner.Learner, built frozen, so the same packing, process groups and
pipeline schedule) with the LM head swapped for the score head: GPTModel calls its output layer on the final
hidden states, so the head returns [s, b, 1] scores where the LM head returned logits. Which position counts is
transformers' rule: the last token that is not the config's pad_token_id (the last token of an unpadded sequence).
A value model (megapo/learner/critic.py) is the same model built with head="zeros" from a causal-LM folder (the
policy's own weights, its LM head left out, the head starting at zeros) and read at every response position.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from megapo.config import ConfigError, OptimConfig, ParallelConfig
from megapo.learner.learner import Learner
from megapo.learner.precision import Precision
from megapo.models.family import Family

HEAD = "output_layer"  # the GPTModel attribute the score head takes over
SCORE_SUFFIX = "ForSequenceClassification"
# where the head's weights come from: a *ForSequenceClassification folder's score tensor, or zeros (the body from a
# causal-LM folder, as verl / OpenRLHF start a critic from the policy)
HEAD_SOURCES = ("score", "zeros")
CAUSAL_SUFFIX = "ForCausalLM"


def head_source(hf: dict, field: str = "model", model_dir=None) -> str:
    """Where a score model's head starts: "score" for a *ForSequenceClassification folder, "zeros" for a *ForCausalLM
    one (a policy's body); ConfigError(field) for any other."""
    archs = [str(a) for a in hf.get("architectures") or []]
    if any(a.endswith(SCORE_SUFFIX) for a in archs):
        return "score"
    if any(a.endswith(CAUSAL_SUFFIX) for a in archs):
        return "zeros"
    raise ConfigError(field, f"{model_dir or 'the folder'}: config.json architectures {archs} has neither a "
                             f"*{SCORE_SUFFIX} (a score model) nor a *{CAUSAL_SUFFIX} (a policy to start one from)")


class ScoreHead(torch.nn.Module):
    """h · w at every position: [s, b, H] -> ([s, b, 1], None), called as GPTModel calls its output layer."""

    def __init__(self, hidden: int, dtype: torch.dtype, device, sequence_parallel: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            # every TP rank scores every position and so holds the whole gradient: backward only splits it
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight), None


def score_family(family: Family, field: str = "model") -> Family:
    """The family's rename rules with the score head in place of the LM head."""
    if family.score_rules is None:
        raise ConfigError(field, f"family {family.name!r} has no score head (Family.score_rules)")
    return dataclasses.replace(family, global_rules={**family.global_rules, **family.score_rules})


def check_score_folder(model_dir, hf: dict, family: Family, field: str = "model") -> None:
    """ConfigError(field) unless `model_dir` is a one-label sequence-classification checkpoint of `family`:
    config.json's architectures, its labels and the score tensors named."""
    from megapo.weights.hf_load import SafetensorsReader

    archs = hf.get("architectures") or []
    if not any(str(a).endswith(SCORE_SUFFIX) for a in archs):
        raise ConfigError(field, f"{model_dir}: config.json architectures {archs} has no *{SCORE_SUFFIX}: not a "
                          "reward model (make one with `megapo tiny-model --head score` or `megapo rm-train`)")
    labels = len(hf.get("id2label") or {"0": None})  # transformers writes num_labels as id2label
    if labels != 1:
        raise ConfigError(field, f"{model_dir}: config.json id2label has {labels} labels; a reward model has 1")
    try:
        reader = SafetensorsReader(model_dir)
    except FileNotFoundError as err:
        raise ConfigError(field, str(err).removeprefix("model: ")) from None
    for rule in score_family(family, field).score_rules.values():
        for name in rule.hf:
            if name not in reader.weight_map:
                raise ConfigError(field, f"{model_dir}: the checkpoint has no {name!r} (the score head)")
            if reader.shape(name) != [1, hf["hidden_size"]]:
                raise ConfigError(field, f"{model_dir}: {name} is {reader.shape(name)}, expected "
                                  f"[1, hidden_size={hf['hidden_size']}]")


def score_positions(sequences: list[list[int]], pad_id: int | None) -> np.ndarray:
    """Where each sequence is scored: its last token that is not `pad_id` (0 if all are; None: the last token),
    as transformers' *ForSequenceClassification picks it."""
    out = np.empty(len(sequences), dtype=np.int64)
    for i, s in enumerate(sequences):
        keep = [t for t, token in enumerate(s) if token != pad_id] if pad_id is not None else [len(s) - 1]
        out[i] = keep[-1] if keep else 0
    return out


def prefix_score_positions(sequence: list[int], pad_id: int | None, start: int) -> np.ndarray:
    """Where the prefix sequence[:p + 1] is scored, for p = start .. len - 1: its last token that is not `pad_id`
    (0 if none is; None: p itself), transformers' rule for that prefix alone (score_positions)."""
    if not 0 <= start < len(sequence):
        raise ValueError(f"start: {start} is outside the sequence's {len(sequence)} positions")
    at = np.arange(len(sequence), dtype=np.int64)
    if pad_id is not None:
        at = np.where(np.asarray(sequence) != pad_id, at, 0)  # a pad position counts as 0 (all pad so far: 0)
    return np.maximum.accumulate(at)[start:]  # the last non-pad position up to each p


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor):
    """Mean over pairs of −log σ(r_c − r_r), and its gradient with respect to each score:
    (loss, d loss / d r_c, d loss / d r_r)."""
    margin = chosen - rejected
    loss = torch.nn.functional.softplus(-margin).mean()
    weight = torch.sigmoid(-margin) / margin.numel()
    return loss, -weight, weight


class ScoreModel:
    def __init__(self, model_dir, parallel: ParallelConfig, optim: OptimConfig | None = None, *, seed: int = 0,
                 micro_batch_tokens: int = 4096, row_tokens: int = 0, total_steps: int | None = None,
                 frozen: bool = True, precision: Precision = Precision(), head: str = "score",
                 routing_replay: bool = False, field: str = "model"):
        """`frozen`: scores only (no DDP wrapper, gradients or optimizer), in the process groups a learner of the
        same layout made, or new ones. Else trainable: `train_pairs` takes Bradley-Terry steps. `head`: "score"
        loads a *ForSequenceClassification folder's head; "zeros" takes a causal-LM folder of a family with a score
        head, leaves its LM head out and starts the head at zeros. `routing_replay`: the learner's route hook
        (megapo/replay), for a model sharing the policy's architecture. `field`: what errors name."""
        from megapo.layout import read_hf_config

        if head not in HEAD_SOURCES:
            raise ValueError(f"head: must be one of {', '.join(HEAD_SOURCES)}, got {head!r}")
        hf = read_hf_config(model_dir, field)
        family = _family(hf, field)
        if head == "score":
            check_score_folder(model_dir, hf, family, field)
        self.pad_id = hf.get("pad_token_id")
        scored = score_family(family, field)  # (refused before anything is built)
        # built frozen without weights: the LM head is swapped before anything loads, the optimizer built after
        self.learner = Learner(model_dir, parallel, optim, seed=seed, micro_batch_tokens=micro_batch_tokens,
                               row_tokens=row_tokens, total_steps=total_steps, hf_weights=False, frozen=True,
                               precision=precision, routing_replay=routing_replay)
        learner = self.learner
        learner.family = scored
        # the score head is never the input embedding, whatever tie_word_embeddings says
        learner.spec = dataclasses.replace(learner.spec, tied_embeddings=False)
        _attach_head(learner.module, learner.config)
        _load_weights(learner, model_dir, with_head=head == "score")
        if frozen:
            learner.model.requires_grad_(False)  # (the new head too)
        else:
            _make_trainable(learner, total_steps)

    @property
    def module(self):
        return self.learner.module

    def scores(self, sequences: list[list[int]]) -> list[float]:
        """Each sequence's score (fp32), on every rank (collective)."""
        _check_tokens(sequences, self.learner.spec.vocab_size)
        at = score_positions(sequences, self.pad_id)
        return [float(t[0]) for t in self._head_outputs(sequences, at, at + 1)]

    def prefix_scores(self, sequences: list[list[int]], starts: list[int]) -> list[torch.Tensor]:
        """The score of every prefix sequences[i][:p + 1] for p = starts[i] .. len - 1 (fp32, CPU, [len - starts[i]]
        each), on every rank (collective), from ONE forward: the head is causal, so its output at position q is the
        score of the prefix ending at q, and a prefix is scored where transformers would score it alone (its last
        token that is not pad_token_id, prefix_score_positions)."""
        _check_tokens(sequences, self.learner.spec.vocab_size)
        picks = [prefix_score_positions(s, self.pad_id, start) for s, start in zip(sequences, starts)]
        lo = np.array([int(p[0]) for p in picks], dtype=np.int64)  # p is non-decreasing: its first is the lowest
        hi = np.array([int(p[-1]) + 1 for p in picks], dtype=np.int64)
        raw = self._head_outputs(sequences, lo, hi)
        return [r[torch.from_numpy(p - p[0])] for r, p in zip(raw, picks)]

    def _head_outputs(self, sequences: list[list[int]], lo: np.ndarray, hi: np.ndarray) -> list[torch.Tensor]:
        """The head's outputs at positions [lo[i], hi[i]) of each sequence (fp32, CPU), on every rank (collective:
        the last pipeline stage's, shared over PP and DP by the learner)."""
        learner = self.learner
        micro_batches = learner._micro_batches(sequences, lo, hi)

        def collect(mb, out: torch.Tensor):
            if not mb.order:
                return out.new_zeros(()), {"score": None}
            return out.new_zeros(()), {"score": out.detach().reshape(-1).float(), "order": mb.order,
                                       "sizes": mb.sizes}

        learner.model.eval()
        with torch.no_grad():
            stored = learner._run(micro_batches, collect, forward_only=True)
        learner.model.train()
        pieces = [(d["order"], d["score"], d["sizes"]) for d in stored if d["score"] is not None]
        return learner._per_sequence(pieces, len(sequences))

    def backward_pairs(self, pairs: list[tuple[list[int], list[int]]]) -> dict:
        """The Bradley-Terry loss of `pairs` (chosen, rejected) and its gradient in the model's gradient buffers.
        The pairs' members may land in different micro-batches and DP ranks, so the scores come first (a forward
        pass); the second pass backpropagates Σ_i (∂loss/∂r_i) r_i, whose gradient is the loss's."""
        from megatron.core import parallel_state as ps

        learner = self.learner
        if learner.optimizer is None:
            raise RuntimeError("backward_pairs: this score model is frozen")
        if not pairs:
            raise ValueError("pairs: empty")
        sequences = [c for c, _ in pairs] + [r for _, r in pairs]
        r = torch.tensor(self.scores(sequences), dtype=torch.float64)
        loss, d_chosen, d_rejected = bradley_terry(r[:len(pairs)], r[len(pairs):])
        weight = torch.cat([d_chosen, d_rejected]).to(torch.float32).to(learner.device)
        at = score_positions(sequences, self.pad_id)
        micro_batches = learner._micro_batches(sequences, at, at + 1)
        scale = len(micro_batches) * ps.get_data_parallel_world_size()  # undo the schedule's /M and DDP's /dp

        def surrogate(mb, out: torch.Tensor):
            if not mb.order:  # an empty micro-batch (DP balancing): keep the graph connected
                return out.sum() * 0.0, {}
            mine = out.reshape(-1).float()
            return (mine * weight[mb.order]).sum() * scale, {}

        learner.model.train()
        learner.model.zero_grad_buffer()
        learner.optimizer.zero_grad()
        learner._run(micro_batches, surrogate, forward_only=False)
        margin = r[:len(pairs)] - r[len(pairs):]
        return {"loss": float(loss), "accuracy": float((margin > 0).double().mean()),
                "margin": float(margin.mean())}

    def train_pairs(self, pairs: list[tuple[list[int], list[int]]]) -> dict:
        """One Bradley-Terry optimizer step on `pairs`; metrics of the scores before it (collective)."""
        metrics = self.backward_pairs(pairs)
        metrics.update(self.learner._optimizer_step(np.isfinite(metrics["loss"])))
        return metrics

    def hf_state_dict(self):
        """Full HF-named tensors, score.weight included (collective)."""
        return self.learner.hf_state_dict()

    def close(self) -> None:
        self.learner.close()


def _family(hf: dict, field: str) -> Family:
    from megapo.models.family import family_for

    try:
        return family_for(hf)
    except ConfigError as err:  # it names "model"; the caller's field is the folder's
        raise ConfigError(field, err.message) from None


def _load_weights(learner: Learner, model_dir, *, with_head: bool) -> None:
    """The folder's tensors into the model; without the head, every one but the head's (a causal-LM folder has an
    LM head, no score tensor): the head keeps its zeros."""
    from megapo.weights import hf_load

    module = learner.module
    if with_head or not module.post_process:
        hf_load.load_hf_weights(module, learner.family, learner.spec, model_dir)
        return
    head = getattr(module, HEAD)
    setattr(module, HEAD, torch.nn.Identity())  # no parameters: nothing is read for the head
    try:
        hf_load.load_hf_weights(module, learner.family, learner.spec, model_dir)
    finally:
        setattr(module, HEAD, head)


def _attach_head(module, config) -> None:
    """The last pipeline stage's LM head replaced by a score head; every stage stops tying the output layer to the
    embedding (else Megatron would all-reduce the head's gradient with the embedding's)."""
    module.share_embeddings_and_output_weights = False
    if not module.post_process:
        return
    norm = next(module.decoder.final_layernorm.parameters())  # the head computes in the model's dtype
    module.output_layer = ScoreHead(config.hidden_size, norm.dtype, norm.device, config.sequence_parallel)


def _make_trainable(learner: Learner, total_steps: int | None) -> None:
    """What a non-frozen Learner sets up, for the model with its score head: DDP, the optimizer, the guard."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from megapo.learner.guard import UpdateGuard

    model = learner.model
    model.requires_grad_(True)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=learner.parallel.distributed_optimizer)
    learner.model = DistributedDataParallel(config=learner.config, ddp_config=ddp_config, module=model)
    learner.frozen = False
    learner.config.finalize_model_grads_func = finalize_model_grads  # norm/router grads summed over TP
    learner.optimizer, learner.scheduler = learner._build_optimizer(total_steps)
    learner.config.grad_scale_func = learner.optimizer.scale_loss if learner.precision.params == "fp16" else None
    learner.guard = UpdateGuard(learner.model, learner.optimizer, keep_copy=learner.optim.restore_nonfinite)


def _check_tokens(sequences: list[list[int]], vocab: int) -> None:
    for i, s in enumerate(sequences):
        if not s:
            raise ValueError(f"sequences[{i}]: empty")
        if min(s) < 0 or max(s) >= vocab:
            raise ValueError(f"sequences[{i}]: token ids must be in [0, {vocab})")

