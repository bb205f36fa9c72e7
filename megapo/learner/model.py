"""Build a Megatron-core GPT/MoE model for a `ModelSpec` under a `ParallelConfig`.

- process groups: gloo on CPU, nccl on GPU; Megatron's parallel_state is initialised here;
- layer spec: Transformer Engine's (optionally FP8) when TE imports and a GPU is present, otherwise
  Megatron's local spec (torch modules, runs on CPU);
- sequence parallel is on whenever TP > 1 (Megatron requires it for MoE with TP; for dense models it
  is equivalent and keeps one code path);
- experts: expert-tensor-parallel size 1 when EP > 1 (experts are split over EP, not TP), else TP.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile

import torch
import torch.nn.functional as F

from megapo import compat

compat.before_megatron()  # before the first Megatron import of a learner process (torch.compile's CPU stand-in)

from megapo.config import ConfigError, ParallelConfig  # noqa: E402
from megapo.learner.backend import Backend, detect_backend  # noqa: F401 (re-exported)
from megapo.learner.precision import Precision
from megapo.models.family import ModelSpec, padded_vocab
from megapo.net import free_port


def expert_tp(parallel: ParallelConfig, spec: ModelSpec | None = None) -> int:
    """Experts split over EP, else over TP; never with expert biases (Megatron supports those only at
    expert-TP 1: the experts are then whole on every TP rank)."""
    if parallel.ep > 1 or (spec is not None and spec.linear_bias and spec.num_experts):
        return 1
    return parallel.tp


def init_distributed(parallel: ParallelConfig, backend: Backend, seed: int, timeout_s: int = 600,
                     spec: ModelSpec | None = None) -> None:
    """Start torch.distributed (from torchrun's env, or as a single process) and Megatron's groups."""
    from megatron.core import parallel_state, tensor_parallel

    compat.apply()
    if not torch.distributed.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
            init_method = "env://"
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        else:
            init_method = f"tcp://127.0.0.1:{free_port()}"
            rank, world = 0, 1
        if backend.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.distributed.init_process_group(
            backend.dist_backend, init_method=init_method, rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s))
    world = torch.distributed.get_world_size()
    if world != parallel.world_size:
        raise ValueError(f"parallel: world size {world} != tp*pp*dp = {parallel.tp}*{parallel.pp}*{parallel.dp}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=expert_tp(parallel, spec),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def layout_initialized(parallel: ParallelConfig) -> bool:
    """Whether Megatron's groups exist already (a learner made them); ValueError if for another layout."""
    from megatron.core import parallel_state as ps

    if not (torch.distributed.is_initialized() and ps.model_parallel_is_initialized()):
        return False
    have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(), ps.get_data_parallel_world_size())
    want = (parallel.tp, parallel.pp, parallel.ep, parallel.dp)
    if have != want:
        raise ValueError(f"parallel: the process groups are tp, pp, ep, dp = {have}; this model asks for {want}")
    return True


def variable_seq_lengths(spec: ModelSpec, parallel: ParallelConfig) -> bool:
    return parallel.pp > 1 and not (spec.num_experts and parallel.dispatcher == "allgather")


def needs_equal_rows(spec: ModelSpec, parallel: ParallelConfig) -> bool:
    """The allgather dispatcher all-gathers tokens over the EP group with equal-size collectives, so
    every rank's micro-batch must have the same number of tokens (pad rows to one width)."""
    return bool(spec.num_experts) and parallel.dispatcher == "allgather"


def transformer_config(spec: ModelSpec, parallel: ParallelConfig, backend: Backend, *,
                       routing_replay: bool = False, precision: Precision = Precision()):
    from megatron.core.transformer import TransformerConfig

    precision.check_hardware(use_te=backend.use_te)

    moe = spec.num_experts > 0
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        qk_layernorm=spec.qk_norm,
        add_bias_linear=False,  # also avoids an in-place-on-view error in local experts
        add_qkv_bias=spec.qkv_bias,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        # fused kernels are CUDA-only; with TE they come from TE instead
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=compat.rope_fused() and spec.mla is None,  # CPU: compat's RoPE pass; TE: unfused
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=expert_tp(parallel, spec),
        sequence_parallel=parallel.tp > 1,
        **precision.transformer_fields(),  # params/pipeline dtype, bf16 / fp16, FP8 format and recipe
        # batched p2p calls torch.cuda.synchronize on CPU
        batch_p2p_sync=backend.device == "cuda",
        # Packed rows differ in length; pipelines then exchange shapes first. Megatron refuses this
        # with the allgather dispatcher: there the learner pads every row to one width instead.
        variable_seq_lengths=variable_seq_lengths(spec, parallel),
        moe_token_dispatcher_type="alltoall",  # Megatron's default (allgather) refuses variable lengths
        use_cpu_initialization=backend.device == "cpu",
        # Initialisation also sets the tensor-parallel attributes (partition dim) that grad-norm,
        # checkpointing and weight loading rely on, so keep it on although HF weights overwrite it.
        perform_initialization=True,
        # Off on CPU too: there its one effect is the embedding's lookup, weight[ids] instead of F.embedding, whose
        # CPU backward (index_put_ with accumulate) adds rows from racing threads, so the same seed gave different
        # runs; F.embedding's CPU backward sums each row in a fixed order (tests/test_determinism.py)
        deterministic_mode=False,
    )
    kwargs.update(attention_and_mlp_fields(spec))
    if parallel.recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if moe:
        kwargs.update(
            num_moe_experts=spec.num_experts,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_router_topk=spec.topk,
            moe_router_pre_softmax=spec.router_pre_softmax,
            moe_router_load_balancing_type="none",  # RL fine-tuning: no auxiliary loss
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type=parallel.dispatcher,
            moe_grouped_gemm=backend.use_te,
            moe_router_dtype="fp32",
            moe_permute_fusion=False,
            moe_enable_routing_replay=routing_replay,
            **router_fields(spec),
        )
    if spec.mla is not None:
        return mla_config(spec, kwargs, backend)
    config = TransformerConfig(**kwargs)
    if spec.yarn is not None:
        set_yarn(config, spec.yarn)
    return config


def set_yarn(config, yarn) -> None:
    """YaRN on a plain TransformerConfig (only MLA's config declares these fields): GPTModel's
    YarnRotaryEmbedding reads them, and attention multiplies cos/sin by 0.1 ln(factor) + 1 (yarn_mscale and
    yarn_mscale_all_dim None: transformers' attention_factor without mscale keys)."""
    config.yarn_rotary_scaling_factor = yarn.factor
    config.yarn_original_max_position_embeddings = yarn.original_max_positions
    config.yarn_beta_fast = yarn.beta_fast
    config.yarn_beta_slow = yarn.beta_slow
    config.yarn_mscale = None
    config.yarn_mscale_all_dim = None
    config.yarn_correction_range_round_to_int = yarn.truncate


def router_fields(spec: ModelSpec) -> dict:
    """Megatron's router and MoE-layer switches for the spec's sigmoid / biased / grouped router, shared
    experts and dense layers (empty for a plain softmax router on every layer)."""
    fields: dict = {}
    if spec.router_score != "softmax":
        fields["moe_router_score_function"] = spec.router_score
    if spec.router_expert_bias:
        # RL fine-tuning keeps the pretrained bias: no aux-loss-free balancing updates (rate 0)
        fields.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)
    if spec.router_groups:
        fields.update(moe_router_num_groups=spec.router_groups, moe_router_group_topk=spec.router_group_topk)
    if spec.router_scaling != 1.0:
        fields["moe_router_topk_scaling_factor"] = spec.router_scaling
    if spec.shared_expert_ffn:
        fields["moe_shared_expert_intermediate_size"] = spec.shared_expert_ffn
    if spec.moe_layers and not all(spec.moe_layers):
        fields["moe_layer_freq"] = [int(m) for m in spec.moe_layers]
    return fields


def attention_and_mlp_fields(spec: ModelSpec) -> dict:
    """Megatron's switches for the spec's linear biases, attention sinks, sliding-window layers, expert activation
    and clamped GLU (empty for bias-free full attention with a plain SiLU GLU)."""
    from megatron.core.activations import quick_gelu

    fields: dict = {}
    if spec.linear_bias:
        fields["add_bias_linear"] = True
    if spec.attention_sinks:
        fields["softmax_type"] = "learnable"
    if spec.sliding_window:
        # transformers keeps keys i - window < j <= i; Megatron's (left, right) counts the keys besides i
        fields.update(window_size=(spec.sliding_window - 1, 0), window_attn_skip_freq=[int(w) for w in spec.window_layers])
    if spec.activation == "quick_gelu":
        fields["activation_func"] = quick_gelu
    elif spec.activation != "silu":
        raise ValueError(f"activation {spec.activation!r} is not built")
    if spec.glu_clamp:
        fields["activation_func_clamp_value"] = spec.glu_clamp
    if spec.glu_linear_offset:
        fields["glu_linear_offset"] = spec.glu_linear_offset
    return fields


def mla_config(spec: ModelSpec, kwargs: dict, backend: Backend):
    """MLATransformerConfig: plain RoPE on the rotary dims (no YaRN: scaling factor 1, so the softmax
    scale is 1/sqrt(qk_nope + qk_rope) as in HF). Runs with Transformer Engine (GPU) or on CPU, where
    megapo.compat makes Megatron's local MLA work; a GPU without TE gets neither."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    if backend.device == "cuda" and not backend.use_te:
        raise ConfigError("model", f"{spec.family}: multi-latent attention on a GPU needs Transformer Engine "
                                   "(megatron-core's local MLA path is made to work only on CPU, by megapo.compat)")

    mla = spec.mla
    kwargs = {**kwargs, "qk_layernorm": True}  # the q/kv latents' RMSNorms
    kwargs.pop("num_query_groups")
    kwargs["kv_channels"] = mla.v_head_dim
    return MLATransformerConfig(
        **kwargs, q_lora_rank=mla.q_lora_rank or None, kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
        rope_type="rope", rotary_base=spec.rope_theta, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)


def layer_spec(spec: ModelSpec, config, backend: Backend):
    """One spec for every layer, or (dense and MoE layers mixed) Megatron's block spec for this pipeline
    stage's layers, built from config.moe_layer_freq."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if spec.moe_layers and not all(spec.moe_layers):
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=backend.use_te, normalization="RMSNorm")
        for layer in block.layer_specs:
            _local_attention(layer, spec, backend)
            if not backend.use_te:
                compat.use_lean_experts(layer.submodules.mlp)
        return block
    experts = spec.num_experts or None
    mla = spec.mla is not None
    if backend.use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=config.moe_grouped_gemm, qk_layernorm=config.qk_layernorm,
            multi_latent_attention=mla)
    layer = _local_attention(
        get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm,
                                 multi_latent_attention=mla, normalization="RMSNorm"), spec, backend)
    if spec.linear_bias and experts:
        compat.use_local_expert_bias(layer.submodules.mlp.submodules.experts.submodules)
    compat.use_lean_experts(layer.submodules.mlp)  # (biased experts keep megatron-core's forward: see there)
    return layer


def _local_attention(layer, spec: ModelSpec, backend: Backend):
    """The local spec's core attention: grouped heads over one additive mask (compat.grouped_core_attention), as MLA's variant
    with the pieces megatron-core 0.16.1 lacks without TE (compat.use_local_mla) and with sliding windows
    kept inside the packing mask (compat.use_local_window_attention)."""
    if backend.use_te:
        return layer
    attention = layer.submodules.self_attention.submodules
    compat.use_grouped_attention(attention)
    if spec.mla is not None:
        compat.use_local_mla(attention)
    if spec.sliding_window:
        compat.use_local_window_attention(attention)
    return layer


def build_model(spec: ModelSpec, parallel: ParallelConfig, backend: Backend, config, *, ddp: bool = True):
    """One model chunk for this pipeline stage (no virtual PP), in bf16 / fp16 inside Megatron's Float16Module
    when the config says so, wrapped in Megatron's DDP."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel

    from megapo.learner.rope import use_position_ids

    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(spec, config, backend),
        vocab_size=padded_vocab(spec.vocab_size, parallel.tp),
        max_sequence_length=spec.max_positions,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type="yarn" if spec.yarn is not None else "rope",
        rotary_base=spec.rope_theta,
        rotary_percent=spec.rotary_percent,  # (glm4_moe: rotate-half within the first dims of each head)
    )
    if not backend.use_te:
        # The local spec has no packed-sequence (THD) attention: rotary positions follow the
        # per-sequence position ids instead (see rope.py).
        use_position_ids(model)
    if spec.attention_sinks:
        mark_sinks(model)
    if parallel.ep == 1 and expert_tp(parallel, spec) < parallel.tp:
        mark_experts_whole(model)
    if backend.device == "cuda":
        model = model.cuda()
    if config.bf16 or config.fp16:  # casts the first stage's inputs, returns the last stage's logits in fp32
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    if not parallel.distributed_optimizer:  # (the distributed optimizer lays them out in its own buffer)
        contiguous_parameters(model)
    if not ddp:
        return model
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=parallel.distributed_optimizer,
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


class HeadSelection:
    """Runs the model's head (the LM head, or the score or value head in its place) only at the slots a
    micro-batch reads: a forward pre-hook on `output_layer` hands it the final hidden states at those slots,
    [N, 1, h] of [W, rows, h], so the vocabulary projection, its gradient and the logits' copies cost N rows,
    not rows x W (the prompt slots and the padding are skipped). Where the head gathers a sequence-parallel input
    itself the slots are spread over the TP ranks: the caller then picks them from the full output
    (MicroBatch.head_selected stays False). With `keep_input` set, the hook also keeps the head's input at those
    slots, [N, h] detached, in `kept` (Learner.response_hidden: the hidden states DelTA's token gradients use)."""

    def __init__(self, module):
        self.module = module  # the unwrapped GPTModel of this pipeline stage
        self.hooked = None
        self.rows: torch.Tensor | None = None
        self.pick = False  # the hook hands the head the selected rows (else it only keeps them)
        self.keep_input = False
        self.kept: torch.Tensor | None = None

    def select(self, mb) -> None:
        """Before mb's forward: the head will see mb.select's slots only, and mb.head_selected says so."""
        head = getattr(self.module, "output_layer", None)  # None: not the last pipeline stage
        mb.head_selected = head is not None and not getattr(head, "sequence_parallel", False)
        self.rows, self.kept = None, None
        if head is None or not (mb.head_selected or self.keep_input):
            return
        if head is not self.hooked:  # the first forward, or a score head replaced the LM head since
            head.register_forward_pre_hook(self._pick)
            self.hooked = head
        rows, width = mb.tokens.shape
        slots = mb.select if mb.select is not None else mb.tokens.new_zeros(0)
        self.rows = (slots % width) * rows + torch.div(slots, width, rounding_mode="floor")  # seq-first order
        self.pick = mb.head_selected

    def _pick(self, module, args):
        if self.rows is None:
            return None
        rows, self.rows = self.rows, None
        if not self.pick:  # sequence parallel: the head gathers its input itself; keep the slots' rows only
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            full = gather_from_sequence_parallel_region(args[0].detach(), tensor_parallel_output_grad=False)
            self.kept = full.reshape(-1, full.shape[-1]).index_select(0, rows)
            return None
        hidden = args[0].reshape(-1, args[0].shape[-1]).index_select(0, rows)
        if self.keep_input:
            self.kept = hidden.detach()
        return (hidden[:, None], *args[1:])


class PaddingRoutes:
    """Sends a micro-batch's padding slots to no expert: a forward hook on each of this stage's MoE routers
    clears their rows of the routing map, so the token dispatcher leaves them out and the experts compute real
    tokens only (the MoE output at a padding slot is then 0; nothing reads it: attention masks padding out and
    no head reads it, so every other value and gradient is the same). Registered after routing replay's hooks,
    which check and record the full map. Not built with activation recompute (the recompute, in backward, would
    need its micro-batch's slots again) or an expert capacity (padding takes capacity there, and leaving it out
    would change which real tokens are dropped)."""

    def __init__(self, module, config):
        from megatron.core.transformer.moe.router import TopKRouter

        self.sequence_parallel = config.sequence_parallel
        self.real: torch.Tensor | None = None  # [width * rows] in the routers' (position-major) order
        for router in (m for m in module.modules() if isinstance(m, TopKRouter)):
            router.register_forward_hook(self._clear)

    @staticmethod
    def applies(config) -> bool:
        return bool(config.num_moe_experts) and config.recompute_granularity is None and \
            config.moe_expert_capacity_factor is None and config.moe_token_dispatcher_type in ("alltoall", "allgather")

    @contextlib.contextmanager
    def around(self, mb):
        """mb's forward, its padding slots cleared; a forward outside (none set) routes every slot."""
        real = mb.seq >= 0  # [rows, width] on the host (packing.SlotMap: -1 marks padding)
        self.real = None if real.all() else torch.from_numpy(real.T.reshape(-1)).to(mb.tokens.device)
        try:
            yield
        finally:
            self.real = None

    def _clear(self, router, args, output):
        if self.real is None:
            return None
        probs, routing_map = output
        n = routing_map.shape[0]
        start = 0
        if self.sequence_parallel:  # this TP rank's contiguous slice of the positions
            from megatron.core import parallel_state

            start = parallel_state.get_tensor_model_parallel_rank() * n
        return probs, routing_map & self.real[start:start + n, None]


def mark_sinks(model) -> None:
    """Megatron creates the learnable softmax offset (attention sinks) per TP rank's heads but leaves it
    unmarked: mark it split over TP on dim 0, so the loader and export shard it and the grad norm counts
    every rank's heads (unmarked, only TP rank 0's would count)."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    for name, param in model.named_parameters():
        if name.endswith("core_attention.softmax_offset"):
            set_tensor_model_parallel_attributes(param, True, 0, 1)


def mark_experts_whole(model) -> None:
    """Experts whole on every TP rank (expert-TP 1) without EP: each TP rank runs them on its own
    sequence-parallel tokens, so their grads must be summed over the TP ranks, which Megatron does for
    expert parameters (allreduce=False: reduced over the expert-data-parallel group, which holds the TP
    ranks) but marks them so only with EP > 1. Also makes the loader shard them over expert-TP (1)."""
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def contiguous_parameters(model: torch.nn.Module, align_bytes: int = 16) -> None:
    """Move the parameters into one buffer per (dtype, device), back to back in registration order (each
    start aligned to `align_bytes`). That is the order in which a weight sync streams them as HF tensors, so
    tensors that follow each other there (a layer's experts: gate, up, down, gate, ...) also follow each other
    in memory and travel as one piece (megapo.weights.broadcast) instead of one message each. Parameters of
    tensor subclasses (e.g. FP8) keep their own storage."""
    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in model.parameters():
        if type(p.data) is torch.Tensor:
            groups.setdefault((p.dtype, p.device), []).append(p)
    for (dtype, device), params in groups.items():
        step = max(1, align_bytes // dtype.itemsize)
        starts, end = [], 0
        for p in params:
            starts.append(end)
            end = -(-(end + p.numel()) // step) * step
        flat = torch.empty(end, dtype=dtype, device=device)
        for p, start in zip(params, starts):  # (the old storages are freed as their parameters move)
            view = flat[start:start + p.numel()].view(p.shape)
            view.copy_(p.data)
            p.data = view


def unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def scratch_dir() -> str:
    return tempfile.mkdtemp(prefix="megapo_")
