"""The Megatron learner: an HF model loaded into Megatron-core under TP/PP/EP/DP, giving log-probs of
given tokens, an RL train step (policy objective from megapo.algorithms), HF-named weights for sync,
and dist_checkpointing save/load. One instance per process; every rank calls every method.

    learner = Learner("tiny_moe/", ParallelConfig(tp=2), OptimConfig(lr=1e-5))
    logps = learner.logprobs([[1, 2, 3], [4, 5]])            # [tensor(2), tensor(1)] on every rank
    metrics = learner.train_step(samples, "ppo", "token-mean", clip_eps=0.2)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import torch

from megapo.config import OptimConfig, ParallelConfig
from megapo.layout import check_layout, read_hf_config
from megapo.learner import model as model_lib
from megapo.learner import packing, weights
from megapo.learner.logprobs import vocab_parallel_logprobs
from megapo.learner.rope import set_positions
from megapo.models.family import family_for
from megapo.weights import gather

# policy_loss metrics that are a micro-batch's share of the batch total (aggregated with the global
# normaliser), so the batch's value is their sum, not their mean
SHARE_METRICS = ("pg_loss",)


@dataclass
class MicroBatch:
    row: packing.PackedRow
    tokens: torch.Tensor  # [1, W]
    position_ids: torch.Tensor  # [1, W]
    attention_mask: torch.Tensor | None  # local spec: [1, 1, W, W] True = masked
    packed_seq_params: object | None  # TE: PackedSeqParams (THD)
    samples: list[dict] | None = None  # train step: the samples of row.indices


class Learner:
    def __init__(self, model_dir, parallel: ParallelConfig, optim: OptimConfig | None = None, *, seed: int = 0,
                 micro_batch_tokens: int = 4096, total_steps: int | None = None, routing_replay: bool = False,
                 loss_fn: Callable | None = None, hf_weights: bool = True):
        optim = optim or OptimConfig()
        optim.validate()
        if micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
        self.model_dir = Path(model_dir)
        hf = read_hf_config(model_dir)
        check_layout(parallel, hf)
        self.family = family_for(hf)
        self.spec = self.family.spec(hf)
        self.parallel = parallel
        self.optim = optim
        self.micro_batch_tokens = micro_batch_tokens
        self.pad_id = int(hf.get("pad_token_id") or 0)
        self.backend = model_lib.detect_backend()
        self.device = self.backend.device
        # `loss_fn` replaces megapo.algorithms.policy_loss (same signature); for tests and experiments.
        self._loss_fn = loss_fn
        self.route_hook = None  # routing replay plugs in here (see megapo/replay)
        self.step = 0

        from megatron.core import tensor_parallel
        from megatron.core.distributed import finalize_model_grads

        tensor_parallel.get_cuda_rng_tracker().reset()
        model_lib.init_distributed(parallel, self.backend, seed)
        self.config = model_lib.transformer_config(self.spec, parallel, self.backend, routing_replay=routing_replay)
        self.model = model_lib.build_model(self.spec, parallel, self.backend, self.config)
        if routing_replay:  # megapo/replay: routes through the micro-batches into Megatron's RouterReplay
            from megapo.replay.hook import attach

            self.route_hook = attach(self.module, self.config, self.spec)
        if hf_weights:  # False: model_dir needs only config.json; `load` a checkpoint next (conversion)
            weights.load_hf_weights(self.module, self.family, self.spec, model_dir)
        # Without it, norm/router grads are not summed over TP and TP>1 drifts from TP=1.
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = None
        self.optimizer, self.scheduler = self._build_optimizer(total_steps)

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
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.grad_clip, bf16=False, fp16=False,
            params_dtype=torch.float32, use_distributed_optimizer=self.parallel.distributed_optimizer)
        optimizer = get_megatron_optimizer(config, [self.model])
        decay_steps = max(total_steps or 1, o.warmup_steps + 1)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr, min_lr=min(o.min_lr, o.lr),
            lr_warmup_steps=o.warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=o.lr_schedule,
            start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant")
        return optimizer, scheduler

    def _micro_batches(self, sequences: list[list[int]], samples: list[dict] | None = None) -> list[MicroBatch]:
        from megatron.core import parallel_state as ps

        lengths = [len(s) for s in sequences]
        rows = packing.plan(lengths, dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
                            budget=self.micro_batch_tokens, pad_multiple=self.parallel.tp,
                            equal_width=model_lib.needs_equal_rows(self.spec, self.parallel))
        out = []
        for row in rows:
            tokens, positions, segments = packing.row_tensors(row, sequences, self.pad_id)
            mask, packed = None, None
            if self.backend.use_te:
                from megatron.core.packed_seq_params import PackedSeqParams

                cu = packing.cu_seqlens(row).to(self.device)
                longest = int((cu[1:] - cu[:-1]).max())
                packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                         max_seqlen_q=longest, max_seqlen_kv=longest)
            else:
                mask = packing.block_causal_mask(segments).to(self.device)
            out.append(MicroBatch(row, tokens.to(self.device), positions.to(self.device), mask, packed,
                                  [samples[i] for i in row.indices] if samples is not None else None))
        return out

    def _forward_step(self, loss_func, data_iterator, model):
        mb: MicroBatch = next(data_iterator)
        if self.route_hook is not None:
            self.route_hook.before_forward(mb)
        set_positions(model, mb.position_ids)
        kwargs = {"packed_seq_params": mb.packed_seq_params} if mb.packed_seq_params is not None else {}
        output = model(mb.tokens, mb.position_ids, mb.attention_mask, **kwargs)
        return output, partial(loss_func, mb)

    def _row_logprobs(self, mb: MicroBatch, logits: torch.Tensor, with_entropy: bool):
        """Per-position log p(token[j+1] | row[:j+1]) over the row; logits [1, W, V/tp]."""
        targets = torch.roll(mb.tokens[0], shifts=-1)
        return vocab_parallel_logprobs(logits[0], targets, vocab_size=self.spec.vocab_size, with_entropy=with_entropy)

    def _run(self, micro_batches: list[MicroBatch], loss_func, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        fb = get_forward_backward_func()
        return fb(
            forward_step_func=partial(self._forward_step, loss_func),
            data_iterator=iter(micro_batches),
            model=[self.model],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.row.width for mb in micro_batches),
            micro_batch_size=1,
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

    # ------------------------------------------------------------------------------------- API

    def logprobs(self, sequences: list[list[int]], routes=None, with_entropy: bool = False):
        """log p(seq[t] | seq[:t]) for t = 1..len-1 of every sequence, on every rank (fp32, CPU).
        With with_entropy, returns (logprobs, entropies)."""
        for i, seq in enumerate(sequences):
            if len(seq) < 2:
                raise ValueError(f"sequences[{i}]: needs at least 2 tokens, got {len(seq)}")
            if min(seq) < 0 or max(seq) >= self.spec.vocab_size:
                raise ValueError(f"sequences[{i}]: token ids must be in [0, {self.spec.vocab_size})")
        if routes is not None and self.route_hook is None:
            raise ValueError("routes: given, but this learner has no routing replay hook (routing_replay=True)")
        if self.route_hook is not None:
            self.route_hook.set_routes(routes, sequences)
        micro_batches = self._micro_batches(sequences)

        def collect(mb: MicroBatch, logits: torch.Tensor):
            logp, entropy = self._row_logprobs(mb, logits.detach(), with_entropy)
            out = []
            for i, at, n in zip(mb.row.indices, mb.row.offsets, mb.row.lengths):
                item = (i, logp[at:at + n - 1].cpu(), entropy[at:at + n - 1].cpu() if with_entropy else None)
                out.append(item)
            return logits.new_zeros(()), {"items": out}

        self.model.eval()
        with torch.no_grad():
            stored = self._run(micro_batches, collect, forward_only=True)
        self.model.train()
        items = self._share_results([item for d in stored for item in d["items"]])
        by_index = {i: (lp, ent) for i, lp, ent in items}
        logps = [by_index[i][0] for i in range(len(sequences))]
        if with_entropy:
            return logps, [by_index[i][1] for i in range(len(sequences))]
        return logps

    def train_step(self, batch: list[dict], objective: str, loss_agg: str = "token-mean", **options) -> dict:
        """One optimizer step on `batch` (the full batch, identical on every rank; each DP rank takes
        its share). Returns metrics: loss, grad_norm, lr, entropy, tokens_per_s, objective metrics."""
        from megatron.core import parallel_state as ps

        if not batch:
            raise ValueError("batch: empty")
        for i, s in enumerate(batch):
            _check_sample(i, s, self.spec.vocab_size)
        loss_fn = self._loss_fn
        if loss_fn is None:
            from megapo.algorithms import policy_loss as loss_fn
        start = time.perf_counter()
        sequences = [list(s["tokens"]) for s in batch]
        if self.route_hook is not None:  # routing replay: each sample's optional "routes"
            self.route_hook.set_routes([s.get("routes") for s in batch], sequences, name="batch")
        micro_batches = self._micro_batches(sequences, batch)
        global_tokens = sum(len(s["tokens"]) - s["prompt_len"] for s in batch)
        scale = len(micro_batches) * ps.get_data_parallel_world_size()  # undo the schedule's /M and DDP's /dp

        def loss_func(mb: MicroBatch, logits: torch.Tensor):
            if not mb.row.indices:  # an empty row (DP balancing): no loss, but keep the graph connected
                return logits.sum() * 0.0, {"tokens": 0, "metrics": {}, "loss": 0.0, "entropy_sum": 0.0}
            logp_row, ent_row = self._row_logprobs(mb, logits, True)  # entropy: a metric, and an optional loss term
            pieces = {"logp": [], "ent": [], "old": [], "adv": [], "roll": [], "ref": []}
            cu = [0]
            for sample, at, n in zip(mb.samples, mb.row.offsets, mb.row.lengths):
                p = sample["prompt_len"]
                sl = slice(at + p - 1, at + n - 1)  # logits at t-1 predict response token t
                r = n - p
                pieces["logp"].append(logp_row[sl])
                pieces["ent"].append(ent_row[sl])
                pieces["old"].append(_per_token(sample["old_logp"], r, "old_logp"))
                adv = sample["advantage"]
                pieces["adv"].append(_per_token(adv, r, "advantage") if isinstance(adv, (list, tuple))
                                     else torch.full((r,), float(adv)))
                if sample.get("rollout_logp") is not None:
                    pieces["roll"].append(_per_token(sample["rollout_logp"], r, "rollout_logp"))
                if sample.get("ref_logp") is not None:
                    pieces["ref"].append(_per_token(sample["ref_logp"], r, "ref_logp"))
                cu.append(cu[-1] + r)
            dev = logits.device
            logp = torch.cat(pieces["logp"])
            entropy = torch.cat(pieces["ent"])
            extra = dict(options)
            if pieces["ref"]:
                extra["ref_logp"] = torch.cat(pieces["ref"]).to(dev)
            if extra.get("entropy_coef"):
                extra["entropy"] = entropy
            loss, metrics = loss_fn(
                objective, logp, torch.cat(pieces["old"]).to(dev), torch.cat(pieces["adv"]).to(dev),
                torch.ones_like(logp), torch.cat(pieces["roll"]).to(dev) if pieces["roll"] else None,
                cu_seqlens=torch.tensor(cu, device=dev), loss_agg=loss_agg,
                global_tokens=global_tokens, global_seqs=len(batch), **extra)
            metrics = {k: float(v) for k, v in metrics.items()}
            return loss * scale, {"tokens": int(logp.numel()), "metrics": metrics, "loss": float(loss.detach()),
                                  "entropy_sum": float(entropy.detach().sum())}

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        stored = self._run(micro_batches, loss_func, forward_only=False)
        metrics = self._reduce_metrics(stored)  # collective: every rank sees the same loss
        lr = self.optimizer.param_groups[0]["lr"]
        if math.isfinite(metrics["loss"]):
            ok, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
            self.step += 1
        else:  # a NaN/inf loss would poison the weights and Adam's moments: drop this update entirely
            ok, grad_norm = False, None
            self.optimizer.zero_grad()
        elapsed = time.perf_counter() - start
        metrics.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"), lr=lr,
                       update_ok=bool(ok), skipped_nonfinite=0 if math.isfinite(metrics["loss"]) else 1,
                       step_time_s=elapsed,
                       tokens_per_s=sum(len(s) for s in sequences) / max(elapsed, 1e-9))
        if self.route_hook is not None:  # routing replay: disagreement / fallback metrics (collective)
            metrics.update(self.route_hook.metrics())
        return metrics

    def _reduce_metrics(self, stored: list[dict]) -> dict:
        """Metrics of the whole batch from its micro-batches on every DP rank: the loss and other shares
        summed, *_min / *_max as minimum / maximum, everything else a token-weighted mean."""
        local = {"tokens": sum(d["tokens"] for d in stored), "loss": sum(d["loss"] for d in stored),
                 "entropy_sum": sum(d["entropy_sum"] for d in stored),
                 "each": [(d["tokens"], d["metrics"]) for d in stored if d["tokens"]]}
        parts = self._share_results([local])
        tokens = sum(p["tokens"] for p in parts)
        out = {"loss": sum(p["loss"] for p in parts), "entropy": sum(p["entropy_sum"] for p in parts) / max(tokens, 1),
               "response_tokens": tokens}
        each = [(n, m) for p in parts for n, m in p["each"]]  # (tokens, metrics) of every micro-batch
        for k in sorted({k for _, m in each for k in m} - out.keys()):
            values = [(n, m[k]) for n, m in each if k in m]
            if k in SHARE_METRICS:  # each micro-batch's value is its share of the batch's total
                out[k] = sum(v for _, v in values)
            elif k.endswith("_min"):
                out[k] = min(v for _, v in values)
            elif k.endswith("_max") or "max_abs" in k:
                out[k] = max(v for _, v in values)
            else:
                out[k] = sum(n * v for n, v in values) / max(tokens, 1)
        return out

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
        state["optimizer_saved"] = has_state
        dist_checkpointing.save(state, str(ckpt_dir))

    def _optimizer_has_state(self) -> bool:
        """Whether any rank's Adam has state (collective: every rank must save the same keys)."""
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        has = any(len(s) > 0 for opt in chained for s in opt.optimizer.state.values())
        flag = torch.tensor([1.0 if has else 0.0])
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def load(self, ckpt_dir, *, load_optimizer: bool = True) -> None:
        """Resume from `save`. The model reshards to any layout; optimizer state needs the same
        expert-parallel setting (EP=1 vs EP>1 chain a different number of Megatron optimizers), so
        load_optimizer=False loads only the weights (conversion, evaluation, a new run)."""
        from megatron.core import dist_checkpointing

        if not Path(ckpt_dir).is_dir():
            raise FileNotFoundError(f"ckpt_dir: {ckpt_dir} is not a folder")
        common = dist_checkpointing.load_common_state_dict(str(ckpt_dir)) if load_optimizer else {}
        with_optimizer = load_optimizer and common.get("optimizer_saved", True)  # False: saved before any step
        state = self._sharded_state(loading=True) if with_optimizer else {"model": self.module.sharded_state_dict()}
        loaded = dist_checkpointing.load(state, str(ckpt_dir))
        self.module.load_state_dict(loaded["model"], strict=False)
        if with_optimizer:
            self.optimizer.load_state_dict(loaded["optimizer"])
        if load_optimizer:
            self.scheduler.load_state_dict(common["scheduler"])
            self.step = int(common["step"])

    def _sharded_state(self, loading: bool = False) -> dict:
        model_sd = self.module.sharded_state_dict()
        return {"model": model_sd, "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=loading),
                "scheduler": self.scheduler.state_dict(), "step": self.step}

    def close(self) -> None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()


def _per_token(values, n: int, name: str) -> torch.Tensor:
    t = torch.as_tensor(values, dtype=torch.float32)
    if t.numel() != n:
        raise ValueError(f"{name}: expected {n} values (one per response token), got {t.numel()}")
    return t


def _check_sample(i: int, s: dict, vocab: int) -> None:
    for key in ("tokens", "prompt_len", "advantage", "old_logp"):
        if key not in s:
            raise ValueError(f"batch[{i}].{key}: missing")
    n, p = len(s["tokens"]), s["prompt_len"]
    if not 1 <= p < n:
        raise ValueError(f"batch[{i}].prompt_len: must be in [1, {n - 1}] for {n} tokens, got {p}")
    if min(s["tokens"]) < 0 or max(s["tokens"]) >= vocab:
        raise ValueError(f"batch[{i}].tokens: ids must be in [0, {vocab})")

