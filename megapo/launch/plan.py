"""`megapo plan`: what one learner GPU holds under a run's layout, and whether it fits the GPU.

    spec = family_for(hf).spec(hf)                      # the model, from its config.json
    counts = param_counts(spec)                         # its parameters by kind
    plan = plan_memory(spec, parallel, RunShape.from_config(run_yaml_data), gpu="h100")
    print(format_plan(plan))                            # per-GPU bytes of every term on the busiest pipeline stage
    check_fits(hf, parallel, run, world, "h100")        # LayoutError naming the largest term + a layout that fits

`megapo plan` (megapo/commands/plan.py) prints the table; `megapo launch slurm` (and `launch local --gpu`) call
plan_run before anything is submitted.

Parameters (from the family's ModelSpec, `megapo.models.family.family_for(hf).spec(hf)`), per decoder layer:
  attention, grouped-query: h·(nh + 2·nkv)·d (q, k, v) + nh·d·h (o), + (nh + 2·nkv)·d + h biases when the model
    has q/k/v biases (qkv_bias) or biases on every linear (linear_bias: o too), + 2·d for q/k norms, + nh sinks;
  attention, MLA: [q_lora>0] h·q_lora + q_lora + q_lora·nh·(nope+rope), [else] h·nh·(nope+rope);
    + h·(kv_lora+rope) + kv_lora + kv_lora·nh·(nope+v) + nh·v·h (the down-projections and latent norms are
    replicated over TP, as are q/k norms and the output bias; the rest is split by heads);
  2 norms of h;
  dense layer: 3·h·ffn (gate, up, down);
  MoE layer: router E·h (+E bias with linear_bias, +E expert-bias buffer with router_expert_bias), routed experts
    E·3·h·F (+E·(2F + h) biases with linear_bias), shared expert 3·h·F_shared;
and once: embedding V·h, output head V·h (not when tied), final norm h. test_plan.py checks it against the summed
safetensors numel of tiny qwen3_moe, deepseek_v3, glm4_moe and gpt_oss models.

Parameters per GPU: the dense part (attention, dense MLPs, shared experts, embedding/head: vocab padded to a
multiple of TP) / TP, norms and routers whole; routed experts / (EP·ETP), ETP = TP when EP = 1 else 1 (the
learner's rule); decoder layers split evenly over PP (megapo.layout checks PP divides them), the embedding on the
first stage, the final norm and head on the last. Every term below is computed per stage; the busiest stage is
reported.

Bytes per parameter (measured, docs/scaling.md "Memory per parameter", `megapo bench memory`):
  weights fp32 4 | bf16/fp16 2; gradients 4 (DDP's fp32 main_grad in every precision);
  optimizer: fp32 0 + Adam 8 | bf16 fp32 main params 4 + Adam 8, divided by DP (dense) and by
    expert-DP = TP·DP/(EP·ETP) (experts) with the distributed optimizer (parallel.distributed_optimizer);
  guard copy (optim.restore_nonfinite, megapo/learner/guard.py): the weights again + the optimizer's tensors
    again (12 per parameter, or 8 for fp32 without the distributed optimizer), sharded as the optimizer is.

Activations of one micro-batch of t = train.micro_batch_tokens tokens, bytes per layer (b = 2 in bf16/fp16, 4 in
fp32; sequence parallel with TP, so everything / TP): attention and norms 7.5·b·t·h (Megatron's 11 + 4 of its
34·s·b·h with flash attention: no s² score term, as TE's fused attention on a GPU stores none); dense MLP
b·t·(h + 3·ffn) (input, gate and up outputs, the activation); MoE layer b·t·k·(h + 3·F) for the k experts a
token visits (+ b·t·(h + 3·F_shared)) + 4·t·E router logits. Full recompute (parallel.recompute) keeps only each
layer's input, b·t·h / TP, plus one layer's full activations during its backward. The last stage adds the fp32
logits and their gradient, 2·4·t·V/TP. With PP > 1 stage i holds PP - i micro-batches in flight (1F1B).
Routes (algorithm.routing_replay != off): the step's routes for this rank's share of the batch,
(prompts_per_step·n_samples/DP)·(max_prompt_tokens+response tokens)·moe_layers_of_stage·k·itemsize (int8 below 128
experts, else int16).
Colocated engine (rollout.engine embedded, or vllm without servers: megapo starts one TP=1 server on the same
GPUs; it is on rank 0's GPU): the model's weights in the engine's dtype plus the KV cache of one step's
sequences (prompts_per_step·n_samples·(max_prompt_tokens+response tokens) tokens; per token per layer
2·nkv·d values, MLA kv_lora + rope). With --rollout-nodes the engine servers use other nodes: not counted here.
Verdict: the sum must stay below (1 - MARGIN) of the GPU's memory, the margin for the CUDA context, NCCL and
allocator fragmentation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megapo.config import ParallelConfig
from megapo.layout import LayoutError

GB = 10 ** 9
GIB = 2 ** 30
GPUS = {"h100": 80 * GB, "h200": 141 * GB, "b200": 192 * GB}  # memory per GPU, as the vendors state it
MARGIN = 0.10  # of the GPU's memory kept free (CUDA context, NCCL buffers, fragmentation)
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


# ----------------------------------------------------------------------------- parameter counts


def attention_params(spec) -> tuple[int, int]:
    """(split over TP, whole on every TP rank) parameters of one layer's attention: q/k norms, MLA's q/kv latent
    layernorms and down-projections, and the output bias are replicated; the rest is split by heads."""
    h, nh = spec.hidden_size, spec.num_heads
    if spec.mla is not None:
        m = spec.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        split = m.q_lora_rank * nh * qk if m.q_lora_rank else h * nh * qk
        whole = h * m.q_lora_rank + m.q_lora_rank if m.q_lora_rank else 0
        whole += h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        split += m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim) + nh * m.v_head_dim * h
        return split, whole
    d, nkv = spec.head_dim, spec.num_kv_heads
    split, whole = h * (nh + 2 * nkv) * d + nh * d * h, 0
    if spec.qkv_bias or spec.linear_bias:
        split += (nh + 2 * nkv) * d
    if spec.linear_bias:
        whole += h
    if spec.qk_norm:
        whole += 2 * d
    if spec.attention_sinks:
        split += nh
    return split, whole


def param_counts(spec) -> dict[str, int]:
    """The model's parameters by kind, per layer and in all (see the module doc for the formula)."""
    h, e, f = spec.hidden_size, spec.num_experts, spec.moe_ffn_hidden_size
    router = e * h + (e if spec.linear_bias else 0) + (e if spec.router_expert_bias else 0)
    routed = e * 3 * h * f + (e * (2 * f + h) if spec.linear_bias else 0)
    attn_split, attn_whole = attention_params(spec)
    c = {"attention": attn_split + attn_whole, "attention_split": attn_split, "attention_whole": attn_whole,
         "norms": 2 * h, "dense_mlp": 3 * h * spec.ffn_hidden_size,
         "router": router, "routed": routed, "shared": 3 * h * spec.shared_expert_ffn,
         "embedding": spec.vocab_size * h, "head": 0 if spec.tied_embeddings else spec.vocab_size * h,
         "final_norm": h, "layers": spec.num_layers, "moe_layers": spec.num_moe_layers}
    dense_layers = spec.num_layers - c["moe_layers"]
    c["total"] = (spec.num_layers * (c["attention"] + c["norms"]) + dense_layers * c["dense_mlp"]
                  + c["moe_layers"] * (router + routed + c["shared"]) + c["embedding"] + c["head"] + h)
    c["experts_total"] = c["moe_layers"] * routed
    c["active"] = c["total"] - (c["moe_layers"] * routed * (e - spec.topk) // e if e else 0)
    return c


# ----------------------------------------------------------------------------- the layout and the run


@dataclass
class RunShape:
    """What the plan reads from a run config besides the layout (defaults: RunConfig's)."""

    precision: str = "fp32"
    restore_nonfinite: bool = True
    micro_batch_tokens: int = 4096
    seq_tokens: int = 576  # data.max_prompt_tokens + the response budget
    sequences_per_step: int = 512  # data.prompts_per_step * rollout.n_samples
    routing_replay: str = "off"
    engine: str = "embedded"
    engine_colocated: bool = True
    engine_dtype: str = "bf16"

    @classmethod
    def from_config(cls, data: dict, rollout_nodes: int = 0) -> "RunShape":
        """From the run config as plain data (YAML + overrides), defaults where a field is absent."""
        def get(section, name, default):
            value = (data.get(section) or {}).get(name, default)
            return default if value is None else value

        precision = str(get("train", "precision", "fp32"))
        mnt = int(get("rollout", "max_new_tokens", 64))
        env = data.get("env") or {}
        response = mnt
        if env.get("name") not in (None, "", "none"):
            response = int(env.get("max_total_tokens") or 0) or mnt * int(env.get("max_turns") or 1)
        engine = str(get("rollout", "engine", "embedded"))
        servers = get("rollout", "servers", []) or get("rollout", "servers_file", "")
        dtype = str(get("rollout", "dtype", "auto"))
        engine_dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype)
        if engine_dtype is None:
            engine_dtype = precision if precision != "fp32" else ("fp32" if engine == "embedded" else "bf16")
        return cls(
            precision=precision, restore_nonfinite=bool(get("optim", "restore_nonfinite", True)),
            micro_batch_tokens=int(get("train", "micro_batch_tokens", 4096)),
            seq_tokens=int(get("data", "max_prompt_tokens", 512)) + response,
            sequences_per_step=int(get("data", "prompts_per_step", 64)) * int(get("rollout", "n_samples", 8)),
            routing_replay=str(get("algorithm", "routing_replay", "off")), engine=engine,
            engine_colocated=not rollout_nodes and (engine == "embedded" or (engine == "vllm" and not servers)),
            engine_dtype=engine_dtype)


@dataclass
class MemoryPlan:
    model: str
    gpu: str
    layout: dict[str, Any]
    stage: int  # the busiest pipeline stage
    params: dict[str, int]  # on one GPU of that stage: dense, expert
    rows: list[tuple[str, float]]  # (term, bytes) on one GPU of the busiest stage
    per_stage_total: list[float]
    capacity: float  # bytes of the GPU
    stages: list[dict] = field(default_factory=list)  # every stage: rows, dense, expert

    @property
    def total(self) -> float:
        return sum(b for _, b in self.rows)

    @property
    def budget(self) -> float:
        return self.capacity * (1 - MARGIN)

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def overflowing_term(self) -> str:
        """The largest term: what to shrink first."""
        return max(self.rows, key=lambda r: r[1])[0]

    def summary(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        return (f"{verdict}: {self.total / GB:.1f} GB of {self.budget / GB:.1f} GB usable per {self.gpu} "
                f"({self.capacity / GB:.0f} GB less {MARGIN:.0%} margin), busiest stage {self.stage}")


def _layout_dict(p: ParallelConfig, etp: int) -> dict:
    return {"tp": p.tp, "pp": p.pp, "ep": p.ep, "etp": etp, "dp": p.dp, "expert_dp": p.tp * p.dp // (p.ep * etp),
            "distributed_optimizer": p.distributed_optimizer, "recompute": p.recompute}


def plan_memory(spec, parallel: ParallelConfig, run: RunShape, gpu: str = "h100", model: str = "") -> MemoryPlan:
    """Per-GPU bytes of each term on every pipeline stage of `parallel`; the busiest stage's terms."""
    from megapo.models.family import padded_vocab

    if gpu not in GPUS:
        raise LayoutError("--gpu", f"unknown GPU {gpu!r}; choose from {', '.join(GPUS)}")
    c = param_counts(spec)
    p = parallel
    tp, pp, ep = p.tp, p.pp, p.ep
    etp = tp if ep == 1 else 1
    dp, edp = p.dp, max(1, tp * p.dp // (ep * etp))
    h, L = spec.hidden_size, spec.num_layers
    vocab = padded_vocab(spec.vocab_size, tp)
    per = L // pp
    w = WEIGHT_BYTES[run.precision]
    main = 0 if run.precision == "fp32" else 4
    act_b = 4 if run.precision == "fp32" else 2
    shard_d = dp if p.distributed_optimizer else 1
    shard_e = edp if p.distributed_optimizer else 1
    guard_opt = 12 if (run.precision != "fp32" or p.distributed_optimizer) else 8
    k, F, E = spec.topk, spec.moe_ffn_hidden_size, spec.num_experts
    route_item = 1 if E < 128 else 2

    stages = []
    for s in range(pp):
        layers = range(s * per, (s + 1) * per)
        split = whole = expert = 0
        moe_layers = 0
        act_layer = []  # full activations per layer, bytes
        for i in layers:
            split += c["attention_split"]
            whole += c["norms"] + c["attention_whole"]
            a = 7.5 * act_b * h
            if spec.is_moe_layer(i):
                moe_layers += 1
                split += c["shared"]
                whole += c["router"]
                expert += c["routed"]
                a += act_b * k * (h + 3 * F) + (act_b * (h + 3 * spec.shared_expert_ffn) if spec.shared_expert_ffn
                                                else 0) + 4 * E * tp  # router logits are not split by TP
            else:
                split += c["dense_mlp"]
                a += act_b * (h + 3 * spec.ffn_hidden_size)
            act_layer.append(a * run.micro_batch_tokens / tp)
        if s == 0:
            split += vocab * h
        if s == pp - 1:
            split += 0 if spec.tied_embeddings and pp == 1 else vocab * h
            whole += h
        dense = split // tp + whole
        expert //= ep * etp
        t = run.micro_batch_tokens
        if p.recompute:
            acts = act_b * t * h / tp * len(act_layer) + max(act_layer)
        else:
            acts = sum(act_layer)
        acts *= pp - s  # 1F1B: micro-batches in flight on stage s
        if s == pp - 1:
            acts += 2 * 4 * t * vocab / tp
        rows = [
            ("weights", (dense + expert) * w),
            ("gradients (fp32)", (dense + expert) * 4),
            ("optimizer (main params + Adam)", dense * (main + 8) / shard_d + expert * (main + 8) / shard_e),
        ]
        if run.restore_nonfinite:
            rows.append(("guard copy (optim.restore_nonfinite)",
                         (dense + expert) * w + dense * guard_opt / shard_d + expert * guard_opt / shard_e))
        rows.append((f"activations ({'full recompute' if p.recompute else 'no recompute'}, "
                     f"{run.micro_batch_tokens} tokens/micro-batch)", acts))
        if run.routing_replay != "off" and moe_layers:
            rows.append(("routes (routing replay)",
                         run.sequences_per_step / dp * run.seq_tokens * moe_layers * k * route_item))
        if run.engine_colocated and s == 0:
            ew = WEIGHT_BYTES[run.engine_dtype]
            if spec.mla is not None:
                kv_per_token = L * (spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim) * ew
            else:
                kv_per_token = L * 2 * spec.num_kv_heads * spec.head_dim * ew
            rows.append((f"colocated engine weights ({run.engine}, {run.engine_dtype})", c["total"] * ew))
            rows.append(("colocated engine KV cache", run.sequences_per_step * run.seq_tokens * kv_per_token))
        stages.append({"rows": rows, "dense": dense, "expert": expert})
    totals = [sum(b for _, b in st["rows"]) for st in stages]
    busiest = max(range(pp), key=totals.__getitem__)
    st = stages[busiest]
    return MemoryPlan(model=model, gpu=gpu, layout=_layout_dict(p, etp), stage=busiest,
                params={"dense": st["dense"], "expert": st["expert"], "total_model": c["total"]},
                rows=st["rows"], per_stage_total=totals, capacity=GPUS[gpu], stages=stages)


def _count(n: float) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e8 else f"{n / 1e6:.3f} M"


def format_plan(plan: MemoryPlan) -> str:
    lay = plan.layout
    head = (f"{plan.model}: TP={lay['tp']} PP={lay['pp']} EP={lay['ep']} ETP={lay['etp']} DP={lay['dp']} "
            f"expert-DP={lay['expert_dp']}, distributed optimizer {'on' if lay['distributed_optimizer'] else 'off'}, "
            f"{_count(plan.params['total_model'])} parameters; on one GPU of stage {plan.stage}: "
            f"{_count(plan.params['dense'])} dense + {_count(plan.params['expert'])} expert")
    width = max(len(t) for t, _ in plan.rows) + 2
    lines = [head, f"{'term':<{width}}{'GB':>9}{'GiB':>9}"]
    for term, b in plan.rows:
        lines.append(f"{term:<{width}}{b / GB:>9.2f}{b / GIB:>9.2f}")
    lines.append(f"{'total':<{width}}{plan.total / GB:>9.2f}{plan.total / GIB:>9.2f}")
    if len(plan.per_stage_total) > 1:
        lines.append("per stage (GB): " + " ".join(f"{t / GB:.1f}" for t in plan.per_stage_total))
    lines.append(plan.summary())
    return "\n".join(lines)


# ----------------------------------------------------------------------------- searching a layout that fits


def candidate_layouts(parallel: ParallelConfig, world: int, hf: dict, run: RunShape):
    """Layouts of `world` processes to try, nearest to `parallel` first: the distributed optimizer on, no guard
    copy, full recompute, then larger EP / PP / TP (every one megapo.layout.check_layout accepts)."""
    from megapo.layout import check_layout

    def divisors(n):
        return [d for d in range(1, n + 1) if n % d == 0]

    seen = []
    steps = []
    for tp in sorted(divisors(world), key=lambda d: (d != parallel.tp, d)):
        if tp > 8:
            continue
        for pp in sorted(divisors(world // tp), key=lambda d: (d != parallel.pp, d)):
            dp = world // (tp * pp)
            for ep in sorted(divisors(tp * dp), key=lambda d: (d != parallel.ep, d)):
                cand = dataclasses.replace(parallel, tp=tp, pp=pp, ep=ep, dp=dp)
                try:
                    check_layout(cand, hf)
                except Exception:  # noqa: BLE001 (a layout the model refuses: not a candidate)
                    continue
                seen.append(cand)
    for do, guard, rc in ((parallel.distributed_optimizer, run.restore_nonfinite, parallel.recompute),
                          (True, run.restore_nonfinite, parallel.recompute), (True, False, parallel.recompute),
                          (True, False, True)):
        for cand in seen:
            steps.append((dataclasses.replace(cand, distributed_optimizer=do, recompute=rc),
                          dataclasses.replace(run, restore_nonfinite=guard)))
    return steps


def suggest(spec, hf: dict, parallel: ParallelConfig, run: RunShape, world: int, gpu: str):
    """The first layout of candidate_layouts that fits (its MemoryPlan and the overrides that set it), or None."""
    for cand, cand_run in candidate_layouts(parallel, world, hf, run):
        plan = plan_memory(spec, cand, cand_run, gpu)
        if plan.fits:
            overrides = [f"parallel.tp={cand.tp}", f"parallel.pp={cand.pp}", f"parallel.ep={cand.ep}"]
            if cand.distributed_optimizer != parallel.distributed_optimizer:
                overrides.append(f"parallel.distributed_optimizer={str(cand.distributed_optimizer).lower()}")
            if cand.recompute != parallel.recompute:
                overrides.append(f"parallel.recompute={str(cand.recompute).lower()}")
            if cand_run.restore_nonfinite != run.restore_nonfinite:
                overrides.append("optim.restore_nonfinite=false")
            return plan, overrides
    return None


def check_fits(hf: dict, parallel: ParallelConfig, run: RunShape, world: int, gpu: str, model: str = "") -> MemoryPlan:
    """The plan of `parallel`; LayoutError naming the overflowing term and a layout that fits, when it does not."""
    from megapo.models.family import family_for

    spec = family_for(hf).spec(hf)
    plan = plan_memory(spec, parallel, run, gpu, model)
    if plan.fits:
        return plan
    term = plan.overflowing_term()
    found = suggest(spec, hf, parallel, run, world, gpu)
    hint = (f"; a layout that fits on these {world} GPUs: {' '.join(found[1])} ({found[0].total / GB:.1f} GB)"
            if found else f"; no layout of {world} {gpu} GPUs fits it: use more nodes")
    raise LayoutError("parallel", f"{model or 'the model'} does not fit a {gpu} ({GPUS[gpu] / GB:.0f} GB, "
                      f"{plan.budget / GB:.1f} GB usable): {plan.total / GB:.1f} GB per GPU on stage {plan.stage}, "
                      f"the largest term {term} = {dict(plan.rows)[term] / GB:.1f} GB{hint} "
                      f"(`megapo plan` prints the table)")


def plan_run(run_spec, data: dict, world: int, gpu: str, rollout_nodes: int = 0) -> MemoryPlan:
    """The plan of a launcher's RunSpec (megapo.launch.slurm.read_run) on `world` learner GPUs of kind `gpu`;
    LayoutError when it does not fit (check_fits)."""
    p = run_spec.parallel
    if not run_spec.dp_given:
        p = dataclasses.replace(p, dp=max(1, world // (p.tp * p.pp)))
    model = str(data.get("model", {}).get("path") or Path(run_spec.model_path).name)
    return check_fits(run_spec.hf_config, p, RunShape.from_config(data, rollout_nodes), world, gpu, model)
