"""The Megatron learner: an HF model loaded into Megatron-core under TP/PP/EP/DP, giving log-probs of
given tokens, an RL train step (policy objective from megapo.algorithms), HF-named weights for sync,
and dist_checkpointing save/load. One instance per process; every rank calls every method.

    learner = Learner("tiny_moe/", ParallelConfig(tp=2), OptimConfig(lr=1e-5))
    logps = learner.logprobs([[1, 2, 3], [4, 5]])            # [tensor(2), tensor(1)] on every rank
    metrics = learner.train_step(samples, LossSpec("ppo", "token-mean", {"eps_high": 0.28}))
    metrics = learner.train_step(samples, "ppo", "token-mean", eps_high=0.28)   # the same (LossSpec.of)
    metrics, old = learner.train_step_on_policy(samples, LossSpec("gspo"))  # π_old = this forward's log-probs

Micro-batches are [rows x width] packed rows (megapo/learner/packing.py). Host reads happen once per
step: the batch is validated and its per-token inputs built once, each micro-batch's metrics stay on
the device until the step ends.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from megapo import compat
from megapo.config import OptimConfig, ParallelConfig
from megapo.dist import any_rank, min_over_ranks
from megapo.layout import check_layout, read_hf_config
from megapo.learner import model as model_lib
from megapo.learner import packing
from megapo.learner.guard import UpdateGuard
from megapo.learner.logprobs import (vocab_parallel_logprobs, vocab_parallel_logprobs_at,
                                     vocab_parallel_min_p_logprobs, vocab_parallel_sum_p2, vocab_parallel_topk)
from megapo.learner.precision import Precision
from megapo.learner.rope import set_positions
from megapo.algorithms.spec import LossSpec, as_loss_spec
from megapo.algorithms.sample import OPTIONAL_FIELDS, TOKEN_FIELDS, TOPK_FIELDS, TrainSample, as_train_samples
from megapo.models.family import family_for
from megapo.weights import gather, hf_load

@dataclass
class MicroBatch:
    layout: packing.MicroBatchLayout
    tokens: torch.Tensor  # [rows, W]
    position_ids: torch.Tensor  # [rows, W]
    attention_mask: torch.Tensor | None  # local spec: [rows, 1, W, W] True = masked
    packed_seq_params: object | None  # TE: PackedSeqParams (THD, one row)
    seq: np.ndarray  # [rows, W] input sequence of each slot (-1: padding; a shared slot: its unit's first member)
    pos: np.ndarray  # [rows, W] its position in that sequence
    targets: torch.Tensor  # [rows * W] the token each slot's logits predict (the next slot's)
    select: torch.Tensor | None = None  # [N] slots (of the flattened [rows * W]) whose log-probs are wanted
    order: list[int] | None = None  # the sequences they belong to, in `select`'s order
    sizes: list[int] | None = None  # entries of each of these sequences
    place: torch.Tensor | None = None  # [N] where each entry sits in the padded [S, T] view (flattened)
    mask: torch.Tensor | None = None  # [S, T] the view's real entries
    columns: torch.Tensor | None = None  # train: [N] index into the batch's per-token columns
    num_tokens: int = 0  # N
    loss_mask: torch.Tensor | None = None  # train: [S, T] the entries the loss counts (real, and loss_mask 1)
    loss_tokens: int = 0  # how many
    shared: list = ()  # shared-prefix units: (first member, the other members, shared positions) (packing.SlotMap)
    head_selected: bool = False  # the head ran at the `select` slots only (HeadSelection)


@dataclass
class TrainInputs:
    """A train batch checked once and its per-token inputs laid end to end (sample order), on the device."""

    columns: dict[str, torch.Tensor]  # TOKEN_FIELDS present but loss_mask -> [N] float32
    prompt_lens: np.ndarray  # [S]
    lengths: np.ndarray  # [S] tokens per sample
    starts: np.ndarray  # [S] first response token of each sample in the columns
    policy: np.ndarray | None = None  # [N] bool, on the host: loss_mask == 1 (None: no loss_mask, all are)
    # TOPK_FIELDS present -> [N, K]: teacher_topk_ids int64, teacher_topk_logp float32 (None: the batch has none)
    topk: dict[str, torch.Tensor] | None = None

    def policy_counts(self) -> np.ndarray:
        """[S] policy tokens per sample (the response tokens the loss counts)."""
        response = self.lengths - self.prompt_lens
        if self.policy is None:
            return response
        return np.add.reduceat(self.policy.astype(np.int64), self.starts)  # (every response has a token)


class Learner:
    def __init__(self, model_dir, parallel: ParallelConfig, optim: OptimConfig | None = None, *, seed: int = 0,
                 micro_batch_tokens: int = 4096, row_tokens: int = 0, total_steps: int | None = None,
                 routing_replay: bool = False, loss_fn: Callable | None = None, hf_weights: bool = True,
                 frozen: bool = False, precision: Precision = Precision(), share_prefix: str = "auto"):
        """`frozen`: log-probs only (a KL reference, megapo/learner/reference.py): no DDP wrapper, no
        gradients, no optimizer state; built in the process groups a learner of the same layout made.
        `precision`: fp32, or bf16 / fp16 parameters with fp32 main parameters (megapo/learner/precision.py).
        `share_prefix`: samples of one prompt hold it once in a micro-batch (packing.prefix_units) where their given
        routes agree on it: auto (a group whose routes differ is packed unshared), on (such a group is refused),
        off."""
        optim = optim or OptimConfig()
        optim.validate()
        precision.validate()
        if micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
        if not 0 <= row_tokens <= micro_batch_tokens:
            raise ValueError(f"row_tokens must be in [0, micro_batch_tokens={micro_batch_tokens}], got {row_tokens}")
        self.model_dir = Path(model_dir)
        hf = read_hf_config(model_dir)
        check_layout(parallel, hf)
        self.family = family_for(hf)
        self.spec = self.family.spec(hf)
        self.parallel = parallel
        self.optim = optim
        self.precision = precision
        self.micro_batch_tokens = micro_batch_tokens
        self.row_tokens = row_tokens  # width of a packed row; 0: the batch's longest sequence
        self.pad_id = int(hf.get("pad_token_id") or 0)
        self.backend = model_lib.detect_backend()
        self.device = self.backend.device
        self.share_prefix = _share_prefix_mode(share_prefix, self.backend.use_te)
        # `loss_fn` replaces megapo.algorithms.policy_loss (same signature, called with the step's LossSpec and the
        # per-token inputs as keywords); for tests and experiments.
        self._loss_fn = loss_fn
        self.route_hook = None  # routing replay plugs in here (see megapo/replay)
        self.step = 0
        self.packed_tokens = 0  # slots the last pass filled (train.share_prefix holds a prompt once), all ranks
        self.skipped_steps = 0  # optimizer steps skipped (fp16 overflow, non-finite loss or update), run total

        from megatron.core import tensor_parallel
        from megatron.core.distributed import finalize_model_grads

        if not (frozen and model_lib.layout_initialized(parallel)):  # else keep the learner's groups and RNG
            tensor_parallel.get_cuda_rng_tracker().reset()
            model_lib.init_distributed(parallel, self.backend, seed, spec=self.spec)
        self.config = model_lib.transformer_config(self.spec, parallel, self.backend, routing_replay=routing_replay,
                                                   precision=precision)
        self.model = model_lib.build_model(self.spec, parallel, self.backend, self.config, ddp=not frozen)
        self._head = model_lib.HeadSelection(self.module)
        if routing_replay:  # megapo/replay: routes through the micro-batches into Megatron's RouterReplay
            from megapo.replay.hook import attach

            self.route_hook = attach(self.module, self.config, self.spec)
        self._pads = model_lib.PaddingRoutes(self.module, self.config) \
            if model_lib.PaddingRoutes.applies(self.config) else None  # after replay's hooks: they see every row
        if hf_weights:  # False: model_dir needs only config.json; `load` a checkpoint next (conversion)
            hf_load.load_hf_weights(self.module, self.family, self.spec, model_dir)
        self.frozen = frozen
        if frozen:
            self.model.requires_grad_(False)
            self.optimizer = self.scheduler = self.guard = None
            return
        # Without it, norm/router grads are not summed over TP and TP>1 drifts from TP=1.
        self.config.finalize_model_grads_func = finalize_model_grads
        self.optimizer, self.scheduler = self._build_optimizer(total_steps)
        # fp16: the schedule multiplies each micro-batch's loss by the dynamic loss scale before backward
        self.config.grad_scale_func = self.optimizer.scale_loss if precision.params == "fp16" else None
        self.guard = UpdateGuard(self.model, self.optimizer, keep_copy=optim.restore_nonfinite)

    # ------------------------------------------------------------------------------------- helpers

    @property
    def module(self):
        return model_lib.unwrap(self.model)

    def _build_optimizer(self, total_steps: int | None):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = self.optim
        config = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.grad_clip,
            use_distributed_optimizer=self.parallel.distributed_optimizer,
            **self.precision.optimizer_fields())  # bf16 / fp16: fp32 main parameters; fp16: the loss scaler
        optimizer = get_megatron_optimizer(config, [self.model])
        decay_steps = max(total_steps or 1, o.warmup_steps + 1)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr, min_lr=min(o.min_lr, o.lr),
            lr_warmup_steps=o.warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=o.lr_schedule,
            start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant")
        return optimizer, scheduler

    def _micro_batches(self, sequences: list[list[int]], lo: np.ndarray, hi: np.ndarray,
                       columns_start: np.ndarray | None = None, policy: np.ndarray | None = None,
                       prompt_lens=None, routes=None, units: list | None = None) -> list[MicroBatch]:
        """This rank's micro-batches of `sequences`, each selecting the positions [lo[i], hi[i]) of
        sequence i whose log-probs are wanted (the logits at t predict token t + 1); `columns_start`:
        where sample i's per-token inputs start in the train columns; `policy`: TrainInputs.policy;
        `prompt_lens` (None: no sharing) and `routes`: for shared prefixes (_units); `units`: the packing units as
        given instead (packing.pair_units). Sets packed_tokens: the slots the whole batch fills on all ranks (its
        tokens, less what shared prefixes save)."""
        from megatron.core import parallel_state as ps

        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        flat = np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64, count=int(lengths.sum()))
        starts = np.cumsum(lengths) - lengths
        units = units if units is not None else self._units(sequences, lengths, prompt_lens, routes)
        layouts = packing.plan([u.size for u in units], dp=ps.get_data_parallel_world_size(),
                               dp_rank=ps.get_data_parallel_rank(), budget=self.micro_batch_tokens,
                               row_tokens=self.row_tokens, pad_multiple=self.parallel.tp,
                               equal_shapes=model_lib.needs_equal_rows(self.spec, self.parallel),
                               one_row=self.backend.use_te)
        self.packed_tokens = sum(u.size for u in units)
        return [self._micro_batch(layout, units, flat, starts, lo, hi, columns_start, policy) for layout in layouts]

    def _units(self, sequences, lengths: np.ndarray, prompt_lens, routes) -> list[packing.Unit]:
        """What packing places: shared-prefix units where sharing is on, else one unit per sequence."""
        if prompt_lens is None or self.share_prefix == "off":
            return packing.single_units(lengths)
        # every rank decides alike (a pipeline stage may hold only its own layers' routes): one collective
        agreed = partial(_routes_agreed, routes if routes is not None else [None] * len(sequences),
                         strict=self.share_prefix == "on")
        return packing.prefix_units(sequences, prompt_lens, self.row_tokens or self.micro_batch_tokens, agreed)

    def _micro_batch(self, layout, units, flat, starts, lo, hi, columns_start, policy=None) -> MicroBatch:
        dev = self.device
        smap = packing.slot_map(layout, units)
        tokens, positions = packing.slot_tensors(smap, flat, starts, self.pad_id)
        seq, pos = smap.seq, smap.pos
        mask, packed = None, None
        if self.backend.use_te:  # one THD row; TE's attention takes the boundaries, not a mask
            from megatron.core.packed_seq_params import PackedSeqParams

            row = packing.member_row(layout.rows[0], units)  # a pair unit's two sequences: two segments
            cu = packing.cu_seqlens(row).to(dev)
            longest = max([*row.lengths, layout.width - row.used, 1])
            packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     max_seqlen_q=longest, max_seqlen_kv=longest)
        else:
            mask = packing.tree_mask(smap).to(dev)
        mb = MicroBatch(layout, tokens.to(dev), positions.to(dev), mask, packed, seq, pos,
                        torch.roll(tokens, shifts=-1, dims=1).reshape(-1).to(dev), shared=smap.shared)
        order = smap.order
        if order:
            index, real = packing.slot_spans(smap, lo, hi)
            mb.order, mb.sizes, mb.num_tokens = order, real.sum(1).tolist(), int(real.sum())
            mb.select, mb.mask = torch.from_numpy(index[real]).to(dev), torch.from_numpy(real).to(dev)
            mb.place = torch.from_numpy(np.flatnonzero(real)).to(dev)
            if columns_start is not None:
                col = columns_start[np.asarray(order)][:, None] + np.arange(index.shape[1])[None, :]
                mb.columns = torch.from_numpy(col[real]).to(dev)
                mb.loss_mask, mb.loss_tokens = mb.mask, mb.num_tokens
                if policy is not None:  # observation tokens (loss_mask 0) leave the mask: nothing of theirs counts
                    counted = real.copy()
                    counted[real] = policy[col[real]]
                    mb.loss_mask, mb.loss_tokens = torch.from_numpy(counted).to(dev), int(counted.sum())
        return mb

    def _forward_step(self, loss_func, data_iterator, model):
        mb: MicroBatch = next(data_iterator)
        if self.route_hook is not None:
            self.route_hook.before_forward(mb)
        set_positions(model, mb.position_ids, int(mb.pos.max()) + 1)
        self._head.select(mb)
        kwargs = {"packed_seq_params": mb.packed_seq_params} if mb.packed_seq_params is not None else {}
        pads = self._pads.around(mb) if self._pads is not None else contextlib.nullcontext()
        with pads, compat.device_mode_suspended():  # the model's forward writes no device="cuda" literal
            output = model(mb.tokens, mb.position_ids, mb.attention_mask, **kwargs)
        return output, partial(self._at_selected, loss_func, mb)

    @staticmethod
    def _at_selected(loss_func, mb: MicroBatch, output: torch.Tensor):
        """The last stage's head output at the selected slots, [N, V/tp] (or [N, 1] for a score head), to
        `loss_func(mb, ...)`: as the head computed it (HeadSelection) or picked from the full [rows, W, ...]."""
        flat = output.reshape(-1, output.shape[-1])
        if not mb.head_selected:
            flat = flat[mb.select] if mb.select is not None else flat[:0]
        return loss_func(mb, flat)

    def _selected_logprobs(self, mb: MicroBatch, logits: torch.Tensor, with_entropy: bool, entropy_grad: bool = False):
        """log p(token t+1 | its sequence up to t) at the selected slots: ([N], [N] or None); logits
        [N, V/tp] at those slots (_at_selected)."""
        return vocab_parallel_logprobs(logits, mb.targets[mb.select], vocab_size=self.spec.vocab_size,
                                       with_entropy=with_entropy, entropy_grad=entropy_grad)

    def _policy_topk_inputs(self, mb: MicroBatch, logits: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
        """This forward's top-k at each selected slot, as the [S, T] inputs policy_loss takes: topk_logp_sum =
        Σ_k log π_θ(v_k) over π_θ's k most likely tokens (differentiable), top1 = 1.0 where the sampled token is
        the most likely one, topk_lse = log Σ_k π_θ(v_k) (differentiable) and in_topk = 1.0 where the sampled token is
        among the k (rlpt). Vocabulary-parallel: O(k) values per token cross TP ranks."""
        ids, _ = vocab_parallel_topk(logits, k, vocab_size=self.spec.vocab_size)
        logp = vocab_parallel_logprobs_at(logits, ids, vocab_size=self.spec.vocab_size)
        targets = mb.targets[mb.select]
        top1 = (ids[:, 0] == targets).to(logp.dtype)
        inside = (ids == targets[:, None]).any(-1).to(logp.dtype)
        return {"topk_logp_sum": self._padded(mb, logp.sum(-1)), "top1": self._padded(mb, top1),
                "topk_lse": self._padded(mb, torch.logsumexp(logp, dim=-1)), "in_topk": self._padded(mb, inside)}

    def _policy_proxy_logp(self, mb: MicroBatch, logits: torch.Tensor, min_p: float, threshold: str) -> torch.Tensor:
        """log q(y_t) at each selected slot as the [S, T] input policy_loss takes, q the min-p proxy of this forward's
        distribution (logprobs.vocab_parallel_min_p_logprobs: the tokens below the threshold dropped, the rest
        renormalised; 2–3 values per token cross TP ranks). Detached."""
        flat = logits.detach()
        return self._padded(mb, vocab_parallel_min_p_logprobs(flat, mb.targets[mb.select], min_p=min_p, mode=threshold,
                                                              vocab_size=self.spec.vocab_size))

    @staticmethod
    def _padded_rows(mb: MicroBatch, values: torch.Tensor) -> torch.Tensor:
        """[N, K] -> the [S, T, K] view (zero rows after each sequence's end); differentiable."""
        out = values.new_zeros(mb.mask.numel(), values.shape[-1])
        return out.index_put((mb.place,), values).view(*mb.mask.shape, values.shape[-1])

    @staticmethod
    def _padded(mb: MicroBatch, values: torch.Tensor) -> torch.Tensor:
        """[N] -> the [S, T] view (one sequence per row, zeros after its end); differentiable."""
        out = values.new_zeros(mb.mask.numel())
        return out.index_put((mb.place,), values).view(mb.mask.shape)

    def _run(self, micro_batches: list[MicroBatch], loss_func, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        fb = get_forward_backward_func()
        return fb(
            forward_step_func=partial(self._forward_step, loss_func),
            data_iterator=iter(micro_batches),
            model=[self.model],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.layout.width for mb in micro_batches),
            micro_batch_size=max(len(mb.layout.rows) for mb in micro_batches),
            forward_only=forward_only,
        )

    def _share_results(self, local: list) -> list:
        """Results computed on the last pipeline stage of each DP rank -> the same list on every rank."""
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() > 1:
            group = ps.get_pipeline_model_parallel_group()
            ranks = torch.distributed.get_process_group_ranks(group)
            box = [local if ps.is_pipeline_last_stage() else None]
            torch.distributed.broadcast_object_list(box, src=ranks[-1], group=group)
            local = box[0]
        if ps.get_data_parallel_world_size() > 1:
            gathered = [None] * ps.get_data_parallel_world_size()
            torch.distributed.all_gather_object(gathered, local, group=ps.get_data_parallel_group())
            local = [item for part in gathered for item in part]
        return local

    def _per_sequence(self, pieces: list[tuple[list[int], torch.Tensor, list[int]]], count: int) -> list[torch.Tensor]:
        """[N] values of every micro-batch (its sequences, values sequence after sequence, their sizes) -> one
        CPU tensor per input sequence, on every rank (one device-to-host copy per micro-batch)."""
        items = []
        for order, values, sizes in pieces:
            items.extend(zip(order, torch.split(values.cpu(), sizes)))
        by_index = dict(self._share_results(items))
        return [by_index[i] for i in range(count)]

    # ------------------------------------------------------------------------------------- API

    def logprobs(self, sequences: list[list[int]], routes=None, with_entropy: bool = False, prompt_lens=None):
        """log p(seq[t] | seq[:t]) for t = 1..len-1 of every sequence, on every rank (fp32, CPU).
        With with_entropy, returns (logprobs, entropies). `prompt_lens`: sequences with the same first
        prompt_lens[i] tokens share them in the micro-batches (train.share_prefix)."""
        lengths = _check_sequences(sequences, self.spec.vocab_size)
        if routes is not None and self.route_hook is None:
            raise ValueError("routes: given, but this learner has no routing replay hook (routing_replay=True)")
        if self.route_hook is not None:
            self.route_hook.set_routes(routes, sequences)
        micro_batches = self._micro_batches(sequences, np.zeros_like(lengths), lengths - 1, prompt_lens=prompt_lens,
                                            routes=routes)

        def collect(mb: MicroBatch, logits: torch.Tensor):
            if not mb.order:
                return logits.new_zeros(()), {"logp": None}
            logp, entropy = self._selected_logprobs(mb, logits.detach(), with_entropy)
            return logits.new_zeros(()), {"logp": logp, "entropy": entropy, "order": mb.order, "sizes": mb.sizes}

        self.model.eval()
        with torch.no_grad():
            stored = self._run(micro_batches, collect, forward_only=True)
        self.model.train()
        stored = [d for d in stored if d["logp"] is not None]
        logps = self._per_sequence([(d["order"], d["logp"], d["sizes"]) for d in stored], len(sequences))
        if with_entropy:
            entropies = self._per_sequence([(d["order"], d["entropy"], d["sizes"]) for d in stored], len(sequences))
            return logps, entropies
        return logps

    def response_topk(self, sequences: list[list[int]], prompt_lens: list[int], k: int, routes=None
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sequence, at each response token t (the positions prompt_len-1 .. len-2, whose logits predict the
        response), the model's k most likely token ids and their log-probs over the whole vocabulary:
        (ids [len - prompt_len, k] int64, logp [len - prompt_len, k] fp32, CPU), highest first, on every rank
        (collective). Vocabulary-parallel (logprobs.vocab_parallel_topk: O(k) values per token cross TP ranks)."""
        if not 1 <= k <= self.spec.vocab_size:
            raise ValueError(f"k: must be in [1, vocab_size={self.spec.vocab_size}], got {k}")

        def topk(flat: torch.Tensor) -> dict:
            ids, logp = vocab_parallel_topk(flat, k, vocab_size=self.spec.vocab_size)
            return {"ids": ids, "logp": logp.float()}

        out = self._response_pass(sequences, prompt_lens, routes, topk, ("ids", "logp"))
        return list(zip(out["ids"], out["logp"]))

    def response_sum_p2(self, sequences: list[list[int]], prompt_lens: list[int], routes=None) -> list[torch.Tensor]:
        """Per sequence, Σ_v p(v)² of the model's next-token distribution at each response token (the positions
        prompt_len-1 .. len-2): [len - prompt_len] fp32, CPU, on every rank (collective). With the token's log-prob
        it gives OTB's Logit-Gradient Proxy ‖e_y − p‖² = 1 − 2 p(y) + Σ_v p(v)² (megapo/algorithms/otb.py).
        Vocabulary-parallel (logprobs.vocab_parallel_sum_p2: two values per token cross TP ranks)."""
        def sum_p2(flat: torch.Tensor) -> dict:
            return {"sum_p2": vocab_parallel_sum_p2(flat, vocab_size=self.spec.vocab_size).float()}

        return self._response_pass(sequences, prompt_lens, routes, sum_p2, ("sum_p2",))["sum_p2"]

    def response_logp_at(self, sequences: list[list[int]], prompt_lens: list[int], ids: list[int], routes=None
                         ) -> list[torch.Tensor]:
        """Per sequence, log p(v) for each token id v of `ids` (the same ids at every position) at each response token
        (the positions prompt_len-1 .. len-2): [len - prompt_len, len(ids)] fp32, CPU, on every rank (collective;
        THR's prediction errors over the group's response vocabulary, megapo/algorithms/hidden_reward.py).
        Vocabulary-parallel (logprobs.vocab_parallel_logprobs_at: len(ids) + 1 values per token cross TP ranks)."""
        logp_at = _logp_at(ids, self.spec.vocab_size)
        return self._response_pass(sequences, prompt_lens, routes, logp_at, ("logp",))["logp"]

    def response_hidden_logp_at(self, sequences: list[list[int]], prompt_lens: list[int], ids: list[int],
                                routes=None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(response_hidden, response_logp_at) from ONE forward-only pass (collective; THR's two inputs,
        megapo/algorithms/hidden_reward.py): per sequence the LM head's input [len - prompt_len, hidden] fp32 and
        log p(v) for each id of `ids` [len - prompt_len, len(ids)] fp32 at each response token, both read at the same
        selected slots of the same forward (HeadSelection keeps the head's input, gathered over TP under sequence
        parallel; the log-probs vocabulary-parallel, as there)."""
        logp_at = _logp_at(ids, self.spec.vocab_size)

        def both(flat: torch.Tensor) -> dict:
            hidden, self._head.kept = self._head.kept, None
            return {"hidden": hidden.float(), **logp_at(flat)}

        self._head.keep_input = True
        try:
            out = self._response_pass(sequences, prompt_lens, routes, both, ("hidden", "logp"))
        finally:
            self._head.keep_input = False
        return out["hidden"], out["logp"]

    def response_hidden(self, sequences: list[list[int]], prompt_lens: list[int], routes=None) -> list[torch.Tensor]:
        """Per sequence, the LM head's input (the final hidden state, after the last norm) at each response token
        (the positions prompt_len-1 .. len-2, whose logits predict the response): [len - prompt_len, hidden] fp32,
        CPU, on every rank (collective; DelTA's token-gradient features, megapo/algorithms/discriminative.py). Kept
        by HeadSelection's hook; under sequence parallel it gathers the head's input over the TP ranks first. The
        whole [tokens, hidden] comes to the host: memory grows with the batch's response tokens times hidden."""
        def kept(flat: torch.Tensor) -> dict:
            hidden, self._head.kept = self._head.kept, None
            return {"hidden": hidden.float()}

        self._head.keep_input = True
        try:
            return self._response_pass(sequences, prompt_lens, routes, kept, ("hidden",))["hidden"]
        finally:
            self._head.keep_input = False

    def response_attention_entropy(self, sequences: list[list[int]], prompt_lens: list[int], layer: int = -1,
                                   routes=None) -> list[torch.Tensor]:
        """Per sequence, the entropy (nats) of layer `layer`'s head-averaged attention distribution at each response
        token (the queries at prompt_len-1 .. len-2): [len - prompt_len] float64, CPU, on every rank (collective; the
        stage attention_entropy's input). One forward-only pass with an opt-in recording hook on that layer's core
        attention (megapo/learner/attention_entropy.py: TP-, PP-, packing-aware; refuses attention kinds it cannot
        read, naming why)."""
        from megapo.learner.attention_entropy import response_attention_entropy

        lengths = _check_sequences(sequences, self.spec.vocab_size)
        return response_attention_entropy(self, sequences, lengths, prompt_lens, layer, routes)

    def response_tempered_logp(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float,
                               routes=None) -> list[torch.Tensor]:
        """Per sequence, log softmax(z/T)(y_t) at each response token (the positions prompt_len-1 .. len-2 predicting
        the response's tokens y_t): the model's distribution at temperature T, [len - prompt_len] fp32, CPU, on every
        rank (collective; Distribution-Centric Policy Optimization's target distribution, the stage
        distribution_centric). Vocabulary-parallel (logprobs.vocab_parallel_logprobs_at on z/T: one value per token
        crosses TP ranks besides the max)."""
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0 \
                or not math.isfinite(temperature):
            raise ValueError(f"temperature: must be a finite number > 0, got {temperature!r}")

        def tempered(flat: torch.Tensor, targets: torch.Tensor) -> dict:
            scaled = flat.to(torch.promote_types(flat.dtype, torch.float32)) / temperature
            logp = vocab_parallel_logprobs_at(scaled, targets[:, None], vocab_size=self.spec.vocab_size)
            return {"logp": logp[:, 0].float()}

        return self._response_pass(sequences, prompt_lens, routes, tempered, ("logp",), with_targets=True)["logp"]

    def response_js_distance(self, sequences: list[list[int]], prompt_lens: list[int],
                             context_sequences: list[list[int]], context_prompt_lens: list[int], routes=None
                             ) -> list[torch.Tensor]:
        """Per pair i, at each response token t the Jensen-Shannon distance between the next-token distributions of
        sequences[i] and context_sequences[i] (the same response behind another prompt: x ⊕ c): [len - prompt_len]
        fp32, CPU, on every rank (collective; MRTPO's token relevance, megapo/algorithms/multi_reward.py). One
        forward-only pass: each pair is one packing unit (packing.pair_units), so both members' logits sit in one
        micro-batch on one DP rank; `routes` (one per sequences[i], or None) are replayed there, the context
        sequences route freely. Vocabulary-parallel (divergence.vocab_parallel_js_distance: per position, four
        values cross TP ranks, then one). response_js_distances with one context list."""
        _check_contexts(sequences, prompt_lens, context_sequences, context_prompt_lens, "context_sequences")
        return [d[0] for d in self.response_js_distances(sequences, prompt_lens, [context_sequences],
                                                         [context_prompt_lens], routes=routes)]

    def response_js_distances(self, sequences: list[list[int]], prompt_lens: list[int],
                              contexts: list[list[list[int]]], context_prompt_lens: list[list[int]], routes=None
                              ) -> list[torch.Tensor]:
        """Per sequence i, [K, len - prompt_len] fp32, CPU, on every rank (collective): row k the Jensen-Shannon
        distance at each response token between the next-token distributions of sequences[i] and contexts[k][i] (the
        same response behind x ⊕ c_k), as response_js_distance gives for each k on its own. Fewer passes than K:
        sequence i and its partners in several context lists are one packing unit (packing.group_units), so
        sequence i is forwarded once for all of them; as many lists per pass as fit the micro-batch token budget
        beside the longest sequence (packing.partners_per_unit: all K in one pass where they fit, at least one).
        `routes` (one per sequences[i], or None) are replayed, the context sequences route freely."""
        count = len(contexts)
        if count < 1 or len(context_prompt_lens) != count:
            raise ValueError(f"contexts: one or more context lists, each with its prompt lengths in "
                             f"context_prompt_lens, got {count} and {len(context_prompt_lens)}")
        for k, (context, lens) in enumerate(zip(contexts, context_prompt_lens)):
            _check_contexts(sequences, prompt_lens, context, lens, f"contexts[{k}]")
        longest = max((len(s) for s in [*sequences, *(c for context in contexts for c in context)]), default=1)
        per = packing.partners_per_unit(count, longest, self.micro_batch_tokens)
        parts = [self._js_pass(sequences, prompt_lens, contexts[lo:lo + per], context_prompt_lens[lo:lo + per],
                               routes) for lo in range(0, count, per)]
        return [torch.cat([part[i] for part in parts]) for i in range(len(sequences))]

    def _js_pass(self, sequences: list[list[int]], prompt_lens: list[int], contexts: list[list[list[int]]],
                 context_prompt_lens: list[list[int]], routes) -> list[torch.Tensor]:
        """One forward-only pass of response_js_distances over the C context lists given (checked already): per
        sequence [C, len - prompt_len]."""
        from megapo.learner.divergence import vocab_parallel_js_distance

        n, c = len(sequences), len(contexts)
        every = [*sequences, *(s for context in contexts for s in context)]
        lengths = _check_sequences(every, self.spec.vocab_size)
        starts = np.asarray([*prompt_lens, *(p for lens in context_prompt_lens for p in lens)], dtype=np.int64)
        if ((starts < 1) | (starts >= lengths)).any():
            raise ValueError("prompt_lens: each in [1, len(sequence) - 1]")
        if routes is not None and self.route_hook is None:
            raise ValueError("routes: given, but this learner has no routing replay hook (routing_replay=True)")
        if self.route_hook is not None:
            self.route_hook.set_routes(None if routes is None else [*routes, *[None] * (n * c)], every)
        units = packing.group_units(lengths[:n].tolist(), [lengths[(j + 1) * n:(j + 2) * n].tolist()
                                                           for j in range(c)])
        micro_batches = self._micro_batches(every, starts - 1, lengths - 1, units=units)
        vocab = self.spec.vocab_size

        def collect(mb: MicroBatch, logits: torch.Tensor):
            if not mb.order:
                return logits.new_zeros(()), {"values": None}
            at = dict(zip(mb.order, np.cumsum([0, *mb.sizes[:-1]]).tolist()))
            size = dict(zip(mb.order, mb.sizes))
            mine = [i for i in mb.order if i < n]
            # sequence i's rows once per partner (i, then its partners j = 1..c), each against that partner's rows
            rows_p = [r for i in mine for _ in range(c) for r in range(at[i], at[i] + size[i])]
            rows_q = [r for i in mine for j in range(1, c + 1) for r in range(at[j * n + i], at[j * n + i] + size[i])]
            flat = logits.detach()
            index = lambda rows: torch.tensor(rows, dtype=torch.long, device=flat.device)
            values = vocab_parallel_js_distance(flat[index(rows_p)], flat[index(rows_q)], vocab_size=vocab)
            return logits.new_zeros(()), {"values": values.float(), "order": mine,
                                          "sizes": [c * size[i] for i in mine]}

        self.model.eval()
        with torch.no_grad():
            stored = [d for d in self._run(micro_batches, collect, forward_only=True) if d["values"] is not None]
        self.model.train()
        flat_values = self._per_sequence([(d["order"], d["values"], d["sizes"]) for d in stored], n)
        return [v.reshape(c, -1) for v in flat_values]

    def _response_micro_batches(self, sequences: list[list[int]], prompt_lens: list[int], routes,
                                lengths: np.ndarray | None = None) -> list[MicroBatch]:
        """This rank's micro-batches selecting each sequence's response positions (prompt_len-1 .. len-2), prompts
        shared as in `logprobs`, `routes` set on the replay hook; the sequences (unless their `lengths` are given,
        checked already), prompt_lens and routes checked first."""
        if lengths is None:
            lengths = _check_sequences(sequences, self.spec.vocab_size)
        starts = np.asarray(prompt_lens, dtype=np.int64)
        if starts.shape != lengths.shape or ((starts < 1) | (starts >= lengths)).any():
            raise ValueError("prompt_lens: one per sequence, each in [1, len(sequence) - 1]")
        if routes is not None and self.route_hook is None:
            raise ValueError("routes: given, but this learner has no routing replay hook (routing_replay=True)")
        if self.route_hook is not None:
            self.route_hook.set_routes(routes, sequences)
        return self._micro_batches(sequences, starts - 1, lengths - 1, prompt_lens=list(starts), routes=routes)

    def _response_pass(self, sequences: list[list[int]], prompt_lens: list[int], routes, per_slot,
                       names: tuple[str, ...], with_targets: bool = False) -> dict[str, list[torch.Tensor]]:
        """A forward-only pass that reads each sequence's response positions (prompt_len-1 .. len-2): `per_slot`
        maps the selected slots' logits [N, V_local] (and with `with_targets` the tokens they predict, [N]) to
        {name: [N, ...]}; per name, one CPU tensor per sequence on every rank (collective). Prompts shared as in
        `logprobs`, `routes` replayed as there."""
        micro_batches = self._response_micro_batches(sequences, prompt_lens, routes)

        def collect(mb: MicroBatch, logits: torch.Tensor):
            if not mb.order:
                return logits.new_zeros(()), {"values": None}
            flat = logits.detach()
            values = per_slot(flat, mb.targets[mb.select]) if with_targets else per_slot(flat)
            return logits.new_zeros(()), {"values": values, "order": mb.order, "sizes": mb.sizes}

        self.model.eval()
        with torch.no_grad():
            stored = [d for d in self._run(micro_batches, collect, forward_only=True) if d["values"] is not None]
        self.model.train()
        return {name: self._per_sequence([(d["order"], d["values"][name], d["sizes"]) for d in stored],
                                         len(sequences)) for name in names}

    def train_step(self, batch: list[TrainSample], loss: LossSpec | str, loss_agg: str | None = None,
                   **options) -> dict:
        """One optimizer step on `batch` (the full batch, identical on every rank; each DP rank takes
        its share) under `loss` (a LossSpec; an objective name builds one from `loss_agg`, default token-mean,
        and the options: as_loss_spec). Returns metrics: loss, grad_norm, lr, entropy, tokens_per_s, objective
        metrics. Dict samples are taken too (as_train_samples)."""
        metrics, _ = self._train(batch, as_loss_spec(loss, loss_agg, options, default_agg="token-mean"),
                                 on_policy=False, keep_logprobs=False, keep_entropy=False)
        return metrics

    def train_step_on_policy(self, batch: list[TrainSample], loss: LossSpec | str, loss_agg: str | None = None, *,
                             keep_logprobs: bool = False, keep_entropy: bool = False, **options) -> tuple[dict, dict]:
        """train_step on a batch whose π_old is the policy being trained (one update on one mini-batch,
        π_old from the learner): π_old is this forward's own detached log-probs, so no separate
        old-log-prob pass runs and samples need no old_logp. Returns (train metrics, what the
        old-log-prob pass would have given: "metrics", its routing metrics under "replay/...", and with
        keep_logprobs "logprobs", each sample's response log-probs before the update, on every rank; with
        keep_entropy "entropies", π_old's per-token entropy at them)."""
        return self._train(batch, as_loss_spec(loss, loss_agg, options, default_agg="token-mean"), on_policy=True,
                           keep_logprobs=keep_logprobs, keep_entropy=keep_entropy)

    def _train(self, batch: list[TrainSample], spec: LossSpec, *, on_policy: bool, keep_logprobs: bool,
               keep_entropy: bool) -> tuple[dict, dict]:
        from megatron.core import parallel_state as ps

        batch = as_train_samples(batch)  # the boundary: dict samples (tests, tools) seen as TrainSample
        if self.frozen:
            raise RuntimeError("train_step: this model is frozen (a reference model has no optimizer)")
        start = time.perf_counter()
        inputs = _train_inputs(batch, self.spec.vocab_size, need_old=not on_policy, device=self.device)
        if spec.distill_topk and inputs.topk is None:  # refused before any forward
            raise ValueError("batch: the loss has a top-k distillation term (LossSpec.distill_topk) but the samples "
                             "carry no teacher_topk_ids / teacher_topk_logp")
        loss_fn = self._loss_fn
        if loss_fn is None:
            from megapo.algorithms import policy_loss as loss_fn
        sequences = [s.tokens for s in batch]
        if self.route_hook is not None:  # routing replay: each sample's optional routes
            self.route_hook.set_routes([s.routes for s in batch], sequences, name="batch")
        micro_batches = self._micro_batches(sequences, inputs.prompt_lens - 1, inputs.lengths - 1, inputs.starts,
                                            inputs.policy, prompt_lens=inputs.prompt_lens,
                                            routes=[s.routes for s in batch])
        per_sample = inputs.policy_counts()  # the normalisers count policy tokens only (loss_mask)
        global_tokens = int(per_sample.sum())
        global_seqs = int((per_sample > 0).sum())  # a sample of observation tokens only adds nothing
        counts = _batch_counts(inputs, spec.objective, spec.loss_agg)  # batch-global counts an aggregation needs
        scale = len(micro_batches) * ps.get_data_parallel_world_size()  # undo the schedule's /M and DDP's /dp
        cols = inputs.columns
        from megapo.algorithms.loss import token_inputs

        # per-token inputs the objective reads (old_entropy, sentence_end; topk_logp_sum / top1 from this forward)
        wanted = token_inputs(spec.objective, spec.objective_options)
        policy_topk = getattr(spec.objective_config(), "policy_topk", 0)
        policy_proxy = getattr(spec.objective_config(), "policy_proxy", None)  # lp_reg's (min_p, threshold)

        def loss_func(mb: MicroBatch, logits: torch.Tensor):
            if not mb.order:  # an empty micro-batch (DP balancing): no loss, but keep the graph connected
                return logits.sum() * 0.0, {"tokens": 0, "response_tokens": 0}
            # entropy: a metric, and a loss term with entropy_coef
            packed, packed_entropy = self._selected_logprobs(mb, logits, True,
                                                             entropy_grad=bool(spec.entropy_coef))
            # tokens: the policy tokens the loss and the metrics count (the metrics' weights)
            out = {"tokens": mb.loss_tokens, "response_tokens": mb.num_tokens}
            if keep_logprobs:
                out["logp"] = (mb.order, packed.detach(), mb.sizes)
            if keep_entropy:  # π_old's per-token entropy, as the old-log-prob pass would give it
                out["entropy"] = (mb.order, packed_entropy.detach(), mb.sizes)
            if not mb.loss_tokens:  # observation tokens only (loss_mask 0): no loss, the graph kept connected
                return logits.sum() * 0.0, out
            # the loss gets the [S, T] view (zeros past each sequence's end) that policy_loss would build from
            # packed inputs, without the device reads its packed path takes
            logp, entropy = self._padded(mb, packed), self._padded(mb, packed_entropy)

            def column(name):
                return self._padded(mb, cols[name][mb.columns]) if name in cols else None

            old = logp.detach() if on_policy else column("old_logp")
            extra = {}
            # a token_weight stage's weights (algorithms/stages.py); low_entropy_kl's KL coefficients
            # stage soup's mismatch_mask: the tokens train/mismatch_* count
            for name in ("ref_logp", "token_weight", "kl_weight", "mismatch_mask"):
                if name in cols:
                    extra[name] = column(name)
            if policy_topk:  # the objective reads π_θ's own top-k at each token (simko, rlpt)
                extra.update(self._policy_topk_inputs(mb, logits, policy_topk))
            if policy_proxy is not None:  # log q(y_t) under the min-p proxy of this forward's π_θ (lp_reg)
                extra["proxy_logp"] = self._policy_proxy_logp(mb, logits, *policy_proxy)
            for name in wanted:  # on-policy, π_old's entropy is this forward's
                if name in POLICY_TOPK_INPUTS:
                    continue
                value = entropy.detach() if name == "old_entropy" and on_policy else column(name)
                if value is not None:
                    extra[name] = value
            if spec.entropy_coef:
                extra["entropy"] = entropy
            loss, metrics = loss_fn(spec, logp, old, column("advantage"), mb.loss_mask, column("rollout_logp"),
                                    global_tokens=global_tokens, global_seqs=global_seqs, **counts, **extra)
            if spec.distill_topk:  # the teachers' top-k forward KL, a loss term (megapo/algorithms/topk_distill.py)
                term, distill_metrics = self._topk_distill(mb, logits, inputs.topk, spec, logp, old,
                                                           column("advantage"), global_tokens, global_seqs, counts)
                loss = loss + term
                metrics = {**metrics, **distill_metrics}
            out.update(metrics=metrics, loss=loss.detach(),
                       entropy_sum=torch.where(mb.loss_mask, entropy.detach(), 0.0).sum())
            return loss * scale, out

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        stored = self._run(micro_batches, loss_func, forward_only=False)
        metrics = self._reduce_metrics(stored)  # collective: every rank sees the same loss
        if inputs.policy is not None:
            metrics["policy_tokens"] = global_tokens
        metrics.update(self._optimizer_step(math.isfinite(metrics["loss"])))
        elapsed = time.perf_counter() - start
        # packed_tokens: the tokens the forward ran (train.share_prefix holds each prompt once)
        metrics.update(step_time_s=elapsed, tokens_per_s=float(inputs.lengths.sum()) / max(elapsed, 1e-9),
                       packed_tokens=self.packed_tokens)
        old_pass: dict = {}
        if keep_logprobs:
            old_pass["logprobs"] = self._per_sequence([d["logp"] for d in stored if "logp" in d], len(batch))
        if keep_entropy:
            old_pass["entropies"] = self._per_sequence([d["entropy"] for d in stored if "entropy" in d], len(batch))
        if self.route_hook is not None:  # routing replay: disagreement / fallback metrics (collective)
            from megapo.replay.hook import as_replayed, fractions

            counts = self.route_hook.take_counts()
            if on_policy:  # this pass was also the old-log-prob pass; as training it replayed what it routed
                old_pass["metrics"] = fractions(counts)
                counts = as_replayed(counts)
            metrics.update(fractions(counts))
        return metrics, old_pass

    def _topk_distill(self, mb: MicroBatch, logits: torch.Tensor, topk: dict | None, spec: LossSpec, logp, old,
                      advantages, global_tokens: int, global_seqs: int, counts: dict):
        """Σ_j β_j KL_j aggregated as the policy loss is (the run's loss_agg and the batch-global normalisers), with
        log π_θ at the teachers' top-k ids from this micro-batch's vocabulary-parallel logits (differentiable)."""
        from megapo.algorithms.aggregation import Norm, resolve
        from megapo.algorithms.batch import TokenBatch
        from megapo.algorithms.topk_distill import topk_distill_loss

        if topk is None:
            raise ValueError("batch: the loss has a top-k distillation term (distill_topk) but the samples carry no "
                             "teacher_topk_ids / teacher_topk_logp")
        student = vocab_parallel_logprobs_at(logits, topk["teacher_topk_ids"][mb.columns],
                                             vocab_size=self.spec.vocab_size)
        teacher = topk["teacher_topk_logp"][mb.columns]
        b = TokenBatch(logp, old, advantages, mb.loss_mask)
        norm = Norm(global_tokens=global_tokens, global_seqs=global_seqs, max_len=spec.max_len,
                    polarity=counts.get("global_polarity"))
        return topk_distill_loss(self._padded_rows(mb, student), self._padded_rows(mb, teacher), spec.distill_topk, b,
                                 resolve(spec.loss_agg, spec.objective), norm)

    def _optimizer_step(self, loss_finite: bool) -> dict:
        """Megatron's optimizer step unless it would poison the weights: a non-finite loss skips it untouched,
        a non-finite gradient norm or non-finite parameters / Adam state after it undo it (UpdateGuard)."""
        lr = self.optimizer.param_groups[0]["lr"]
        ok, grad_norm = self.guard.step() if loss_finite else (False, float("nan"))
        if ok:
            self.scheduler.step(increment=1)
            self.step += 1
        else:  # nothing of this update stays: weights and Adam's moments as before it
            self.optimizer.zero_grad()
            self.skipped_steps += 1
        # fp16: gradients the loss scale made overflow are routine (the scaler shrinks), not a non-finite update
        overflow = not ok and loss_finite and self.precision.params == "fp16" and self._overflowed()
        out = {"grad_norm": grad_norm, "lr": lr, "update_ok": ok, "skipped_nonfinite": 0 if ok or overflow else 1,
               "skipped_steps": self.skipped_steps}
        if self.precision.params == "fp16":  # the scale after this step (halved by an overflow)
            out.update(loss_scale=float(self.optimizer.get_loss_scale()), overflow=int(overflow))
        return out

    def _overflowed(self) -> bool:
        """Whether Megatron's mixed-precision optimizer found inf/NaN in the unscaled gradients of the step it just
        refused (its found_inf, reduced over the ranks that share the step)."""
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return any(float(opt.found_inf) > 0 for opt in chained)

    def _reduce_metrics(self, stored: list[dict]) -> dict:
        """Metrics of the whole batch from its micro-batches on every DP rank, each by its declared reduction
        (megapo/learner/metrics.py): the loss and other shares summed, extremes as such, means token-weighted
        over the policy tokens (loss_mask 1: the tokens the loss counts); response_tokens counts them all. Each
        micro-batch's values stay on the device until one copy to the host here (collective)."""
        from megapo.learner.metrics import reduce_metrics

        parts = self._share_results(_host_metrics(stored))
        return reduce_metrics(parts)

    def hf_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named fp32 tensors, gathered over TP/EP/PP, on every rank (collective), one at a
        time. Each is a copy the caller may keep while the optimizer goes on updating the parameters."""
        return gather.iter_model_tensors(self.module, self.family, self.spec, dtype=torch.float32, owned=True)

    def stage_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This pipeline stage's full HF tensors, gathered over TP/EP (collective over the stage); with TP=1
        views of the parameters: consume each before the next optimizer step (a weight sync does)."""
        return gather.iter_stage_tensors(self.module, self.family, self.spec)

    def sync_stage(self) -> tuple[int, int, bool]:
        """(this rank's pipeline stage, the number of stages, whether it speaks for its stage in a weight sync)."""
        from megatron.core import parallel_state

        return (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size(),
                gather.is_stage_root())

    def save(self, ckpt_dir) -> None:
        from megatron.core import dist_checkpointing

        from megapo.integrity import check_finite_all_ranks

        ckpt_dir = Path(ckpt_dir)
        check_finite_all_ranks(self.module.named_parameters(), f"checkpoint {ckpt_dir}")  # every rank raises
        ckpt_dir.mkdir(parents=True, exist_ok=True)  # dist_checkpointing needs an existing folder
        # Adam's state appears at the first optimizer step; saved before it (every update skipped so
        # far), the checkpoint would lack exp_avg and loading it would fail. Save without it and mark
        # that, so load keeps a fresh optimizer (identical to one that never stepped).
        has_state = self._optimizer_has_state()
        if has_state:
            state = self._sharded_state()
        else:
            state = {"model": self.module.sharded_state_dict(), "scheduler": self.scheduler.state_dict(),
                     "step": self.step}
        state.update(optimizer_saved=has_state, skipped_steps=self.skipped_steps, precision=self.precision.params)
        dist_checkpointing.save(state, str(ckpt_dir))

    def _optimizer_has_state(self) -> bool:
        """Whether any rank's Adam has state (collective: every rank must save the same keys)."""
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return any_rank(any(len(s) > 0 for opt in chained for s in opt.optimizer.state.values()))

    def load(self, ckpt_dir, *, load_optimizer: bool = True) -> None:
        """Resume from `save`. The model reshards to any layout; optimizer state needs the same
        expert-parallel setting (EP=1 vs EP>1 chain a different number of Megatron optimizers), so
        load_optimizer=False loads only the weights (conversion, evaluation, a new run)."""
        from megatron.core import dist_checkpointing

        if not Path(ckpt_dir).is_dir():
            raise FileNotFoundError(f"ckpt_dir: {ckpt_dir} is not a folder")
        common = dist_checkpointing.load_common_state_dict(str(ckpt_dir)) if load_optimizer else {}
        saved_in = common.get("precision", "fp32")
        if load_optimizer and saved_in != self.precision.params:  # Megatron's optimizer state differs between them
            raise ValueError(f"train.precision: the checkpoint {ckpt_dir} was saved by a {saved_in} learner, this one "
                             f"is {self.precision.params}; resume with train.precision={saved_in}")
        with_optimizer = load_optimizer and common.get("optimizer_saved", True)  # False: saved before any step
        state = self._sharded_state(loading=True) if with_optimizer else {"model": self.module.sharded_state_dict()}
        loaded = dist_checkpointing.load(state, str(ckpt_dir))
        self.module.load_state_dict(loaded["model"], strict=False)
        if with_optimizer:
            self.optimizer.load_state_dict(loaded["optimizer"])
        elif self.optimizer is not None and self.precision.mixed:  # fp32 main parameters from the loaded weights
            self.optimizer.reload_model_params()
        if load_optimizer:
            self.scheduler.load_state_dict(common["scheduler"])
            self.step = int(common["step"])
            self.skipped_steps = int(common.get("skipped_steps", 0))

    def _sharded_state(self, loading: bool = False) -> dict:
        model_sd = self.module.sharded_state_dict()
        return {"model": model_sd, "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=loading),
                "scheduler": self.scheduler.state_dict(), "step": self.step}

    def close(self) -> None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()



def _host_metrics(stored: list[dict]) -> list:
    """This rank's micro-batches' metrics (loss_func's outputs) as metrics.MicroBatchMetrics, in one device-to-host
    copy: for each, the learner's own (loss, entropy as its sum over the policy tokens, response_tokens) and
    policy_loss's (its entropy, if any, is replaced by the learner's). A micro-batch without policy tokens gives
    its response_tokens only."""
    from megapo.learner.metrics import MicroBatchMetrics

    trained = [d for d in stored if d["tokens"]]
    values = [v for d in trained for v in (d["loss"], d["entropy_sum"], *(d["metrics"][k] for k in sorted(d["metrics"])))]
    host = iter(torch.stack([v.reshape(()).to(torch.float64) for v in values]).tolist() if values else [])
    parts = []
    for d in stored:
        if not d["tokens"]:
            parts.append(MicroBatchMetrics(0, {"response_tokens": d.get("response_tokens", 0)}))
            continue
        own = {"loss": next(host), "entropy": next(host), "response_tokens": d["response_tokens"]}
        objective = {k: next(host) for k in sorted(d["metrics"])}
        parts.append(MicroBatchMetrics(d["tokens"], {**own, **{k: v for k, v in objective.items() if k not in own}}))
    return parts


def _share_prefix_mode(mode: str, use_te: bool) -> str:
    """train.share_prefix checked; off where the attention cannot take the tree mask (said once, in the log)."""
    if mode not in SHARE_PREFIX_MODES:
        raise ValueError(f"share_prefix: must be one of {', '.join(SHARE_PREFIX_MODES)}, got {mode!r}")
    if use_te and mode != "off":
        # Transformer Engine's THD attention takes sequence boundaries, not a mask; megatron-core 0.16.1 has no
        # tree-packed sequences (TreePackedSeqParams, Megatron-LM PR 7387)
        print("train.share_prefix: Transformer Engine's THD attention here takes no tree mask; packing unshared",
              flush=True)
        return "off"
    return mode


SHARE_PREFIX_MODES = ("auto", "on", "off")
# per-token objective inputs the train forward computes from its own logits (policy_loss's topk_logp_sum, top1;
# topk_lse, in_topk: rlpt's promising set; proxy_logp: lp_reg's min-p proxy)
POLICY_TOPK_INPUTS = ("topk_logp_sum", "top1", "topk_lse", "in_topk", "proxy_logp")


def _routes_agreed(routes: list, groups: list[tuple[list[int], int]], *, strict: bool) -> list[int]:
    """For each (members, shared) of packing.prefix_units: the leading positions (at most `shared`) on which the
    members' given routes agree, the same on every rank (a pipeline stage may hold only its own layers' columns);
    a sample without routes among samples with them agrees nowhere. `strict`: a disagreement is refused."""
    agreed = min_over_ranks([_agreed_positions(routes, m, n) for m, n in groups])
    for (members, shared), n in zip(groups, agreed):
        if strict and n < shared:
            raise ValueError(f"train.share_prefix=on: samples {members} share their first {shared + 1} tokens but "
                             f"their routes differ at position {n}; a shared prefix is routed once (set "
                             f"train.share_prefix=auto to share only the positions whose routes agree)")
    return agreed


def _agreed_positions(routes: list, members: list[int], shared: int) -> int:
    if shared < 1:
        return 0
    given = [routes[m] for m in members]
    if all(r is None for r in given):
        return shared
    if any(r is None or len(r) < shared for r in given):
        return 0
    block = np.stack([_host(r)[:shared] for r in given])
    if (block == block[0]).all():  # the same ids in the same order (an engine prefills a prompt once): agreed
        return shared
    # [members, shared, layers * k], each route sorted: a route is a set of experts
    block = np.sort(block, axis=-1).reshape(len(given), shared, -1)
    same = (block == block[0]).all(axis=(0, 2))
    return shared if same.all() else int(np.argmin(same))


def _host(routes) -> np.ndarray:
    return routes.cpu().numpy() if isinstance(routes, torch.Tensor) else np.asarray(routes)


def _check_contexts(sequences, prompt_lens, context_sequences, context_prompt_lens, name: str) -> None:
    """Refuses (naming `name`) context sequences that are not one per sequence, each with its prompt length and
    ending with that sequence's response (its tokens after prompt_lens[i])."""
    n = len(sequences)
    if len(context_sequences) != n or len(context_prompt_lens) != n or len(prompt_lens) != n:
        raise ValueError(f"{name}: one with its prompt length per sequence ({n}), got "
                         f"{len(context_sequences)} and {len(context_prompt_lens)} ({len(prompt_lens)} prompt_lens)")
    for i, (a, p, b, q) in enumerate(zip(sequences, prompt_lens, context_sequences, context_prompt_lens)):
        if list(a[p:]) != list(b[q:]):
            raise ValueError(f"{name}[{i}]: must end with sequences[{i}]'s response "
                             f"(its tokens after prompt_lens[{i}]={p})")


def _logp_at(ids: list[int], vocab: int):
    """`ids` checked -> a response pass's per-slot map: logits [N, V_local] -> {"logp": log p(v) for v in ids,
    [N, len(ids)] fp32} (logprobs.vocab_parallel_logprobs_at)."""
    if not ids or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab for v in ids):
        raise ValueError(f"ids: one or more token ids in [0, vocab_size={vocab}), got {ids!r}")
    wanted = torch.tensor(ids, dtype=torch.long)

    def logp_at(flat: torch.Tensor) -> dict:
        at = wanted.to(flat.device).expand(flat.shape[0], -1)
        return {"logp": vocab_parallel_logprobs_at(flat, at, vocab_size=vocab).float()}

    return logp_at


def _check_sequences(sequences: list[list[int]], vocab: int) -> np.ndarray:
    """Lengths of `sequences` after checking them all at once (the first bad one named)."""
    lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    short = np.flatnonzero(lengths < 2)
    if short.size:
        i = int(short[0])
        raise ValueError(f"sequences[{i}]: needs at least 2 tokens, got {lengths[i]}")
    bad = _first_out_of_range(sequences, lengths, vocab)
    if bad is not None:
        raise ValueError(f"sequences[{bad}]: token ids must be in [0, {vocab})")
    return lengths


def _first_out_of_range(sequences, lengths: np.ndarray, vocab: int) -> int | None:
    """Index of the first sequence holding a token id outside [0, vocab), else None (one vectorised pass)."""
    flat = np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64, count=int(lengths.sum()))
    outside = np.flatnonzero((flat < 0) | (flat >= vocab))
    if not outside.size:
        return None
    return int(np.searchsorted(np.cumsum(lengths), outside[0], side="right"))


def _batch_counts(inputs: TrainInputs, objective: str, loss_agg: str) -> dict:
    """policy_loss keywords holding counts over the whole batch that the aggregation needs beyond
    global_tokens / global_seqs (computed once per step, so the loss does not depend on the split);
    none for the other aggregations."""
    from megapo.algorithms.aggregation import AUTO, polarity_counts
    from megapo.algorithms.registry import entries

    if loss_agg == AUTO:  # the objective's own; a custom loss_fn's objective name may not be registered
        loss_agg = next((e.loss_agg for e in entries("objective") if e.name == objective), None)
    if loss_agg != "balanced":
        return {}
    response = torch.from_numpy(inputs.lengths - inputs.prompt_lens)
    adv = inputs.columns["advantage"]
    if inputs.policy is not None:  # a sample's sign and its tokens: its policy tokens' (where: not even a NaN)
        adv = torch.where(torch.from_numpy(inputs.policy).to(adv.device), adv, 0.0)
    owner = torch.repeat_interleave(torch.arange(len(response), device=adv.device), response.to(adv.device))
    sums = torch.zeros(len(response), dtype=torch.float64, device=adv.device).index_add_(0, owner, adv.double())
    return {"global_polarity": polarity_counts(sums.cpu(), torch.from_numpy(inputs.policy_counts()))}


def _train_inputs(batch: list[TrainSample], vocab: int, *, need_old: bool, device) -> TrainInputs:
    """Check a train batch once (ValueError naming the sample and field) and lay its per-token inputs
    end to end: one tensor per field for the whole batch, moved to the device once."""
    batch = as_train_samples(batch)
    if not batch:
        raise ValueError("batch: empty")
    required = ("tokens", "prompt_len", "advantage") + (("old_logp",) if need_old else ())
    for i, s in enumerate(batch):
        for key in required:
            if getattr(s, key) is None:
                raise ValueError(f"batch[{i}].{key}: missing")
    lengths = np.fromiter((len(s.tokens) for s in batch), dtype=np.int64, count=len(batch))
    prompt = np.fromiter((s.prompt_len for s in batch), dtype=np.int64, count=len(batch))
    bad = np.flatnonzero((prompt < 1) | (prompt >= lengths))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"batch[{i}].prompt_len: must be in [1, {lengths[i] - 1}] for {lengths[i]} tokens, "
                         f"got {prompt[i]}")
    out_of_range = _first_out_of_range([s.tokens for s in batch], lengths, vocab)
    if out_of_range is not None:
        raise ValueError(f"batch[{out_of_range}].tokens: ids must be in [0, {vocab})")
    response = lengths - prompt
    columns, policy = {}, None
    for name in TOKEN_FIELDS:
        if name == "old_logp" and not need_old:
            continue
        values = [getattr(s, name) for s in batch]
        if name in OPTIONAL_FIELDS:
            given = [v is not None for v in values]
            if not any(given):
                continue
            if not all(given):
                raise ValueError(f"batch[{given.index(False)}].{name}: missing (other samples have it)")
        column = _token_column(values, response, name)
        if name == "loss_mask":  # stays on the host: it shapes the micro-batches' masks
            policy = _policy_mask(column, response)
        else:
            columns[name] = torch.from_numpy(column).to(device)
    return TrainInputs(columns, prompt, lengths, np.cumsum(response) - response, policy,
                       _topk_columns(batch, response, vocab, device))


def _topk_columns(batch: list[TrainSample], response: np.ndarray, vocab: int, device) -> dict | None:
    """The teachers' top-k rows of every sample end to end ([N, K] per TOPK_FIELDS name: ids int64, log-probs
    float32), after checking each has one row of the same K per response token and ids in [0, vocab); None when no
    sample has them."""
    given = [[getattr(s, name) is not None for s in batch] for name in TOPK_FIELDS]
    if not any(any(g) for g in given):
        return None
    out = {}
    for name, has in zip(TOPK_FIELDS, given):
        if not all(has):
            raise ValueError(f"batch[{has.index(False)}].{name}: missing (other samples have top-k rows)")
        dtype = np.int64 if name == "teacher_topk_ids" else np.float32
        rows = [np.asarray(getattr(s, name).cpu() if isinstance(getattr(s, name), torch.Tensor) else getattr(s, name),
                           dtype=dtype) for s in batch]
        width = rows[0].shape[-1] if rows[0].ndim == 2 else -1
        for i, (r, n) in enumerate(zip(rows, response)):
            if r.ndim != 2 or r.shape != (n, width):
                raise ValueError(f"batch[{i}].{name}: expected [{n}, K] (one row of K per response token, K as "
                                 f"batch[0]'s {width}), got shape {list(r.shape)}")
        column = np.concatenate(rows)
        if name == "teacher_topk_ids" and ((column < 0) | (column >= vocab)).any():
            i = int(np.searchsorted(np.cumsum(response), np.flatnonzero(((column < 0) | (column >= vocab)).any(1))[0],
                                    side="right"))
            raise ValueError(f"batch[{i}].{name}: ids must be in [0, {vocab})")
        out[name] = torch.from_numpy(column).to(device)
    return out


def _policy_mask(loss_mask: np.ndarray, response: np.ndarray) -> np.ndarray:
    """loss_mask's column -> bool, after checking it holds only 0 / 1 and the batch has a policy token (a sample
    of observation tokens only is allowed: it adds nothing to the loss or its normalisers)."""
    bad = np.flatnonzero((loss_mask != 0) & (loss_mask != 1))  # (NaN too)
    if bad.size:
        ends = np.cumsum(response)
        i = int(np.searchsorted(ends, bad[0], side="right"))
        at = int(bad[0] - (ends[i] - response[i]))
        raise ValueError(f"batch[{i}].loss_mask: must be 0 (an observation token) or 1 (a policy token), "
                         f"got {float(loss_mask[bad[0]])!r} at response token {at}")
    if not loss_mask.any():
        raise ValueError("batch: loss_mask is 0 at every response token of every sample (no policy token to train on)")
    return loss_mask == 1


def _token_column(values: list, response: np.ndarray, name: str) -> np.ndarray:
    """One float32 value per response token of every sample, end to end; a scalar advantage is repeated."""
    if name == "advantage" and all(isinstance(v, (int, float)) for v in values):
        return np.repeat(np.asarray(values, dtype=np.float32), response)
    if all(isinstance(v, list) for v in values) and [len(v) for v in values] == response.tolist():
        try:  # flat lists of numbers (the engine's log-probs): one pass, not an array per sample
            return np.fromiter(itertools.chain.from_iterable(values), dtype=np.float32, count=int(response.sum()))
        except (TypeError, ValueError):  # nested or non-numeric: the checks below name the sample
            pass
    parts = []
    for i, (v, n) in enumerate(zip(values, response)):
        if name == "advantage" and isinstance(v, (int, float)):
            parts.append(np.full(n, v, dtype=np.float32))
            continue
        arr = v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
        arr = arr.astype(np.float32).reshape(-1)
        if arr.size != n:
            raise ValueError(f"batch[{i}].{name}: expected {n} values (one per response token), got {arr.size}")
        parts.append(arr)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
