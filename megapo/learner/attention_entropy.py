"""Attention entropy at each response token (Li, Wu, Bao and Wu 2026, Not All Tokens Learn Alike: Attention Entropy
Reveals Heterogeneous Signals in RL Reasoning, arXiv:2605.07660): for the query at the position that predicts a
response token, at one layer, the Shannon entropy of its attention distribution averaged over the heads,
H = −Σ_j ā_j log ā_j with ā_j = (1/heads) Σ_h a_hj over the keys j the mask lets the query see (the paper's
"averaged attention distribution at a fixed layer"; the stage attention_entropy normalises by log of the number of
those keys).

How it is read: one forward-only pass (Learner.response_attention_entropy) with a forward hook on the chosen layer's
core attention, set for that pass only and removed after it, so the default attention path is untouched and pays
nothing. The hook recomputes the layer's probabilities from its query, key and mask (compat.grouped_attention_probs:
the same scale, grouping and mask bias as the local spec's grouped core attention), sums them over this rank's heads
and all-reduces that sum over the TP group (each rank holds heads/tp of them; under sequence parallel the core
attention already sees the whole sequence). Under PP only the stage that holds the layer records; its values go to
the other stages after the pass. Packed rows and shared prefixes need nothing more: the mask is the one the forward
gets, so a query sees exactly its own sequence's earlier keys (a shared prompt's slots and its response's own).

Cost, only in that pass: the layer's probabilities once more, [rows, heads/tp, W, W] fp32 per micro-batch (from the
layer's own query and key, in fp32 also under bf16, where the forward's scores are bf16), and one TP all-reduce of
their head sum, [rows, W, W].

What cannot give the entropies is refused (check_attention_kind), naming the reason: Transformer Engine's fused
attention (GPU; it keeps no probabilities), multi-latent attention, attention sinks and a sliding-window layer
(their probabilities are not the grouped path's softmax).
"""

from __future__ import annotations

import numpy as np
import torch

from megapo import compat


def layer_error(spec, layer: int) -> str | None:
    """Why `layer` (0-based, negative from the end) names no layer of the model, or None."""
    if isinstance(layer, bool) or not isinstance(layer, int) or not -spec.num_layers <= layer < spec.num_layers:
        return f"{layer!r} is not one of the model's {spec.num_layers} layers (0 .. {spec.num_layers - 1}, or " \
               "negative from the end)"
    return None


def attention_kind_error(spec, layer: int, use_te: bool) -> str | None:
    """Why the attention entropies at `layer` (a layer of the model: layer_error) cannot be read from this model on
    this machine, or None."""
    if use_te:
        return "Transformer Engine's fused attention (the GPU layer spec) keeps no attention probabilities"
    if spec.mla is not None:
        return "multi-latent attention is not read by the recording path (its probabilities are not recomputed)"
    if spec.attention_sinks:
        return "attention sinks add a logit to each softmax row: the recorded grouped softmax would not be it"
    window = spec.window_layers[layer] if spec.window_layers else spec.sliding_window > 0
    if window:
        return f"layer {layer} is a sliding-window layer (its window is added to the mask by another path)"
    return None


def check_attention_kind(spec, layer: int, use_te: bool, where: str) -> None:
    """ValueError naming `where` (the caller's stage or argument) when attention_kind_error says why not."""
    bad_layer = layer_error(spec, layer)
    if bad_layer is not None:
        raise ValueError(f"{where}: {bad_layer}")
    why = attention_kind_error(spec, layer, use_te)
    if why is not None:
        raise ValueError(f"{where}: attention entropies cannot be read: {why}")


def _entropy_of_mean(head_sum: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, sq, sk] probabilities summed over all heads -> [b, sq] float64 entropy of their mean (0 log 0 = 0)."""
    mean = head_sum.double() / heads
    return -torch.xlogy(mean, mean).sum(-1)


class EntropyRecorder:
    """A forward hook on one core attention: each call appends [b, sq] float64 entropies (all heads, TP-reduced)."""

    def __init__(self, heads: int):
        self.heads = heads
        self.records: list[torch.Tensor] = []

    def __call__(self, module, args, kwargs, output):
        from megatron.core import parallel_state as ps

        query, key = args[0], args[1]
        mask = args[3] if len(args) > 3 else kwargs.get("attention_mask")
        probs = compat.grouped_attention_probs(module, query, key, mask, kwargs.get("attn_mask_type"))
        head_sum = probs.sum(1)  # this rank's heads
        if ps.get_tensor_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(head_sum, group=ps.get_tensor_model_parallel_group())
        self.records.append(_entropy_of_mean(head_sum, self.heads))
        return None


def _local_core_attention(module, layer: int):
    """The core attention of global layer `layer` (0-based) when this pipeline stage holds it, else None."""
    for block in module.decoder.layers:
        if block.layer_number - 1 == layer:  # Megatron's layer_number is global and 1-based
            return block.self_attention.core_attention
    return None


def _forward_responses(learner, sequences: list[list[int]], lengths: np.ndarray, prompt_lens: list[int],
                       routes) -> list:
    """One forward-only pass of the sequences (checked by the learner: their `lengths`) as Learner._response_pass
    packs them (shared prompts, replayed routes); the logits are not read. Returns this rank's micro-batches in the
    order they ran."""
    micro_batches = learner._response_micro_batches(sequences, prompt_lens, routes, lengths)
    learner.model.eval()
    try:
        with torch.no_grad():
            learner._run(micro_batches, lambda mb, logits: (logits.new_zeros(()), {}), forward_only=True)
    finally:
        learner.model.train()
    return micro_batches


def response_attention_entropy(learner, sequences: list[list[int]], lengths: np.ndarray, prompt_lens: list[int],
                               layer: int = -1, routes=None) -> list[torch.Tensor]:
    """Per sequence, the attention entropy (nats, not normalised) at each response token of layer `layer` (0-based;
    negative from the end): the queries at positions prompt_len-1 .. len-2, whose logits predict the response;
    [len - prompt_len] float64, CPU, on every rank (collective). `lengths`: the sequences' lengths, which the
    learner checked (Learner.response_attention_entropy). Packing and routes as in Learner.logprobs."""
    from megatron.core import parallel_state as ps

    spec = learner.spec
    check_attention_kind(spec, layer, learner.backend.use_te, "layer")
    layer = layer % spec.num_layers
    target = _local_core_attention(learner.module, layer)
    recorder = EntropyRecorder(spec.num_heads)
    handle = target.register_forward_hook(recorder, with_kwargs=True) if target is not None else None
    try:
        micro_batches = _forward_responses(learner, sequences, lengths, prompt_lens, routes)
    finally:
        if handle is not None:
            handle.remove()
    local = None
    if target is not None:
        if len(recorder.records) != len(micro_batches):
            raise RuntimeError(f"layer {layer}: recorded {len(recorder.records)} forwards for "
                               f"{len(micro_batches)} micro-batches")
        local = [(mb.order, rec.reshape(-1)[mb.select.to(rec.device)].cpu(), mb.sizes)
                 for mb, rec in zip(micro_batches, recorder.records) if mb.order]
    if ps.get_pipeline_model_parallel_world_size() > 1:  # the stage holding the layer has them
        gathered = [None] * ps.get_pipeline_model_parallel_world_size()
        torch.distributed.all_gather_object(gathered, local, group=ps.get_pipeline_model_parallel_group())
        local = next(part for part in gathered if part is not None)
    items = [pair for order, values, sizes in local for pair in zip(order, torch.split(values, sizes))]
    if ps.get_data_parallel_world_size() > 1:
        gathered = [None] * ps.get_data_parallel_world_size()
        torch.distributed.all_gather_object(gathered, items, group=ps.get_data_parallel_group())
        items = [item for part in gathered for item in part]
    by_index = dict(items)
    return [by_index[i] for i in range(len(sequences))]
