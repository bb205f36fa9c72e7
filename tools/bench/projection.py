"""`megapo bench projection`: predict RL step time and weight-sync time of a large MoE on N GPUs.

    megapo bench projection --model qwen3-30b-a3b --gpus 8 --out proj.json
    megapo bench projection --model qwen3-235b-a22b --gpus 64 --tp 4 --pp 4 --ep 8 --ib-gbps 400 --out p.json
    megapo bench projection --model qwen3-30b-a3b --gpus 8 --from-scaling benchmarks/results/scaling_cpu.json ...

An analytic model, not a measurement. Every number it uses is in the JSON's "assumptions" and in
docs/scaling.md; the pieces:

- model description (`ModelShape`): parameter counts (total, active, expert / non-expert), HF tensor
  count and FLOPs per token, from the architecture numbers (no weights needed);
- train step = compute (6 * active matmul params + attention, per token, at peak * mfu) + TP
  all-reduces (4 per layer) + EP all-to-alls (dispatch + combine, forward + backward) + DP gradient
  reduce + PP bubble ((pp-1)/m of the compute) + PP activation sends; no overlap of communication and
  compute unless --comm-overlap says so;
- old log-prob pass = the forward-only third of the above (no gradient reduce);
- weight sync = gather of TP/EP shards (NVLink or IB) + transport (colocated: device copy of the
  engine's share; disaggregated: NCCL broadcast of each PP stage's bytes over IB; or point-to-point
  resharding, each engine GPU receiving only its share, no gather) + the engine's per-tensor load overhead.

Generation time is not projected (it depends on the inference engine, response lengths and
batching, not on the learner layout).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from megapo.config import ConfigError, ParallelConfig
from megapo.layout import num_experts

# ----------------------------------------------------------------------------- model description


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only (MoE) transformer that parameter counts and FLOPs depend on."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0  # routed experts per MoE layer; 0 = dense MLP in every layer
    topk: int = 0
    moe_ffn: int = 0  # width of one expert's MLP
    dense_ffn: int = 0  # MLP width of a dense model
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k
    qkv_bias: bool = False  # Qwen2: biases on q, k, v
    tied_embeddings: bool = False

    # --- per layer
    @property
    def attention_params(self) -> int:
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        norm = 2 * self.head_dim if self.qk_norm else 0
        return q + kv + o + bias + norm

    @property
    def expert_params_per_layer(self) -> int:
        return self.experts * 3 * self.hidden * self.moe_ffn  # gate, up, down per expert

    @property
    def router_params_per_layer(self) -> int:
        return self.experts * self.hidden if self.experts else 0

    @property
    def dense_mlp_params_per_layer(self) -> int:
        return 0 if self.experts else 3 * self.hidden * self.dense_ffn

    @property
    def norm_params_per_layer(self) -> int:
        return 2 * self.hidden  # input and post-attention RMSNorm

    # --- whole model
    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)  # embed (+ untied lm_head)

    @property
    def expert_params(self) -> int:
        return self.layers * self.expert_params_per_layer

    @property
    def total_params(self) -> int:
        per_layer = (self.attention_params + self.expert_params_per_layer + self.router_params_per_layer
                     + self.dense_mlp_params_per_layer + self.norm_params_per_layer)
        return self.embedding_params + self.hidden + self.layers * per_layer  # + final norm

    @property
    def non_expert_params(self) -> int:
        return self.total_params - self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token uses (top-k of the experts), embeddings included."""
        inactive = (self.experts - self.topk) * 3 * self.hidden * self.moe_ffn * self.layers if self.experts else 0
        return self.total_params - inactive

    @property
    def matmul_active_params(self) -> int:
        """Active weights that take part in a matmul per token: attention, router, top-k experts or the
        dense MLP, lm_head. Not the embedding lookup, norms or biases."""
        attn = self.hidden * self.heads * self.head_dim * 2 + 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = self.topk * 3 * self.hidden * self.moe_ffn + self.router_params_per_layer if self.experts \
            else self.dense_mlp_params_per_layer
        return self.layers * (attn + mlp) + self.vocab * self.hidden

    def flops_per_token(self, attn_context: float, train: bool = True) -> float:
        """Training (forward + backward = 3x forward) or forward-only FLOPs per token. `attn_context`:
        mean number of keys a query attends to (about half the sequence length for causal attention)."""
        forward = 2 * self.matmul_active_params + 4 * self.layers * self.heads * self.head_dim * attn_context
        return 3 * forward if train else forward

    @property
    def hf_tensors(self) -> int:
        """Tensors in the HF checkpoint (per-expert tensors, as Qwen3-MoE/Mixtral store them)."""
        per_layer = 4 + (3 if self.qkv_bias else 0) + (2 if self.qk_norm else 0) + 2
        per_layer += 1 + 3 * self.experts if self.experts else 3
        return per_layer * self.layers + (1 if self.tied_embeddings else 2) + 1

    @classmethod
    def from_hf_config(cls, hf: dict, name: str = "") -> "ModelShape":
        """From a config.json dict; families by `model_type` (megapo's registry): qwen3_moe, qwen2, mixtral."""
        kind = hf.get("model_type")
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        common = dict(name=name or str(kind), layers=int(hf["num_hidden_layers"]), hidden=hidden, heads=heads,
                      kv_heads=int(hf.get("num_key_value_heads") or heads),
                      head_dim=int(hf.get("head_dim") or hidden // heads), vocab=int(hf["vocab_size"]),
                      tied_embeddings=bool(hf.get("tie_word_embeddings", False)))
        if kind == "qwen3_moe":
            if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
                raise ConfigError("model", "qwen3_moe with dense (mlp_only) layers is not described by ModelShape")
            return cls(experts=num_experts(hf), topk=int(hf["num_experts_per_tok"]),
                       moe_ffn=int(hf["moe_intermediate_size"]), qk_norm=True, **common)
        if kind == "mixtral":
            return cls(experts=num_experts(hf), topk=int(hf["num_experts_per_tok"]),
                       moe_ffn=int(hf["intermediate_size"]), **common)
        if kind == "qwen2":
            return cls(dense_ffn=int(hf["intermediate_size"]), qkv_bias=True, **common)
        raise ConfigError("model", f"model_type {kind!r} is not described; known: qwen3_moe, mixtral, qwen2")


# Published architectures (config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B).
MODELS: dict[str, ModelShape] = {
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                                vocab=151936, experts=128, topk=8, moe_ffn=768, qk_norm=True),
    "qwen3-235b-a22b": ModelShape("qwen3-235b-a22b", layers=94, hidden=4096, heads=64, kv_heads=4, head_dim=128,
                                  vocab=151936, experts=128, topk=8, moe_ffn=1536, qk_norm=True),
}

# The learner layout each model defaults to (Megatron order: TP innermost, then EP over TP*DP, PP outermost).
# engine_tp: GPUs of one inference engine (the 61 GB / 470 GB bf16 models need 2 / 8 GPUs of 80 GB with KV cache room).
DEFAULT_LAYOUT = {"qwen3-30b-a3b": {"tp": 1, "pp": 1, "ep": 8, "engine_tp": 2},
                  "qwen3-235b-a22b": {"tp": 4, "pp": 4, "ep": 8, "engine_tp": 8}}


# ----------------------------------------------------------------------------- assumptions


@dataclass
class Hardware:
    """Per-GPU throughput and link assumptions (H100 SXM defaults; sources in docs/scaling.md)."""

    peak_tflops: float = 989.0  # H100 SXM dense BF16 tensor-core peak
    mfu: float = 0.35  # fraction of peak the compute kernels reach (communication is modelled apart)
    nvlink_gbps: float = 3600.0  # per GPU per direction: NVLink4 18 links x 25 GB/s = 450 GB/s
    ib_gbps: float = 400.0  # per GPU: one ConnectX-7 NDR 400 Gb/s NIC per GPU (DGX H100)
    link_efficiency: float = 0.7  # bandwidth NCCL reaches on large messages / line rate
    copy_gbytes_per_s: float = 1500.0  # device-to-device copy (read + write of HBM3 at 3.35 TB/s)
    per_tensor_overhead_us: float = 30.0  # engine-side cost per weight tensor (Python, load_weights, IPC handle)
    gpus_per_node: int = 8
    comm_overlap: float = 0.0  # fraction of communication hidden behind compute (0 = none, conservative)

    def bytes_per_s(self, intra_node: bool) -> float:
        gbps = self.nvlink_gbps if intra_node else self.ib_gbps
        return gbps / 8 * 1e9 * self.link_efficiency


@dataclass
class Workload:
    """One RL step's batch (defaults: 512 sequences of 4096 tokens, e.g. 32 prompts x 16 samples)."""

    sequences: int = 512
    seq_len: int = 4096  # mean prompt + response tokens per sequence
    micro_batch_tokens: int = 8192  # packed tokens per micro-batch (sets the PP micro-batch count)
    grad_bytes: int = 4  # fp32 gradient reduce (Megatron's default main grads)
    act_bytes: int = 2  # bf16 activations on the wire
    weight_bytes: int = 2  # bf16 weights sent to the engines

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq_len


# the learner's own layout type: world size tp*pp*dp, ep divides tp*dp
Layout = ParallelConfig


def layout_block(layout: Layout) -> dict:
    """The layout as the projection's JSON writes it."""
    return {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "dp": layout.dp, "gpus": layout.world_size}


def check_projection(model: ModelShape, layout: Layout, hw: Hardware, work: Workload) -> None:
    """ConfigError naming the argument when the layout cannot run the model or a number is out of range."""
    for name in ("tp", "pp", "ep", "dp"):
        if getattr(layout, name) < 1:
            raise ConfigError(f"--{name}", f"must be >= 1, got {getattr(layout, name)}")
    if model.heads % layout.tp or model.kv_heads % layout.tp:
        raise ConfigError("--tp", f"tp={layout.tp} must divide heads={model.heads} and kv_heads={model.kv_heads}")
    if layout.pp > model.layers:
        raise ConfigError("--pp", f"pp={layout.pp} is more than layers={model.layers}")
    if model.experts and model.experts % layout.ep:
        raise ConfigError("--ep", f"ep={layout.ep} must divide experts={model.experts}")
    if (layout.tp * layout.dp) % layout.ep:
        raise ConfigError("--ep", f"ep={layout.ep} must divide tp*dp={layout.tp * layout.dp}")
    for name in ("peak_tflops", "nvlink_gbps", "ib_gbps", "copy_gbytes_per_s"):
        if not getattr(hw, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')}", f"must be > 0, got {getattr(hw, name)}")
    if not 0 < hw.mfu <= 1:
        raise ConfigError("--mfu", f"must be in (0, 1], got {hw.mfu}")
    if not 0 < hw.link_efficiency <= 1:
        raise ConfigError("--link-efficiency", f"must be in (0, 1], got {hw.link_efficiency}")
    if not 0 <= hw.comm_overlap <= 1:
        raise ConfigError("--comm-overlap", f"must be in [0, 1], got {hw.comm_overlap}")
    if hw.per_tensor_overhead_us < 0:
        raise ConfigError("--per-tensor-overhead-us", f"must be >= 0, got {hw.per_tensor_overhead_us}")
    for name in ("sequences", "seq_len", "micro_batch_tokens"):
        if getattr(work, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", f"must be >= 1, got {getattr(work, name)}")


# ----------------------------------------------------------------------------- the projection


def _spans_nodes(group_size: int, stride: int, hw: Hardware) -> bool:
    """A group of `group_size` ranks `stride` apart (Megatron's rank order) crosses a node boundary?"""
    return group_size > 1 and group_size * stride > hw.gpus_per_node


def _all_to_all_s(bytes_out: float, group: int, stride: int, hw: Hardware) -> float:
    """Time for each rank to send `bytes_out` spread evenly over the others of its group."""
    if group == 1 or bytes_out == 0:
        return 0.0
    if not _spans_nodes(group, stride, hw):
        return bytes_out / hw.bytes_per_s(True)
    local_peers = max(1, hw.gpus_per_node // stride)  # group members on this node (self included)
    inter_share = (group - local_peers) / (group - 1)
    return max(bytes_out * inter_share / hw.bytes_per_s(False), bytes_out * (1 - inter_share) / hw.bytes_per_s(True))


def _all_reduce_s(nbytes: float, group: int, stride: int, hw: Hardware) -> float:
    """Ring all-reduce: each rank sends and receives 2 (g-1)/g of the buffer."""
    if group == 1 or nbytes == 0:
        return 0.0
    return 2 * (group - 1) / group * nbytes / hw.bytes_per_s(not _spans_nodes(group, stride, hw))


def project_step(model: ModelShape, layout: Layout, hw: Hardware, work: Workload) -> dict:
    """Seconds of one train pass and one old-log-prob pass over `work` (see module docstring)."""
    tp, pp, ep, dp, n = layout.tp, layout.pp, layout.ep, layout.dp, layout.world_size
    tokens = work.tokens
    ctx = work.seq_len / 2  # causal: a query sees half the sequence on average
    achieved = hw.peak_tflops * 1e12 * hw.mfu
    train_flops = tokens * model.flops_per_token(ctx, train=True)
    # uneven PP (94 layers on 4 stages): the stage with ceil(layers/pp) layers sets the pace
    layers_per_stage = math.ceil(model.layers / pp)
    imbalance = layers_per_stage * pp / model.layers
    compute = train_flops / (n * achieved) * imbalance
    tokens_per_replica = tokens / dp
    micro_batches = max(1, math.ceil(tokens_per_replica / work.micro_batch_tokens))
    # TP (sequence parallel): all-gather + reduce-scatter around attention and MLP = 2 all-reduces
    # forward, 2 backward, of [tokens, hidden] activations, per layer of this stage.
    tp_bytes = tokens_per_replica * model.hidden * work.act_bytes
    tp_comm = 4 * layers_per_stage * _all_reduce_s(tp_bytes, tp, 1, hw)
    # EP: each rank dispatches its tokens' top-k copies and gets them back (combine), forward and backward.
    ep_comm = 0.0
    if model.experts and ep > 1:
        local_tokens = tokens / (dp * tp)
        a2a_bytes = local_tokens * model.topk * model.hidden * work.act_bytes * (ep - 1) / ep
        ep_comm = 4 * layers_per_stage * _all_to_all_s(a2a_bytes, ep, 1, hw)
    # DP: gradient reduce once per step; non-expert grads over dp (stride tp), expert grads over
    # expert-DP = tp*dp/ep ranks (stride ep), each rank holding its TP/EP/PP share.
    dense_grads = model.non_expert_params / (tp * pp) * work.grad_bytes
    expert_grads = model.expert_params / (ep * pp) * work.grad_bytes
    edp = tp * dp // ep
    dp_comm = _all_reduce_s(dense_grads, dp, tp, hw) + _all_reduce_s(expert_grads, edp, ep, hw)
    # PP: 1F1B bubble of (pp-1) micro-batch slots; activations (and their grads) cross each stage boundary.
    bubble = compute * (pp - 1) / micro_batches
    pp_bytes = 2 * micro_batches * work.micro_batch_tokens / tp * model.hidden * work.act_bytes
    pp_comm = pp_bytes / hw.bytes_per_s(not _spans_nodes(pp, tp * dp, hw)) if pp > 1 else 0.0
    comm = tp_comm + ep_comm + dp_comm + pp_comm
    train_total = compute + bubble + (1 - hw.comm_overlap) * comm
    fwd_compute = tokens * model.flops_per_token(ctx, train=False) / (n * achieved) * imbalance
    fwd_comm = (tp_comm + ep_comm + pp_comm) / 2  # forward half, no gradients
    logp_total = fwd_compute * (1 + (pp - 1) / micro_batches) + (1 - hw.comm_overlap) * fwd_comm
    return {
        "tokens": tokens, "micro_batches_per_replica": micro_batches, "pp_stage_imbalance": imbalance,
        "train_flops": train_flops, "flops_per_token_train": model.flops_per_token(ctx, train=True),
        "train": {"compute_s": compute, "pp_bubble_s": bubble, "tp_comm_s": tp_comm, "ep_comm_s": ep_comm,
                  "dp_grad_comm_s": dp_comm, "pp_p2p_s": pp_comm, "total_s": train_total,
                  "tokens_per_s_per_gpu": tokens / train_total / n,
                  "mfu_end_to_end": train_flops / (train_total * n * hw.peak_tflops * 1e12)},
        "old_logp": {"compute_s": fwd_compute, "comm_s": fwd_comm, "total_s": logp_total},
        "train_plus_old_logp_s": train_total + logp_total,
    }


def project_weight_sync(model: ModelShape, layout: Layout, hw: Hardware, work: Workload,
                        engine_tp: int = 1) -> dict:
    """Seconds to hand the full bf16 model to the engines, for the two transports megapo has.

    gather: shards to full HF tensors (non-expert over TP, experts over EP), each PP stage in parallel;
    colocated (bucketed CUDA IPC / tensor transport): each GPU's engine copies its 1/engine_tp share;
    broadcast (disaggregated, NCCL): each PP stage root broadcasts its stage over IB to the engines
    (a pipelined broadcast costs ~ bytes / link bandwidth whatever the number of receivers).
    Both add the engine's per-tensor load overhead for every HF tensor."""
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    total_bytes = model.total_params * work.weight_bytes
    dense_stage = model.non_expert_params * work.weight_bytes / pp
    expert_stage = model.expert_params * work.weight_bytes / pp
    gather = 0.0
    if tp > 1:
        gather += dense_stage * (tp - 1) / tp / hw.bytes_per_s(not _spans_nodes(tp, 1, hw))
    if ep > 1:
        gather += expert_stage * (ep - 1) / ep / hw.bytes_per_s(not _spans_nodes(ep, 1, hw))
    # colocated: PP stages broadcast to every rank too (each engine needs every layer)
    pp_fill = total_bytes * (pp - 1) / pp / hw.bytes_per_s(not _spans_nodes(pp, layout.tp * layout.dp, hw)) \
        if pp > 1 else 0.0
    overhead = model.hf_tensors * hw.per_tensor_overhead_us * 1e-6
    copy = total_bytes / engine_tp / (hw.copy_gbytes_per_s * 1e9)
    broadcast = total_bytes / pp / hw.bytes_per_s(False)
    # point-to-point resharding (each engine GPU pulls only its 1/engine_tp share straight from the
    # learner ranks that hold it, no gather): bound by what one engine GPU receives, over IB when the
    # engines have their own nodes, over NVLink when they share the learner's GPUs.
    share = total_bytes / engine_tp
    return {
        "bytes": total_bytes, "hf_tensors": model.hf_tensors, "engine_tp": engine_tp,
        "gather_s": gather, "engine_overhead_s": overhead,
        "colocated_ipc": {"gather_s": gather, "pp_fill_s": pp_fill, "copy_s": copy, "engine_overhead_s": overhead,
                          "total_s": gather + pp_fill + copy + overhead},
        "broadcast_ib": {"gather_s": gather, "transfer_s": broadcast, "engine_overhead_s": overhead,
                         "total_s": gather + broadcast + overhead,
                         "effective_gb_per_s": total_bytes / (gather + broadcast + overhead) / 1e9},
        "p2p_resharded": {"transfer_s": share / hw.bytes_per_s(False), "engine_overhead_s": overhead,
                          "total_s": share / hw.bytes_per_s(False) + overhead,
                          "total_if_colocated_s": share / hw.bytes_per_s(True) + overhead},
    }


# Published weight-sync numbers the projection is compared with. Each is projected for its own learner
# layout (where the source gives one) with this run's hardware assumptions; `confirmed` says whether the
# number was found in the cited source (docs/scaling.md has the details).
PUBLISHED = [
    {"model": "qwen3-30b-a3b", "system": "NeMo-RL (Megatron -> vLLM), H100", "transport": "colocated_ipc",
     "what": "refit, colocated CUDA IPC", "seconds_low": 0.74, "seconds_high": 1.0,
     "layout": {"tp": 2, "pp": 1, "ep": 8, "gpus": 32}, "engine_tp": 4,
     "layout_source": "NeMo-RL v0.4 performance summary recipe for Qwen3-30B-A3B: train [TP2,EP8], 32 GPUs, gen TP4",
     "source": "issue brief; NeMo-RL issue #1004 (refit time chart of grpo-qwen3-30ba3b-8n8g-megatron)",
     "confirmed": False},
    {"model": "qwen3-30b-a3b", "system": "NeMo-RL NCCL-Xfer refit (Megatron EP8xPP2 -> vLLM TP2xDP8)",
     "transport": "p2p_resharded", "what": "refit, NCCL point-to-point resharding", "seconds_low": 0.50,
     "seconds_high": 0.55, "layout": {"tp": 1, "pp": 2, "ep": 8, "gpus": 16}, "engine_tp": 2,
     "layout_source": "the PR's table", "source": "github.com/NVIDIA-NeMo/RL/pull/2808", "confirmed": True},
    {"model": "qwen3-235b-a22b", "system": "miles (Megatron -> SGLang), NCCL broadcast", "transport": "broadcast_ib",
     "what": "weight sync, disaggregated NCCL broadcast", "seconds_low": 10.75, "seconds_high": 10.75,
     "layout": {"tp": 4, "pp": 4, "ep": 8, "gpus": 64}, "engine_tp": 8,
     "layout_source": "not given with the number: megapo's default 235B layout assumed",
     "source": "issue brief (miles); not located by this search", "confirmed": False},
    {"model": "qwen3-235b-a22b", "system": "NeMo-RL NCCL-Xfer refit (Megatron TP4xPP8xEP16 -> vLLM TP8xDP16)",
     "transport": "p2p_resharded", "what": "refit, NCCL point-to-point resharding", "seconds_low": 4.56,
     "seconds_high": 4.85, "layout": {"tp": 4, "pp": 8, "ep": 16, "gpus": 128}, "engine_tp": 8,
     "layout_source": "the PR's table", "source": "github.com/NVIDIA-NeMo/RL/pull/2808", "confirmed": True},
]


# ----------------------------------------------------------------------------- measured inputs


def measured_inputs(scaling: dict) -> dict:
    """Per-device compute throughput and per-tensor sync overhead measured by `megapo bench scaling`:
    from its single-process layout of the largest size (or any single-process layout)."""
    singles = [r for r in scaling["results"] if r["world_size"] == 1]
    if not singles:
        raise ConfigError("--from-scaling", "the scaling JSON has no single-process layout (tp1) to take costs from")
    best = max(singles, key=lambda r: r["model"]["total_params"])
    strong = best["strong"]
    achieved = strong["train_flops"] / strong["time_s"]["train"]  # FLOP/s of the train pass on one device
    sync_per_tensor = strong["time_s"]["weight_sync"] / best["model"]["hf_tensors"]
    layers = best["model"]["layers"]
    return {"source_layout": best["layout"], "source_size": best["size"], "device": scaling.get("device"),
            "achieved_tflops_per_device": achieved / 1e12,
            "train_s_per_layer_per_1k_tokens": strong["time_s"]["train"] / layers / (strong["tokens"] / 1000),
            "sync_s_per_tensor": sync_per_tensor}


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    hw, work = Hardware(), Workload()
    parser.add_argument("--model", default="qwen3-30b-a3b", help=f"one of {', '.join(MODELS)}")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs of the learner (default: 8 for 30B, 64 for 235B)")
    parser.add_argument("--tp", type=int, default=None)
    parser.add_argument("--pp", type=int, default=None)
    parser.add_argument("--ep", type=int, default=None)
    parser.add_argument("--engine-tp", type=int, default=None,
                        help="GPUs per inference engine (default 2 for 30B, 8 for 235B)")
    parser.add_argument("--link-gbps", type=float, default=None,
                        help="set every link (NVLink and IB) to this many Gb/s per GPU (a what-if)")
    parser.add_argument("--nvlink-gbps", type=float, default=hw.nvlink_gbps, help="intra-node Gb/s per GPU per direction")
    parser.add_argument("--ib-gbps", type=float, default=hw.ib_gbps, help="inter-node Gb/s per GPU")
    parser.add_argument("--link-efficiency", type=float, default=hw.link_efficiency)
    parser.add_argument("--peak-tflops", type=float, default=hw.peak_tflops, help="dense BF16 TFLOP/s per GPU")
    parser.add_argument("--mfu", type=float, default=hw.mfu, help="fraction of peak reached by compute kernels")
    parser.add_argument("--copy-gbytes-per-s", type=float, default=hw.copy_gbytes_per_s)
    parser.add_argument("--per-tensor-overhead-us", type=float, default=hw.per_tensor_overhead_us)
    parser.add_argument("--gpus-per-node", type=int, default=hw.gpus_per_node)
    parser.add_argument("--comm-overlap", type=float, default=hw.comm_overlap)
    parser.add_argument("--sequences", type=int, default=work.sequences)
    parser.add_argument("--seq-len", type=int, default=work.seq_len)
    parser.add_argument("--micro-batch-tokens", type=int, default=work.micro_batch_tokens)
    parser.add_argument("--from-scaling", default=None,
                        help="a `megapo bench scaling` JSON: take compute throughput and per-tensor sync cost from it")
    parser.add_argument("--out", required=True, help="JSON file written")


def build(args: argparse.Namespace) -> tuple[ModelShape, Layout, Hardware, Workload, dict | None]:
    if args.model not in MODELS:
        raise ConfigError("--model", f"unknown model {args.model!r}; choose from {', '.join(MODELS)}")
    model = MODELS[args.model]
    defaults = DEFAULT_LAYOUT[args.model]
    gpus = args.gpus if args.gpus is not None else {"qwen3-30b-a3b": 8, "qwen3-235b-a22b": 64}[args.model]
    tp = args.tp if args.tp is not None else defaults["tp"]
    pp = args.pp if args.pp is not None else defaults["pp"]
    if gpus < 1 or gpus % (tp * pp):
        raise ConfigError("--gpus", f"{gpus} GPUs is not a multiple of tp*pp = {tp}*{pp}")
    dp = gpus // (tp * pp)
    ep = args.ep if args.ep is not None else math.gcd(defaults["ep"], tp * dp)
    hw = Hardware(peak_tflops=args.peak_tflops, mfu=args.mfu, nvlink_gbps=args.nvlink_gbps, ib_gbps=args.ib_gbps,
                  link_efficiency=args.link_efficiency, copy_gbytes_per_s=args.copy_gbytes_per_s,
                  per_tensor_overhead_us=args.per_tensor_overhead_us, gpus_per_node=args.gpus_per_node,
                  comm_overlap=args.comm_overlap)
    if args.link_gbps is not None:
        if not args.link_gbps > 0:
            raise ConfigError("--link-gbps", f"must be > 0, got {args.link_gbps}")
        hw = replace(hw, nvlink_gbps=args.link_gbps, ib_gbps=args.link_gbps)
    if args.gpus_per_node < 1:
        raise ConfigError("--gpus-per-node", f"must be >= 1, got {args.gpus_per_node}")
    if args.engine_tp is None:
        args.engine_tp = defaults["engine_tp"]
    if args.engine_tp < 1:
        raise ConfigError("--engine-tp", f"must be >= 1, got {args.engine_tp}")
    work = Workload(sequences=args.sequences, seq_len=args.seq_len, micro_batch_tokens=args.micro_batch_tokens)
    layout = Layout(tp=tp, pp=pp, ep=ep, dp=dp)
    check_projection(model, layout, hw, work)
    measured = None
    if args.from_scaling:
        path = Path(args.from_scaling)
        if not path.is_file():
            raise ConfigError("--from-scaling", f"{path} is not a file")
        measured = measured_inputs(json.loads(path.read_text()))
        # measured per-device throughput replaces peak * mfu (the MFU becomes measured / peak, so end-to-end
        # MFU stays relative to --peak-tflops); measured per-tensor sync cost replaces the assumption
        achieved = measured["achieved_tflops_per_device"]
        if achieved > hw.peak_tflops:
            raise ConfigError("--from-scaling", f"measured {achieved:.1f} TFLOP/s exceeds --peak-tflops {hw.peak_tflops}")
        hw = replace(hw, mfu=achieved / hw.peak_tflops, per_tensor_overhead_us=measured["sync_s_per_tensor"] * 1e6)
    return model, layout, hw, work, measured


def project(model: ModelShape, layout: Layout, hw: Hardware, work: Workload, engine_tp: int = 1,
            measured: dict | None = None) -> dict:
    step = project_step(model, layout, hw, work)
    sync = project_weight_sync(model, layout, hw, work, engine_tp)
    comparisons = []
    for pub in PUBLISHED:
        if pub["model"] != model.name:
            continue
        lay = pub["layout"]
        theirs = Layout(tp=lay["tp"], pp=lay["pp"], ep=lay["ep"], dp=lay["gpus"] // (lay["tp"] * lay["pp"]))
        theirs_sync = project_weight_sync(model, theirs, hw, work, pub["engine_tp"])[pub["transport"]]
        predicted = theirs_sync["total_s"]
        mid = (pub["seconds_low"] + pub["seconds_high"]) / 2
        comparisons.append({**pub, "predicted_s": predicted, "ratio_predicted_over_published": predicted / mid,
                            "predicted_if_colocated_s": theirs_sync.get("total_if_colocated_s")})
    return {
        "benchmark": "projection",
        "note": "analytic projection, not a measurement; every input is under 'assumptions'",
        "model": {**asdict(model), "total_params": model.total_params, "active_params": model.active_params,
                  "expert_params": model.expert_params, "non_expert_params": model.non_expert_params,
                  "matmul_active_params": model.matmul_active_params, "hf_tensors": model.hf_tensors,
                  "bf16_bytes": model.total_params * 2},
        "layout": {**layout_block(layout), "expert_tp": 1},
        "assumptions": {"hardware": asdict(hw), "workload": {**asdict(work), "tokens": work.tokens},
                        "measured_from_scaling": measured,
                        "model_of_time": "train = compute + pp bubble + (1 - comm_overlap) * (tp + ep + dp + pp comm); "
                                         "compute = tokens * (6 * matmul_active_params + 12 * layers * heads * head_dim"
                                         " * seq_len/2) / (gpus * peak * mfu); generation not projected"},
        "step": step,
        "weight_sync": sync,
        "published": comparisons,
    }


def main(argv: list[str] | None = None) -> int:
    from megapo.cli import report_errors

    parser = argparse.ArgumentParser(prog="megapo bench projection", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return report_errors(parser.prog, run, parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    model, layout, hw, work, measured = build(args)
    result = project(model, layout, hw, work, args.engine_tp, measured)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    t, w = result["step"]["train"], result["weight_sync"]
    p2p = w["p2p_resharded"]
    print(f"{model.name}: {model.total_params / 1e9:.2f}B params ({model.active_params / 1e9:.2f}B active) on "
          f"{layout.world_size} GPUs tp{layout.tp} pp{layout.pp} ep{layout.ep} dp{layout.dp}")
    print(f"  train {t['total_s']:.2f} s (compute {t['compute_s']:.2f}, ep {t['ep_comm_s']:.2f}, "
          f"tp {t['tp_comm_s']:.2f}, dp {t['dp_grad_comm_s']:.2f}, bubble {t['pp_bubble_s']:.2f}),"
          f" old-logp {result['step']['old_logp']['total_s']:.2f} s, MFU {t['mfu_end_to_end']:.3f}")
    print(f"  weight sync: colocated {w['colocated_ipc']['total_s']:.2f} s, broadcast {w['broadcast_ib']['total_s']:.2f}"
          f" s, p2p resharded {p2p['total_s']:.2f} s (colocated {p2p['total_if_colocated_s']:.2f})"
          f" ({w['bytes'] / 1e9:.1f} GB, {w['hf_tensors']} tensors)")
    for c in result["published"]:
        lay = c["layout"]
        print(f"  vs {c['system']} ({'confirmed' if c['confirmed'] else 'unconfirmed'}; tp{lay['tp']} pp{lay['pp']} "
              f"ep{lay['ep']} on {lay['gpus']}): {c['seconds_low']}-{c['seconds_high']} s -> predicted "
              f"{c['predicted_s']:.2f} s ({c['transport']}, ratio {c['ratio_predicted_over_published']:.2f})")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
