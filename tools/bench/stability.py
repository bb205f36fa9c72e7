"""`megapo bench stability`: a grid of short RL runs from one SFT warm start, and which of them collapse.

    megapo bench stability --grid small --out runs/stability            # run (or continue) the grid, then report
    megapo bench stability --grid small --out runs/stability --dry-run  # the cells and a time estimate only
    megapo bench stability --grid dose --out runs/stability_dose        # router disagreement dose x replay x m
    megapo bench stability --out runs/stability --report-only           # summary/table/plots from what ran
    megapo bench stability --set rollout.dtype=float32 --set optim.lr=3e-3 ...   # grid-wide overrides

Axes (every cell is `megapo train CONFIG` with config overrides only): objective {ppo (token-level), gspo,
minirl, cispo} x routing replay {off, r2, r3} x train.mini_batches {1, 4, 8} (optimizer steps per rollout: the
off-policy degree) x mismatch correction {none, tis} x seeds. `full` is the whole product; `small` is the union
of the cells that answer the three questions in SMALL_QUESTIONS. `--objectives all` (or a list) adds every
registered objective at no replay, no correction, m=8 (OBJECTIVE_REGIME; default options, but sspo's cells split
at the run's tokenizer's sentence ends, TOKENIZER_OPTIONS, and haepo's cells add the stage and entropy bonus it
needs, OBJECTIVE_OVERRIDES); `--variants all` (or a list) adds the
named VARIANTS there too: ppo with one stage or option of issue 14 switched on (a config override list each), the
methods that are not objectives. The train-inference mismatch itself comes from the config's rollout.dtype (the
engine in bfloat16, the learner in fp32; megapo/configs/stability_base.yaml).

`dose` (issue 30) raises that mismatch under control: rollout.router_noise σ (DOSES: N(0, σ²) on the engine's
router logits before its top-k, the learner untouched) x routing replay {off, r2, r3} x train.mini_batches {1, 8},
ppo, no correction; and at the highest dose the alternatives (DOSE_ALTERNATIVES: ppo + tis / icepop / mis_seq,
gspo off, gspo r3) at m=1 and m=8, 3 seeds: 120 cells, under two hours on the 2-core machine with --jobs 2
(one thread per cell; these tiny cells do not use a second thread). The report adds the dose table (collapse and final accuracy per dose, with the disagreement
the dose's cells measured) and plots/dose.png.

Layout of --out:
    grid.json               the shared settings (config hash, steps, --set); a rerun with others is refused
    warm_start/             the one SFT warm start every cell starts from (base/ the tiny model, sft/ the warm start)
    cells/<cell>/           one `megapo train` output dir per cell: metrics.jsonl, train.log, cell.json, and
                            done.json once the cell's metrics reach its last step (written atomically)
    summary.json, table.md, plots/*.png   rewritten from the cells' metrics after every grid run

Resume: a rerun skips cells with done.json and restarts the others (--overwrite), or continues those with a
checkpoint (--resume). Cells run `--jobs` at a time, each with OMP_NUM_THREADS = cores // jobs.
The collapse rule is megapo.trainer.collapse.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from megapo.config import ConfigError, config_digest
from megapo.progress import Progress

log = logging.getLogger(__name__)

DEFAULT_CONFIG = "megapo/configs/stability_base.yaml"
AXES: dict[str, tuple] = {"objective": ("ppo", "gspo", "minirl", "cispo"), "replay": ("off", "r2", "r3"),
                          "mini_batches": (1, 4, 8), "mismatch": ("none", "tis")}
# The small grid: for each question of the routing-replay / "Stabilizing RL with LLMs" papers, the axis values
# it compares (every other axis held at the value listed). Its cells are the union of the products.
SMALL_QUESTIONS: dict[str, dict[str, tuple]] = {
    "routing replay (off / r2 / r3) at low and high off-policy degree":
        {"objective": ("ppo",), "replay": ("off", "r2", "r3"), "mini_batches": (1, 8), "mismatch": ("none",)},
    "token-level (ppo, minirl) vs sequence-level (gspo) objective, off-policy, no replay":
        {"objective": ("ppo", "minirl", "gspo"), "replay": ("off",), "mini_batches": (8,), "mismatch": ("none",)},
    "mismatch correction (none / tis), on- and off-policy, no replay":
        {"objective": ("ppo",), "replay": ("off",), "mini_batches": (1, 8), "mismatch": ("none", "tis")},
}
# The metrics rows' keys each summary column reads: the first key a row holds wins. The first names are the
# per-step engine-vs-learner metrics (megapo.replay.modes.stability_metrics); the later ones are older names of
# the same quantities (runs made before those were logged). Under r3, mismatch/k3_free and router/* come every
# train.stability_metrics_every steps (one more forward pass each time).
METRIC_KEYS: dict[str, tuple[str, ...]] = {
    "mismatch_kl": ("mismatch/k3", "train/mismatch_k3"),  # k3 KL(engine || learner's π_old), learner's routing
    "mismatch_kl_free": ("mismatch/k3_free", "replay/kl_k3_free"),  # the same with free routing (before replay)
    "max_abs_dlogp": ("mismatch/max_abs_dlogp", "train/mismatch_max_abs_dlogp"),
    "router_disagree": ("router/disagree",),  # (token, layer) pairs whose top-k set differs, engine vs learner
    "router_disagree_any": ("router/disagree_any",),  # tokens with any layer differing
    "disagree_post": ("train/replay/disagree_post",),  # after replay: 0 when replay works
    "tokens_per_s": ("tokens_per_s",),
}
# --grid dose: rollout.router_noise σ -> the share of (token, layer) router decisions whose top-k set differs between
# the engine and the learner that σ was calibrated to. Measured on the stability model after its SFT warm start
# (megapo/configs/stability_base.yaml: 4 layers, 16 experts top-2, bf16 engine vs fp32 learner), one batch of 64
# prompts x 8 samples:
#     σ                 0       0.01     0.03     0.1      0.3      1.0
#     router/disagree   0.55 %  1.44 %   3.45 %   10.6 %   32.3 %   81 %
# (σ = 0: the bf16 engine alone; two real 2-step runs at σ 0.1 logged router/disagree 11.9 % / 11.5 %). The doses
# are σ interpolated from that table for ≈ 1 %, 3 %, 10 % and 30 %; the report sets beside each the mean
# router/disagree its own cells logged (the disagreement moves as the weights train).
DOSES: dict[float, float] = {0.0: 0.0055, 0.005: 0.01, 0.026: 0.03, 0.09: 0.10, 0.28: 0.30}
DOSE_AXES: dict[str, tuple] = {"objective": ("ppo",), "replay": ("off", "r2", "r3"), "mini_batches": (1, 8),
                               "mismatch": ("none",)}
# at the highest dose, more rows: (objective, replay, mismatch) at each of DOSE_AXES' mini_batches
DOSE_ALTERNATIVES: tuple[tuple[str, str, str], ...] = (
    ("ppo", "off", "tis"), ("ppo", "off", "icepop"), ("ppo", "off", "mis_seq"),
    ("gspo", "off", "none"), ("gspo", "r3", "none"))
DEFAULT_SEEDS = 3
DONE_FILE = "done.json"
CELL_FILE = "cell.json"
GRID_FILE = "grid.json"


# ----------------------------------------------------------------------------- cells


@dataclass(frozen=True)
class Cell:
    objective: str
    replay: str
    mini_batches: int
    mismatch: str
    seed: int
    variant: str = ""  # a VARIANTS name: its overrides come after the axes' (cells made before variants have none)
    noise: float = 0.0  # rollout.router_noise σ (--grid dose); 0: the config's (cells made before doses have none)
    # algorithm.objective_options the objective needs from the run's tokenizer (TOKENIZER_OPTIONS, resolved by
    # GridPlan.cells); "": the objective's defaults (cells made before issue 32 have none)
    objective_options: str = ""

    @property
    def setting(self) -> str:
        """The cell's name without its seed: the row of the table it is averaged into (a dose only when
        non-zero, so the names of cells without one stay as they were)."""
        dose = f"-n{self.noise:g}" if self.noise else ""
        return f"{self.variant or self.objective}-{self.replay}-m{self.mini_batches}-{self.mismatch}{dose}"

    @property
    def name(self) -> str:
        return f"{self.setting}-s{self.seed}"

    @property
    def label(self) -> str:
        """The row's name in the table and the plots: the objective, or the variant on its objective."""
        return f"{self.objective} + {self.variant}" if self.variant else self.objective

    def overrides(self) -> list[str]:
        return [f"algorithm.objective={self.objective}", f"algorithm.routing_replay={self.replay}",
                f"train.mini_batches={self.mini_batches}", f"algorithm.mismatch={self.mismatch}",
                f"train.seed={self.seed}", *([f"rollout.router_noise={self.noise:g}"] if self.noise else []),
                *([f"algorithm.objective_options={self.objective_options}"] if self.objective_options else []),
                *OBJECTIVE_OVERRIDES.get(self.objective, ()), *VARIANTS.get(self.variant, ())]

    @property
    def options(self) -> list[str]:
        """What the cell's row ran with: its overrides but the seed."""
        return [o for o in self.overrides() if not o.startswith("train.seed=")]


def _product(values: dict[str, tuple]) -> list[tuple]:
    return list(itertools.product(*(values[a] for a in AXES)))


# --objectives: each objective alone in the regime where the small grid's baseline collapses (no replay, no
# correction, 8 optimizer steps per rollout), so its row sits beside ppo's and gspo's in the m=8 table.
OBJECTIVE_REGIME = {"replay": "off", "mini_batches": 8, "mismatch": "none"}


def objective_names(spec: str) -> list[str]:
    """--objectives: 'all' (every registered objective) or comma-separated names, each checked against the
    registry."""
    from megapo.algorithms import entries

    known = [e.name for e in entries("objective")]
    if spec.strip() == "all":
        return known
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError("--objectives", f"unknown objective {unknown[0]!r}; known: {', '.join(known)} (or all)")
    return names


# Objectives whose defaults do not run what their name says: their cells get options from the run's tokenizer
# (GridPlan.cells). sspo without sentence ends is one sentence per response, GSPO with sspo's clip, and a run's
# config refuses it (megapo.algorithms.config.check_options): its cells split at the tokenizer's '.', '?', '!',
# newline and EOS.
SENTENCE_END_TEXTS = (".", "?", "!", "\n")
TOKENIZER_OPTIONS = {"sspo": lambda tok: {"sentence_end_ids": sentence_end_ids(tok)}}
# Objectives a run's config refuses without other fields set: the overrides (not cell axes:
# check_objective_overrides) every cell of that objective gets after its axes, in its cell.json, its argv and its
# row's options. haepo reads the Plackett-Luce trajectory weights of stage plackett_luce and regularises by entropy
# (megapo.algorithms.config._check_haepo); entropy_coef 0.01 is ours (HAEPO gives no value for this task).
OBJECTIVE_OVERRIDES: dict[str, tuple[str, ...]] = {
    "haepo": ("algorithm.stages=[{name: plackett_luce}]", "algorithm.entropy_coef=0.01"),
}


def sentence_end_ids(tokenizer) -> list[int]:
    """The ids of the sentence-ending tokens `tokenizer` has (each text of SENTENCE_END_TEXTS that is one token
    of its own), then its EOS id."""
    ids = []
    for text in SENTENCE_END_TEXTS:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == 1 and encoded[0] != tokenizer.unk_token_id and encoded[0] not in ids:
            ids.append(int(encoded[0]))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    return ids


@functools.lru_cache(maxsize=8)
def _tokenizer(folder: str | None, tiny_vocab: int | None):
    if folder is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    from megapo.models.tiny import build_tokenizer

    return build_tokenizer(tiny_vocab)  # what write_tiny_model saves with the tiny model (deterministic)


def run_tokenizer(plan: GridPlan):
    """The tokenizer the cells run with, nothing downloaded: the warm start's folder, else the base model's; a
    tiny model the grid has not written yet: the tokenizer megapo.models.tiny writes with it (built here)."""
    for folder in (plan.out / "warm_start" / "sft", Path(base_model_path(plan))):
        if (folder / "config.json").is_file():
            return _tokenizer(str(folder), None)
    cfg = load_base(plan)
    if cfg.model.tiny is None:
        raise ConfigError("model.path", f"{cfg.model.path} is not an HF model folder (no config.json): the sspo "
                          "cells need its tokenizer's sentence-ending ids")
    return _tokenizer(None, cfg.model.tiny.vocab)


def with_tokenizer_options(plan: GridPlan, cells: list[Cell]) -> list[Cell]:
    """`cells` with the TOKENIZER_OPTIONS of their objectives (the tokenizer is read only when one needs it)."""
    if not any(c.objective in TOKENIZER_OPTIONS and not c.objective_options for c in cells):
        return cells
    tok = run_tokenizer(plan)
    flow = {name: "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in make(tok).items()) + "}"
            for name, make in TOKENIZER_OPTIONS.items()}
    return [dataclasses.replace(c, objective_options=flow[c.objective])
            if c.objective in flow and not c.objective_options else c for c in cells]


# --variants: the methods of issue 14 that are stages or options rather than objectives (so --objectives cannot
# reach them), each switched on alone over VARIANT_OBJECTIVE (the token-level baseline that collapses) in
# OBJECTIVE_REGIME: name -> config overrides, applied after the cell's axes. Options are the stages' defaults
# unless a value is needed (kl_future's β; token_select's ρ = 0.2, the high-entropy-minority rule's fraction).
VARIANT_OBJECTIVE = "ppo"
# variants that are an objective's option rather than a stage: the objective their cells run instead of ppo (the
# cell's objective axis, so its row says it; the overrides then set only that objective's options)
VARIANT_OBJECTIVES: dict[str, str] = {"holder_anneal": "holder"}
VARIANTS: dict[str, tuple[str, ...]] = {
    # HölderPO with its p annealed over the run (the paper's linear schedule from 2 to -2, over the cells' 60
    # steps); the plain holder row is p = 0 throughout (GSPO's geometric mean)
    "holder_anneal": ("algorithm.objective_options={schedule: linear, p_start: 2.0, p_end: -2.0, "
                      "schedule_steps: 60}",),
    "token_select_entropy": ("algorithm.stages=[{name: token_select, score: entropy, rho: 0.2}]",),
    "token_select_adv_entropy": ("algorithm.stages=[{name: token_select, score: adv_entropy, rho: 0.2}]",),
    "stapo": ("algorithm.stages=[{name: stapo}]",),
    "nat_prefix": ("algorithm.stages=[{name: nat_prefix}]",),  # NAT's RPC: the cut tokens leave the batch (cut)
    "nat_uniform": ("algorithm.stages=[{name: nat_uniform}]",),  # NAT's URS, keep q = 0.5
    "gtpo": ("algorithm.stages=[{name: gtpo}]",),
    "grpo_s": ("algorithm.stages=[{name: grpo_s}]",),
    "advantage_reweighting": ("algorithm.stages=[{name: advantage_reweighting}]",),
    # Low-Probability Token Isolation: each update as two optimizer steps, the π_old < η = 0.5 tokens' first
    "lopti": ("algorithm.stages=[{name: lopti}]",),
    "lopti_reweighting": ("algorithm.stages=[{name: advantage_reweighting}, {name: lopti}]",),  # AR + Lopti
    "future_drift": ("algorithm.stages=[{name: future_drift}]",),  # called fipo until issue 32
    "polarity_positive": ("algorithm.stages=[{name: polarity, polarity: positive}]",),
    "polarity_negative": ("algorithm.stages=[{name: polarity, polarity: negative}]",),
    "kl_future": ("algorithm.stages=[{name: future_kl}]", "algorithm.kl_coef=0.05"),
    "d3s_select": ("algorithm.stages=[{name: d3s_select, keep: 0.5}]",),
    "cumulative_std": ("algorithm.stages=[{name: cumulative_std}]",),
    "balanced": ("algorithm.loss_agg=balanced",),
    "clip_dynamic": ("algorithm.objective_options={clip_mode: dynamic}",),
    "clip_entropy": ("algorithm.objective_options={clip_mode: entropy}",),
    "clip_hapo": ("algorithm.objective_options={clip_mode: hapo}",),  # HAPO's clipping + advantage redistribution
    "tempo": ("algorithm.stages=[{name: tempo}]",),
    "ktae": ("algorithm.stages=[{name: ktae}]",),
    "gtpo_trajectory": ("algorithm.stages=[{name: gtpo_trajectory}]",),
    "tw_grpo": ("algorithm.stages=[{name: tw_grpo}]",),
    "drpo": ("algorithm.advantage=drpo",),  # advantage estimators: grpo's place, the stages as configured
    "canon": ("algorithm.advantage=canon",),
    "hapo_tga": ("algorithm.advantage=hapo_tga",),  # HAPO's token-level group average
    # HAPO whole: its adaptive sampling temperature (the authors' τ), token-level group average, clipping and
    # advantage redistribution together
    "hapo": ("rollout.adaptive_temperature=0.05", "algorithm.advantage=hapo_tga",
             "algorithm.objective_options={clip_mode: hapo}"),
    "spo": ("algorithm.advantage=spo",),  # its value tracker persists across steps (the checkpoint keeps it)
    # self-distillation (the policy as its own teacher behind the task's reference answer; the regime's π_old is
    # the learner's, as these need: megapo.trainer.config._check_stage_policy); credit's contrast K = 1 of the
    # prompts_per_step − 1 others
    "opid": ("algorithm.stages=[{name: opid}]",),
    "intro": ("algorithm.stages=[{name: intro}]",),
    "credit": ("algorithm.stages=[{name: credit}]",),
    "srpo": ("algorithm.stages=[{name: srpo}]",),
    "erpo": ("algorithm.stages=[{name: erpo}]",),  # entropy credit (aepo's KL terms are 0 by default: no π_ref)
    "aepo": ("algorithm.stages=[{name: aepo}]",),
    # A3PO: a positive response's rarest 20 % of tokens and a negative one's likeliest 20 % get 2x their advantage,
    # the factor decaying linearly to 1 over 100 steps (1.41x at step 60)
    "a3po": ("algorithm.stages=[{name: a3po}]",),
    # Distribution-Centric Policy Optimization (not clip_dynamic's / cumulative_std's dynamic-clipping DCPO): one more
    # learner forward per step for π_old at the target temperature
    "distribution_centric": ("algorithm.stages=[{name: distribution_centric}]",),
    "caspo": ("algorithm.stages=[{name: caspo}]",),  # opid's path, the group's best response as the context
    "hdpo": ("algorithm.stages=[{name: hdpo}]",),  # privileged rollouts on the all-fail prompts
    "otb": ("algorithm.stages=[{name: otb}]",),  # Optimal Token Baseline: one more learner pass for Σ_v π²
    "low_entropy_kl": ("algorithm.stages=[{name: low_entropy_kl}]",),  # SENT's KL-Cov on low-entropy tokens
    "delta": ("algorithm.stages=[{name: delta}]",),  # DelTA: one more learner pass for the LM head's input
    "thr": ("algorithm.stages=[{name: thr}]",),  # Token Hidden Reward, p = 0.5 (exploitation): one more pass
    # multi-reward (addition_parts: the same problems and exact-match accuracy, its verifier as correct + format):
    # GDPO's decoupled normalisation, and MRTPO's per-reward token credit (one more pass: each response beside its
    # variant per reward)
    "gdpo": ("data.task=addition_parts", "algorithm.stages=[{name: gdpo}]"),
    "mrtpo": ("data.task=addition_parts", "algorithm.stages=[{name: mrtpo}]"),
    # Blockwise Advantage Estimation: the answer's digits as two blocks (the addition task's responses have no
    # delimiter text), each with its own check (megapo/tasks/addition_blocks.py), the low half baselined among the
    # samples whose high half is equally right
    "bae": ("algorithm.stages=[{name: bae, blocks: [high, low], cut_chars: [2], "
            "block_reward: 'megapo.tasks.addition_blocks:digit_halves'}]",),
    # attention-entropy reweighting (arXiv:2605.07660): one more learner pass for the last layer's attention entropies
    "attention_entropy": ("algorithm.stages=[{name: attention_entropy}]",),
    # DUET's rollout allocation (GRPO's budget of prompts × n_samples, redistributed by the pass-rate surrogate); its
    # abort rule needs an answer marker, which the addition task's responses have none of
    "duet": ("data.group_filter=duet",),
    # SOUP (arXiv:2601.21476): 2 of each group's 8 samples continue a prefix of the response an earlier step drew for
    # the same prompt; the addition task's 10^6 problems never repeat in 60 steps, so the pool is its first 512
    # (each prompt seen again every few steps), and soup_pool is the same pool without SOUP (its baseline)
    "soup": ("algorithm.stages=[{name: soup, mix: 2}]", "data.task_options={train_size: 512}"),
    "soup_pool": ("data.task_options={train_size: 512}",),
}
# what a variant (or an objective's OBJECTIVE_OVERRIDES) may not override: the cell's axes (its row would then say
# what it did not run)
CELL_FIELDS = ("algorithm.objective", "algorithm.routing_replay", "train.mini_batches", "algorithm.mismatch",
               "train.seed", "rollout.router_noise")


def _check_overrides(where: str, overrides: tuple[str, ...]) -> None:
    """Each item of `overrides` (VARIANTS[name] or OBJECTIVE_OVERRIDES[name], `where`) is section.field=value and
    sets no cell axis."""
    for i, item in enumerate(overrides):
        key = item.split("=", 1)[0].strip()
        if "=" not in item or "." not in key:
            raise ConfigError(f"{where}[{i}]", f"expected section.field=value, got {item!r}")
        if key in CELL_FIELDS:
            raise ConfigError(f"{where}[{i}]", f"sets {key}, a cell axis (the row would not say it)")


def check_variants(variants: dict[str, tuple[str, ...]], objectives: list[str],
                   variant_objectives: dict[str, str] | None = None) -> None:
    """A variant's overrides are `section.field=value`, none of them a cell axis, and its name is no objective's
    (the cell names would clash); each VARIANT_OBJECTIVES entry names a variant and a registered objective."""
    for name, objective in (VARIANT_OBJECTIVES if variant_objectives is None else variant_objectives).items():
        if name not in variants:
            raise ConfigError(f"VARIANT_OBJECTIVES[{name!r}]", "names no variant of VARIANTS")
        if objective not in objectives:
            raise ConfigError(f"VARIANT_OBJECTIVES[{name!r}]", f"{objective!r} is no registered objective")
    for name, overrides in variants.items():
        if name in objectives:
            raise ConfigError(f"VARIANTS[{name!r}]", "has an objective's name; its cells would clash with the "
                                                   "objective's")
        _check_overrides(f"VARIANTS[{name!r}]", overrides)


def check_objective_overrides(table: dict[str, tuple[str, ...]]) -> None:
    """OBJECTIVE_OVERRIDES: `section.field=value` items, none a cell axis, and none for VARIANT_OBJECTIVE (the
    variants' cells would carry them: their rows are one stage or option on the plain baseline)."""
    for name, overrides in table.items():
        if name == VARIANT_OBJECTIVE:
            raise ConfigError(f"OBJECTIVE_OVERRIDES[{name!r}]", f"{name} is the variants' baseline "
                              "(VARIANT_OBJECTIVE); its cells run the config as it is")
        _check_overrides(f"OBJECTIVE_OVERRIDES[{name!r}]", overrides)


def variant_names(spec: str) -> list[str]:
    """--variants: 'all' (every entry of VARIANTS) or comma-separated names of it."""
    from megapo.algorithms import entries

    check_variants(VARIANTS, [e.name for e in entries("objective")])
    if spec.strip() == "all":
        return list(VARIANTS)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ConfigError("--variants", f"unknown variant {unknown[0]!r}; known: {', '.join(VARIANTS)} (or all)")
    return names


GRIDS = ("small", "full", "dose")


def dose_settings() -> list[tuple]:
    """--grid dose: (objective, replay, mini_batches, mismatch, noise) for each dose (lowest first) of
    DOSE_AXES' product, then the DOSE_ALTERNATIVES at the highest dose."""
    settings = [(*s, noise) for noise in DOSES for s in _product(DOSE_AXES)]
    top = max(DOSES)
    settings += [(o, r, m, x, top) for m in DOSE_AXES["mini_batches"] for o, r, x in DOSE_ALTERNATIVES]
    return settings


def grid_cells(grid: str, seeds: int, objectives: tuple[str, ...] = (), variants: tuple[str, ...] = ()) -> list[Cell]:
    """The cells of `grid` (small | full | dose), plus one setting per name in `objectives` and one per name in
    `variants` (OBJECTIVE_REGIME), seed-major: every setting of seed 0 first, so a grid stopped early has whole
    seeds."""
    if grid == "full":
        settings = [(*s, 0.0) for s in _product(AXES)]
    elif grid == "small":
        settings = []
        for values in SMALL_QUESTIONS.values():
            settings += [(*s, 0.0) for s in _product(values) if (*s, 0.0) not in settings]
    elif grid == "dose":
        settings = dose_settings()
    else:
        raise ConfigError("--grid", f"must be one of {', '.join(GRIDS)}, got {grid!r}")
    regime = tuple(OBJECTIVE_REGIME[a] for a in AXES if a != "objective")
    settings += [s for s in ((o, *regime, 0.0) for o in objectives) if s not in settings]
    settings = [(*s, "") for s in settings]
    settings += [s for s in ((VARIANT_OBJECTIVES.get(v, VARIANT_OBJECTIVE), *regime, 0.0, v) for v in variants)
                 if s not in settings]
    return [Cell(*s[:4], seed=seed, noise=s[4], variant=s[5]) for seed in range(seeds) for s in settings]


# ----------------------------------------------------------------------------- the plan


@dataclass
class GridPlan:
    config: Path  # the base run config every cell overrides
    out: Path
    grid: str = "small"
    seeds: int = 3
    steps: int | None = None  # None: the config's train.steps
    jobs: int = 1
    threads: int = 1  # OMP threads per cell
    sets: list[str] = field(default_factory=list)  # grid-wide overrides (--set)
    resume: bool = False  # continue an unfinished cell from its checkpoint
    only: list[str] = field(default_factory=list)  # --cells: run just these cells of the grid
    objectives: list[str] = field(default_factory=list)  # --objectives: one more setting each
    variants: list[str] = field(default_factory=list)  # --variants: one more setting each

    def cells(self) -> list[Cell]:
        cells = with_tokenizer_options(self, grid_cells(self.grid, self.seeds, tuple(self.objectives),
                                                        tuple(self.variants)))
        if not self.only:
            return cells
        names = {c.name for c in cells}
        unknown = [n for n in self.only if n not in names]
        if unknown:
            raise ConfigError("--cells", f"{unknown[0]!r} is not a cell of the {self.grid} grid with {self.seeds} "
                              f"seed(s) (e.g. {cells[0].name}; --dry-run lists them)")
        return [c for c in cells if c.name in self.only]

    def cell_dir(self, cell: Cell) -> Path:
        return self.out / "cells" / cell.name


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def shared_settings(plan: GridPlan, steps: int) -> dict:
    """What every cell of a grid folder must share (GRID_FILE)."""
    return {"config_sha256": config_digest(plan.config), "steps": steps,
            "sets": list(plan.sets)}


def check_grid_folder(plan: GridPlan, steps: int) -> None:
    """A grid folder holds cells of one config, step count and --set list: refuse another."""
    path = plan.out / GRID_FILE
    if not path.is_file():
        return
    was = json.loads(path.read_text())
    now = shared_settings(plan, steps)
    for key in ("config_sha256", "steps", "sets"):
        if was.get(key) != now[key]:
            what = {"config_sha256": f"another config (was {was.get('config')})", "steps": "--steps",
                    "sets": "--set"}[key]
            raise ConfigError("--out", f"{plan.out} holds a grid made with {what}: {was.get(key)!r}, now {now[key]!r}; "
                              "use another --out, or the same settings to continue it")


def write_json_atomic(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def load_base(plan: GridPlan, overrides: list[str] = ()):
    """The base config with the grid-wide --set overrides (and `overrides`), validated."""
    from megapo.config import load_config
    from megapo.trainer.config import RunConfig

    return load_config(RunConfig, str(plan.config), [*plan.sets, *overrides])


def config_steps(plan: GridPlan) -> int:
    return plan.steps if plan.steps is not None else load_base(plan).train.steps


def base_model_path(plan: GridPlan) -> str:
    """The model the warm start begins from: the config's model.path, except that a tiny model the config
    writes (model.path without config.json) goes under warm_start/base, so the grid folder holds all it ran on."""
    cfg = load_base(plan)
    if cfg.model.tiny is not None and not (Path(cfg.model.path) / "config.json").is_file():
        return str(plan.out / "warm_start" / "base")
    return cfg.model.path


def cell_overrides(plan: GridPlan, cell: Cell, model_path: str, steps: int) -> list[str]:
    """Everything a cell changes in the base config (after the grid-wide --set overrides)."""
    return [*cell.overrides(), f"model.path={model_path}", "sft.enabled=false",
            f"train.output_dir={plan.cell_dir(cell)}", f"train.steps={steps}"]


def validate_cells(plan: GridPlan, cells: list[Cell], steps: int) -> None:
    """Every distinct setting's config is loaded and validated before anything is written or started (a bad
    override is a ConfigError naming the field and the cell). Before the warm start exists, a cell is checked
    against the model it will be made from."""
    check_objective_overrides(OBJECTIVE_OVERRIDES)
    warm = plan.out / "warm_start" / "sft"
    model = str(warm) if (warm / "config.json").is_file() else base_model_path(plan)
    seen = set()
    for cell in cells:
        if cell.setting in seen:
            continue
        seen.add(cell.setting)
        try:
            load_base(plan, cell_overrides(plan, cell, model, steps))
        except ConfigError as err:
            raise ConfigError(err.field, f"{err.message} (cell {cell.name})") from None


def make_warm_start(plan: GridPlan) -> Path:
    """The one SFT warm start (the config's sft section) under --out/warm_start, made once; its HF folder.
    Reused when a previous grid run finished it (megapo.trainer.run.prepare_model)."""
    from megapo.trainer.run import prepare_model

    where = plan.out / "warm_start"
    cfg = load_base(plan, [f"model.path={base_model_path(plan)}", f"train.output_dir={where}"])
    return prepare_model(cfg, where)


# ----------------------------------------------------------------------------- running cells


@dataclass
class CellJob:
    cell: Cell
    dir: Path
    overrides: list[str]
    argv: list[str]
    env: dict[str, str]
    resume: bool  # argv continues the cell from its checkpoint (else it starts over)


class SubprocessRunner:
    """Runs a cell's `megapo train` as a child process, output to <cell>/train.log. `stop()` asks the running
    children to checkpoint and exit (SIGTERM, megapo.trainer.stop), and kills those still there after
    `grace_s`."""

    def __init__(self, grace_s: float = 120.0):
        self.grace_s = grace_s
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def __call__(self, job: CellJob) -> int:
        with open(job.dir / "train.log", "a", encoding="utf-8") as logf:
            logf.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(job.argv)}\n")
            logf.flush()
            proc = subprocess.Popen(job.argv, stdout=logf, stderr=subprocess.STDOUT, env=job.env)
            with self._lock:
                self._running.add(proc)
            try:
                return proc.wait()
            finally:
                with self._lock:
                    self._running.discard(proc)

    def stop(self) -> None:
        with self._lock:
            running = list(self._running)
        for proc in running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("cell process %d did not stop within %.0f s; killing it", proc.pid, self.grace_s)
                proc.kill()
                proc.wait()


def is_done(cell_dir: Path) -> bool:
    return (cell_dir / DONE_FILE).is_file()


def last_step(cell_dir: Path) -> int | None:
    from megapo.trainer.metrics import read_metrics

    if not (cell_dir / "metrics.jsonl").is_file():
        return None
    rows = read_metrics(cell_dir)
    return max((int(r["step"]) for r in rows), default=None)


def cell_job(plan: GridPlan, cell: Cell, model_path: Path, steps: int) -> CellJob:
    from megapo.trainer import checkpoint as ckpt

    cell_dir = plan.cell_dir(cell)
    resume = plan.resume and ckpt.latest_checkpoint(cell_dir / "checkpoints") is not None
    overrides = cell_overrides(plan, cell, str(model_path), steps)
    argv = [sys.executable, "-m", "megapo.cli", "train", str(plan.config), *plan.sets, *overrides,
            "--resume" if resume else "--overwrite"]
    threads = str(plan.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    return CellJob(cell, cell_dir, overrides, argv, env, resume)


def run_one(plan: GridPlan, job: CellJob, steps: int, runner: Callable[[CellJob], int]) -> str:
    """Run a cell; mark it done when it exited 0 with metrics up to its last step. Returns its status."""
    job.dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(job.dir / CELL_FILE, {"cell": asdict(job.cell), "name": job.cell.name,
                                            "overrides": job.overrides})
    log.info("cell %s: %s", job.cell.name, "resuming from its checkpoint" if job.resume else "starting")
    t0 = time.perf_counter()
    rc = runner(job)
    reached = last_step(job.dir)
    if rc != 0 or reached != steps:
        log.warning("cell %s: exit code %s, metrics up to step %s of %d: unfinished", job.cell.name, rc, reached, steps)
        return "unfinished"
    write_json_atomic(job.dir / DONE_FILE, {"name": job.cell.name, "steps": steps, "exit_code": rc,
                                            "seconds": round(time.perf_counter() - t0, 1)})
    log.info("cell %s: done (%.0f s)", job.cell.name, time.perf_counter() - t0)
    return "done"


def run_cells(plan: GridPlan, todo: list[Cell], model_path: Path, steps: int,
              runner: Callable[[CellJob], int] | None, status: dict[str, str]) -> None:
    """`plan.jobs` cells at a time; the next starts only when one ends, so nothing is queued when an interrupt
    (or a runner raising one) stops the grid: the running cells are stopped and it propagates."""
    own_runner = runner is None
    runner = SubprocessRunner() if own_runner else runner
    queue = iter(todo)
    running: dict = {}
    bar = Progress(len(todo), "stability grid", stream=sys.stderr)  # a line per ended cell; a bar on a terminal
    bar.update(0)
    with ThreadPoolExecutor(max_workers=plan.jobs) as pool, bar.around_logs():
        try:
            while True:
                while len(running) < plan.jobs and (cell := next(queue, None)) is not None:
                    running[pool.submit(run_one, plan, cell_job(plan, cell, model_path, steps), steps, runner)] = cell
                if not running:
                    break
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    cell = running.pop(future)
                    try:
                        status[cell.name] = future.result()
                    except Exception:  # one broken cell does not stop the others; it is rerun next time
                        log.exception("cell %s failed", cell.name)
                        status[cell.name] = "unfinished"
                    ended = sum(status.get(c.name) is not None for c in todo)
                    bar.line(f"stability grid: {ended}/{len(todo)} cells ended ({cell.name}: {status[cell.name]})",
                             done=ended)
        except BaseException:
            if own_runner:
                runner.stop()
            raise
        finally:
            bar.close()


def run_grid(plan: GridPlan, runner: Callable[[CellJob], int] | None = None,
             warm_start: Callable[[GridPlan], Path] = make_warm_start) -> dict[str, str]:
    """Run the plan's unfinished cells (done ones are skipped), then write the report. Returns cell -> status
    (done, skipped: done before, unfinished). An interrupt stops the running cells and propagates."""
    steps = config_steps(plan)
    cells = plan.cells()
    check_grid_folder(plan, steps)
    validate_cells(plan, cells, steps)
    plan.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(plan.out / GRID_FILE, {**shared_settings(plan, steps), "config": str(plan.config)})
    status = {c.name: "skipped" for c in cells if is_done(plan.cell_dir(c))}
    todo = [c for c in cells if c.name not in status]
    log.info("stability grid %s: %d cells, %d done before, %d to run (%d at a time, %d threads each)", plan.grid,
             len(cells), len(status), len(todo), plan.jobs, plan.threads)
    if todo:
        run_cells(plan, todo, warm_start(plan), steps, runner, status)
    write_report(plan, steps)
    return status


# ----------------------------------------------------------------------------- the report


def _values(rows: list[dict], keys: tuple[str, ...]) -> tuple[list[float], str | None]:
    """The per-step values of the first key in `keys` that any row holds, and that key."""
    for key in keys:
        values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
        if values:
            return values, key
    return [], None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def cell_summary(plan: GridPlan, cell: Cell, steps: int) -> dict:
    """One summary row: the cell's axes, status, held-out accuracy, collapse verdict and mismatch metrics."""
    from megapo.trainer.collapse import accuracy_dip, detect_collapse, rows_by_step
    from megapo.trainer.metrics import read_metrics

    cell_dir = plan.cell_dir(cell)
    row = {"cell": cell.name, "setting": cell.setting, "label": cell.label, **asdict(cell),
           "overrides": cell.overrides(), "options": cell.options,
           "status": "done" if is_done(cell_dir) else "unfinished" if (cell_dir / "metrics.jsonl").is_file()
           else "not started"}
    if row["status"] == "not started":
        return row
    rows = rows_by_step(read_metrics(cell_dir))
    accuracy, _ = _values(rows, ("eval/accuracy",))
    verdict = detect_collapse(rows)
    row.update(last_step=max(int(r["step"]) for r in rows) if rows else None, steps=steps,
               start_accuracy=accuracy[0] if accuracy else None, final_accuracy=accuracy[-1] if accuracy else None,
               best_accuracy=max(accuracy) if accuracy else None, collapsed=verdict.collapsed,
               collapse_step=verdict.step, collapse_reason=verdict.reason, dip_step=accuracy_dip(rows), read={})
    for name, keys in METRIC_KEYS.items():
        values, key = _values(rows, keys)
        row[f"{name}_mean"] = _mean(values)
        if name in ("mismatch_kl", "max_abs_dlogp", "router_disagree"):
            row[f"{name}_max"] = max(values) if values else None
        row["read"][name] = key
    return row


def setting_summary(rows: list[dict]) -> list[dict]:
    """Rows of one setting (its seeds) into one: collapse rate over the finished seeds, means of the rest."""
    by_setting: dict[str, list[dict]] = {}
    for r in rows:
        by_setting.setdefault(r["setting"], []).append(r)
    out = []
    for setting, group in by_setting.items():
        done = [r for r in group if r["status"] == "done"]
        first = group[0]
        entry = {"setting": setting, **{a: first[a] for a in AXES}, "variant": first.get("variant", ""),
                 "noise": first.get("noise", 0.0), "options": first.get("options", []),
                 "label": first.get("label", first["objective"]), "seeds": len(group), "done": len(done),
                 "collapsed": sum(bool(r["collapsed"]) for r in done),
                 "collapse_rate": sum(bool(r["collapsed"]) for r in done) / len(done) if done else None,
                 "dipped": sum(r.get("dip_step") is not None for r in done),
                 "final_accuracies": [r["final_accuracy"] for r in done]}
        for key in ("final_accuracy", "best_accuracy", "mismatch_kl_mean", "router_disagree_mean",
                    "disagree_post_mean", "tokens_per_s_mean"):
            entry[key] = _mean([r[key] for r in done if r.get(key) is not None])
        entry["mismatch_kl_max"] = max((r["mismatch_kl_max"] for r in done if r.get("mismatch_kl_max") is not None),
                                       default=None)
        out.append(entry)
    return sorted(out, key=_axis_order)


def _axis_order(entry: dict) -> tuple:
    objective = entry["objective"]  # the grid's objectives in AXES order, then --objectives' by name, then variants
    if entry.get("variant"):
        rank = (2, 0, entry["variant"])
    else:
        rank = (0, AXES["objective"].index(objective), "") if objective in AXES["objective"] else (1, 0, objective)
    mismatch = entry["mismatch"]
    corrections = (*AXES["mismatch"], *(x for _, _, x in DOSE_ALTERNATIVES if x not in AXES["mismatch"]))
    correction = (0, corrections.index(mismatch), "") if mismatch in corrections else (1, 0, mismatch)
    return (entry["mini_batches"], rank, AXES["replay"].index(entry["replay"]), correction, entry.get("noise", 0.0))


def cells_on_disk(plan: GridPlan) -> list[Cell]:
    found = []
    for path in sorted((plan.out / "cells").glob(f"*/{CELL_FILE}")):
        found.append(Cell(**json.loads(path.read_text())["cell"]))
    return found


def report_cells(plan: GridPlan) -> list[Cell]:
    """The plan's cells and any other cell a previous run of this folder started (e.g. of the full grid); a cell
    that ran is reported as its cell.json says (the options it ran with, e.g. an sspo cell of before issue 32)."""
    cells = plan.cells()
    ran = {c.name: c for c in cells_on_disk(plan)}
    names = {c.name for c in cells}
    return [ran.get(c.name, c) for c in cells] + [c for c in ran.values() if c.name not in names]


COLLAPSE_RULE = ("eval/accuracy < start - 0.1 from some eval to the last one, or reward < 0.05 on 10 consecutive "
                 "steps, or a non-finite loss (megapo.trainer.collapse); dipped: eval/accuracy < start - 0.1 at some "
                 "eval, recovered from or not")


def write_report(plan: GridPlan, steps: int) -> dict:
    """summary.json, table.md and plots/ from the cells' metrics (what `--report-only` writes)."""
    cells = report_cells(plan)
    rows = [cell_summary(plan, c, steps) for c in cells]
    settings = setting_summary(rows)
    warm = plan.out / "warm_start" / "sft" / "sft_result.json"
    summary = {"grid": plan.grid, "config": str(plan.config), "steps": steps, "sets": plan.sets,
               "warm_start": {k: v for k, v in json.loads(warm.read_text()).items() if k != "history"}
               if warm.is_file() else None,
               "collapse_rule": COLLAPSE_RULE,
               "metric_keys": METRIC_KEYS, "settings": settings, "cells": rows,
               "doses": dose_summary(rows, settings) if any(c.noise for c in cells) else []}
    plan.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(plan.out / "summary.json", summary)
    (plan.out / "table.md").write_text(table_markdown(summary))
    grid_cells_ = [c for c in cells if c.objective in AXES["objective"] and not c.variant]
    summary["plots"] = [str(p) for p in write_plots(plan, grid_cells_)]
    if summary["doses"]:
        summary["plots"].append(str(write_dose_plot(plan, summary)))
    regime = [c for c in cells if (c.replay, c.mini_batches, c.mismatch) == tuple(OBJECTIVE_REGIME.values())]
    plain = [c for c in regime if not c.variant]
    if any(c.objective not in AXES["objective"] for c in plain):  # --objectives: one figure for all of them,
        summary["plots"].append(str(write_objectives_plot(plan, plain)))  # beside the grid's own objectives
    variants = [c for c in regime if c.variant]
    if variants:  # --variants: one figure, beside the baseline they modify and gspo
        base = [c for c in plain if c.objective in (VARIANT_OBJECTIVE, "gspo", *VARIANT_OBJECTIVES.values())]
        summary["plots"].append(str(write_objectives_plot(
            plan, base + variants, name="variants-m8.png",
            title=f"{VARIANT_OBJECTIVE} with one stage / option each, no replay, no correction, 8 optimizer steps "
                  "per rollout")))
    return summary


def _fmt(value, kind: str = "acc") -> str:
    if value is None:
        return "–"
    if kind == "acc":
        return f"{value:.3f}"
    if kind == "sci":
        return f"{value:.1e}"
    return f"{value:.0f}"


def _options(options: list[str]) -> str:
    return f"`{' '.join(options)}`" if options else "–"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.2f} %"


def dose_summary(rows: list[dict], settings: list[dict]) -> list[dict]:
    """One entry per dose (router noise σ) the cells ran at, lowest first: the disagreement DOSES calibrated it
    to and the one its finished cells measured (the mean over them of their mean router/disagree), with the
    collapse count and final accuracy of each of its settings."""
    out = []
    for noise in sorted({r.get("noise", 0.0) for r in rows}):
        done = [r for r in rows if r.get("noise", 0.0) == noise and r["status"] == "done"]
        measured = [r["router_disagree_mean"] for r in done if r.get("router_disagree_mean") is not None]
        out.append({"noise": noise, "calibrated_disagree": DOSES.get(noise), "measured_disagree": _mean(measured),
                    "measured_cells": len(measured), "cells": sum(r.get("noise", 0.0) == noise for r in rows),
                    "done": len(done),
                    "settings": [s["setting"] for s in settings if s.get("noise", 0.0) == noise]})
    return out


def dose_markdown(summary: dict) -> list[str]:
    """The dose section of table.md: the calibration against what the cells measured, then one row per setting
    with its collapse count and final held-out accuracy at each dose."""
    doses = summary["doses"]
    lines = ["## Router disagreement dose (`--grid dose`: rollout.router_noise σ on the engine's router logits)", "",
             "Calibrated: the share of (token, layer) router decisions differing, engine vs learner, that σ gave on "
             "the warm start (one batch; DOSES in tools/bench/stability.py). Measured: the mean router/disagree "
             "of the dose's finished cells (over their steps).", "",
             "| σ | calibrated disagree | measured disagree | cells done |", "|---|---|---|---|"]
    lines += [f"| {d['noise']:g} | {_pct(d['calibrated_disagree'])} | {_pct(d['measured_disagree'])} | "
              f"{d['done']} / {d['cells']} |" for d in doses]
    by_row: dict[tuple, dict[float, dict]] = {}
    for s in summary["settings"]:
        key = (s["mini_batches"], s.get("label", s["objective"]), s["replay"], s["mismatch"])
        by_row.setdefault(key, {})[s.get("noise", 0.0)] = s
    by_row = {k: v for k, v in by_row.items() if any(n > 0 for n in v)}  # the rows some dose ran
    shown = [d["measured_disagree"] if d["measured_disagree"] is not None else d["calibrated_disagree"] for d in doses]
    heads = [f"σ {d['noise']:g} ({_pct(x)})" for d, x in zip(doses, shown)]
    lines += ["", "Collapsed / finished seeds, then the final held-out accuracy (mean), at each dose (its disagreement "
              "in brackets: measured, else calibrated; –: not run or not finished). Options: the row's overrides "
              "of the config (with its dose's rollout.router_noise when σ > 0).", "",
              "| m | objective | replay | correction | " + " | ".join(heads) + " | options |",
              "|" + "---|" * (5 + len(doses))]
    for (m, label, replay, mismatch), at in by_row.items():
        cells = []
        for d in doses:
            s = at.get(d["noise"])
            cells.append("–" if s is None or not s["done"] else
                         f"{s['collapsed']} / {s['done']} · {_fmt(s['final_accuracy'])}")
        options = next(s for s in at.values()).get("options", [])
        options = [o for o in options if not o.startswith("rollout.router_noise=")]
        lines.append(f"| {m} | {label} | {replay} | {mismatch} | " + " | ".join(cells) + f" | {_options(options)} |")
    return lines + [""]


def table_markdown(summary: dict) -> str:
    sets = f", overrides `{' '.join(summary['sets'])}`" if summary["sets"] else ""
    lines = [f"# Stability grid `{summary['grid']}`: {summary['steps']} RL steps per cell", "",
             f"Config `{summary['config']}`{sets}. Collapsed: {summary['collapse_rule']}. Accuracies are means over "
             "the finished seeds; KL and disagreement are per-step means (max: the largest step).", ""]
    if summary["warm_start"]:
        w = summary["warm_start"]
        lines += [f"Warm start: SFT validation exact-match {w['val_accuracy']:.3f} after {w['steps']} steps.", ""]
    if summary.get("doses"):
        lines += dose_markdown(summary)
    dosed = bool(summary.get("doses"))  # a router noise column when some rows have a dose
    header = ("| objective | replay | correction | " + ("router noise σ | " if dosed else "") +
              "collapsed / seeds | dipped | final acc | final acc per seed | best acc | mismatch k3 mean | k3 max | "
              "router disagree | after replay | tok/s | options |")
    for m in sorted({s["mini_batches"] for s in summary["settings"]}):
        lines += [f"## {m} optimizer step{'s' if m > 1 else ''} per rollout (train.mini_batches={m})", "", header,
                  "|" + "---|" * (15 if dosed else 14)]
        for s in (s for s in summary["settings"] if s["mini_batches"] == m):
            unfinished = f" ({s['seeds'] - s['done']} unfinished)" if s["done"] < s["seeds"] else ""
            noise = f"{s.get('noise', 0.0):g} | " if dosed else ""
            lines.append(f"| {s.get('label', s['objective'])} | {s['replay']} | {s['mismatch']} | {noise}"
                         f"{s['collapsed']} / {s['done']}"
                         f"{unfinished} | {s.get('dipped', 0)} | {_fmt(s['final_accuracy'])} | "
                         f"{' / '.join(_fmt(a) for a in s.get('final_accuracies', []))} | {_fmt(s['best_accuracy'])} | "
                         f"{_fmt(s['mismatch_kl_mean'], 'sci')} | {_fmt(s['mismatch_kl_max'], 'sci')} | "
                         f"{_fmt(s['router_disagree_mean'])} | {_fmt(s['disagree_post_mean'])} | "
                         f"{_fmt(s['tokens_per_s_mean'], 'int')} | {_options(s.get('options', []))} |")
        lines.append("")
    variants = {r["variant"]: [o for o in r["overrides"] if o.split("=", 1)[0] not in CELL_FIELDS]
                for r in summary["cells"] if r.get("variant")}
    if variants:
        lines += [f"## Variants: {VARIANT_OBJECTIVE} with one stage or option of issue 14 (`--variants`)", "",
                  "| variant | overrides |", "|---|---|"]
        lines += [f"| {name} | `{' '.join(o)}` |" for name, o in sorted(variants.items())]
        lines.append("")
    extra = {r["objective"]: OBJECTIVE_OVERRIDES[r["objective"]] for r in summary["cells"]
             if r["objective"] in OBJECTIVE_OVERRIDES and not r.get("variant")}
    if extra:
        lines += ["## Objectives with overrides a run needs (OBJECTIVE_OVERRIDES; in the options column too)", "",
                  "| objective | overrides |", "|---|---|"]
        lines += [f"| {name} | `{' '.join(o)}` |" for name, o in sorted(extra.items())]
        lines.append("")
    lines += ["## Cells", "", "| cell | status | start acc | final acc | collapsed at | reason | dipped at |",
              "|---|---|---|---|---|---|---|"]
    for r in summary["cells"]:
        collapsed_at = r.get("collapse_step") if r.get("collapsed") else "–"
        dipped_at = r.get("dip_step") if r.get("dip_step") is not None else "–"
        lines.append(f"| {r['cell']} | {r['status']} | {_fmt(r.get('start_accuracy'))} | "
                     f"{_fmt(r.get('final_accuracy'))} | {collapsed_at} | {r.get('collapse_reason') or '–'} | "
                     f"{dipped_at} |")
    return "\n".join(lines) + "\n"


def write_objectives_plot(plan: GridPlan, cells: list[Cell], name: str = "objectives-m8.png",
                          title: str = "every objective, no replay, no correction, 8 optimizer steps per rollout"
                          ) -> Path:
    """Held-out accuracy against step, mean over seeds, one line per setting (objective or variant), in
    OBJECTIVE_REGIME; the small grid's own objectives solid, the others dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megapo.trainer.metrics import read_metrics
    from megapo.trainer.plot import series

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for label in sorted({c.label for c in cells}):
        runs = [dict(zip(*series(read_metrics(plan.cell_dir(c)), "eval/accuracy")))
                for c in cells if c.label == label and is_done(plan.cell_dir(c))]
        steps = sorted(set.intersection(*(set(r) for r in runs))) if runs else []
        if steps:
            ax.plot(steps, [sum(r[s] for r in runs) / len(runs) for s in steps], marker=".",
                    label=f"{label} ({len(runs)})", linestyle="-" if label in AXES["objective"] else "--")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy (mean over seeds)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(ncol=3, fontsize=8)
    path = plan.out / "plots" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_plots(plan: GridPlan, cells: list[Cell]) -> list[Path]:
    """Per (objective, correction): held-out accuracy and mismatch KL against step, one column per off-policy
    degree, a colour per replay mode (one line per seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megapo.trainer.metrics import read_metrics
    from megapo.trainer.plot import series

    out_dir = plan.out / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    colours = {"off": "tab:red", "r2": "tab:orange", "r3": "tab:blue"}
    written = []
    for objective, mismatch, noise in sorted({(c.objective, c.mismatch, c.noise) for c in cells}):
        group = [c for c in cells if (c.objective, c.mismatch, c.noise) == (objective, mismatch, noise)
                 and (plan.cell_dir(c) / "metrics.jsonl").is_file()]
        if not group:
            continue
        degrees = sorted({c.mini_batches for c in group})
        fig, axes = plt.subplots(2, len(degrees), figsize=(4.5 * len(degrees), 6.5), squeeze=False, sharey="row")
        labelled = set()
        for col, m in enumerate(degrees):
            acc_ax, kl_ax = axes[0][col], axes[1][col]
            for c in sorted((c for c in group if c.mini_batches == m), key=lambda c: (c.replay, c.seed)):
                rows = read_metrics(plan.cell_dir(c))
                label = c.replay if (m, c.replay) not in labelled else None
                labelled.add((m, c.replay))
                acc_ax.plot(*series(rows, "eval/accuracy"), color=colours[c.replay], alpha=0.8, label=label)
                kl_key = next((k for k in METRIC_KEYS["mismatch_kl"] if series(rows, k)[0]), None)
                if kl_key is not None:
                    steps, kl = series(rows, kl_key)
                    kept = [(s, v) for s, v in zip(steps, kl) if v > 0]  # log scale
                    if kept:
                        kl_ax.plot(*zip(*kept), color=colours[c.replay], alpha=0.8, label=label)
            acc_ax.set_title(f"m={m}: held-out accuracy")
            kl_ax.set_title(f"m={m}: mismatch k3 KL (engine vs learner)")
            kl_ax.set_yscale("log")
            for ax in (acc_ax, kl_ax):
                ax.set_xlabel("step")
                ax.grid(alpha=0.3)
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(title="replay")
        dose = f", router noise σ {noise:g}" if noise else ""
        fig.suptitle(f"objective {objective}, correction {mismatch}{dose} (one line per seed)")
        fig.subplots_adjust(hspace=0.35, wspace=0.3)  # fixed margins: tight_layout's text measuring is slow
        path = out_dir / f"{objective}-{mismatch}{f'-n{noise:g}' if noise else ''}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def write_dose_plot(plan: GridPlan, summary: dict) -> Path:
    """plots/dose.png: collapse rate and final held-out accuracy (mean over finished seeds) against the router
    disagreement each dose's cells measured (calibrated where none did), a line per replay mode of ppo without
    correction, a panel per m; the other settings run at a dose (DOSE_ALTERNATIVES) as labelled markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_of = {d["noise"]: d["measured_disagree"] if d["measured_disagree"] is not None else d["calibrated_disagree"]
            for d in summary["doses"]}
    settings = [s for s in summary["settings"] if x_of.get(s.get("noise", 0.0)) and s["done"]]
    degrees = sorted({s["mini_batches"] for s in settings}) or [1]
    fig, axes = plt.subplots(2, len(degrees), figsize=(5.5 * len(degrees), 7), squeeze=False, sharex=True,
                             sharey="row")
    colours = {"off": "tab:red", "r2": "tab:orange", "r3": "tab:blue"}
    markers = iter("osD^vP*Xh")
    marker_of: dict[str, str] = {}
    for col, m in enumerate(degrees):
        rate_ax, acc_ax = axes[0][col], axes[1][col]
        at_m = [s for s in settings if s["mini_batches"] == m]
        for replay in AXES["replay"]:
            line = sorted((s for s in at_m if (s["objective"], s["mismatch"], s.get("variant", ""), s["replay"])
                           == ("ppo", "none", "", replay)), key=lambda s: s.get("noise", 0.0))
            if not line:
                continue
            xs = [100 * x_of[s.get("noise", 0.0)] for s in line]
            rate_ax.plot(xs, [s["collapse_rate"] for s in line], marker="o", color=colours[replay],
                         label=f"ppo, replay {replay}")
            acc_ax.plot(xs, [s["final_accuracy"] for s in line], marker="o", color=colours[replay],
                        label=f"ppo, replay {replay}")
        for s in at_m:  # the alternatives: one marker each
            if (s["objective"], s["mismatch"], s.get("variant", "")) == ("ppo", "none", ""):
                continue
            name = f"{s.get('label', s['objective'])}, {s['replay']}, {s['mismatch']}"
            marker = marker_of.setdefault(name, next(markers, "o"))
            x = 100 * x_of[s.get("noise", 0.0)] * 1.07 ** (list(marker_of).index(name) + 1)  # apart from the lines
            rate_ax.scatter([x], [s["collapse_rate"]], marker=marker, color="black", alpha=0.7, label=name)
            acc_ax.scatter([x], [s["final_accuracy"]], marker=marker, color="black", alpha=0.7, label=name)
        rate_ax.set_title(f"m={m}: collapse rate")
        acc_ax.set_title(f"m={m}: final held-out accuracy")
        rate_ax.set_ylim(-0.05, 1.05)
        for ax in (rate_ax, acc_ax):
            ax.set_xscale("log")
            ax.grid(alpha=0.3, which="both")
        acc_ax.set_xlabel("router decisions differing, engine vs learner (%)")  # (the dose's cells' mean)
        if acc_ax.get_legend_handles_labels()[0]:
            acc_ax.legend(fontsize=7)
    fig.suptitle("router disagreement dose (rollout.router_noise): collapse and accuracy by replay mode")
    fig.subplots_adjust(hspace=0.3, wspace=0.25)
    path = plan.out / "plots" / "dose.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- estimate and CLI


def estimate_seconds(n_cells: int, steps: int, jobs: int, step_s: float, startup_s: float,
                     warm_start_s: float) -> float:
    """Wall time of a grid: the warm start, then the cells `jobs` at a time, each its start-up plus its steps
    (step_s: a step's time with the cell's share of the cores)."""
    waves = -(-n_cells // jobs)
    return warm_start_s + waves * (startup_s + steps * step_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="base run config every cell overrides")
    parser.add_argument("--grid", default="small", choices=GRIDS,
                        help="small: the three questions; full: every axis; dose: router noise x replay x m "
                             "(issue 30)")
    parser.add_argument("--out", default="runs/stability", help="grid folder (cells, warm start, report)")
    parser.add_argument("--seeds", type=int, default=None,
                        help=f"seeds per setting (train.seed 0..N-1; default {DEFAULT_SEEDS})")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per cell (default: the config's train.steps)")
    parser.add_argument("--jobs", type=int, default=None, help="cells at a time (default: cores // 2, at least 1)")
    parser.add_argument("--threads", type=int, default=None, help="OpenMP threads per cell (default: cores // jobs)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="a config override for every cell (repeatable), e.g. --set rollout.dtype=float32")
    parser.add_argument("--cells", default="", help="comma-separated cell names: run only these cells of the grid")
    parser.add_argument("--objectives", default="",
                        help="comma-separated objectives, or all: add each as a setting with no replay, no "
                             "correction and train.mini_batches=8 (where the small grid's baseline collapses)")
    parser.add_argument("--variants", default="",
                        help="comma-separated VARIANTS names, or all: each a stage or option of issue 14 on ppo, "
                             "as one more setting in the --objectives regime")
    parser.add_argument("--resume", action="store_true",
                        help="continue unfinished cells from their checkpoint (default: restart them)")
    parser.add_argument("--report-only", action="store_true", help="rewrite summary/table/plots; run nothing")
    parser.add_argument("--dry-run", action="store_true", help="print the cells and a time estimate; run nothing")
    parser.add_argument("--assume-step-s", type=float, default=0.5, help="--dry-run: seconds per RL step of a cell")
    parser.add_argument("--assume-startup-s", type=float, default=30.0,
                        help="--dry-run: seconds a cell takes to start (imports, learner, engine, first eval)")
    parser.add_argument("--assume-warm-start-s", type=float, default=120.0, help="--dry-run: seconds of the SFT")


def check_run_args(args: argparse.Namespace) -> Path:
    """The flags every grid of runs shares: --seeds/--steps/--jobs/--threads >= 1 when given, --config a file
    (returned). Shared with megapo bench length."""
    for name in ("seeds", "steps", "jobs", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name}", f"must be >= 1, got {value}")
    config = Path(args.config)
    if not config.is_file():
        raise ConfigError("--config", f"{config} does not exist")
    return config


def plan_from_args(args: argparse.Namespace) -> GridPlan:
    config = check_run_args(args)
    for i, s in enumerate(args.sets):
        if "=" not in s:
            raise ConfigError(f"--set[{i}]", f"expected section.field=value, got {s!r}")
        if args.grid == "dose" and s.split("=", 1)[0].strip() == "rollout.router_noise":
            raise ConfigError(f"--set[{i}]", "the dose grid sets rollout.router_noise per cell (DOSES)")
    jobs = args.jobs or max(1, cores() // 2)
    seeds = args.seeds or DEFAULT_SEEDS
    return GridPlan(config=config.resolve(), out=Path(args.out).resolve(), grid=args.grid, seeds=seeds,
                    steps=args.steps, jobs=jobs, threads=args.threads or max(1, cores() // jobs),
                    sets=list(args.sets), resume=args.resume, only=[c for c in args.cells.split(",") if c],
                    objectives=objective_names(args.objectives) if args.objectives else [],
                    variants=variant_names(args.variants) if args.variants else [])


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    plan = plan_from_args(args)
    if args.report_only:
        if not (plan.out / GRID_FILE).is_file():
            raise ConfigError("--out", f"{plan.out} holds no stability grid ({GRID_FILE} is missing)")
        made = json.loads((plan.out / GRID_FILE).read_text())  # what the cells ran with
        plan.sets, plan.config = made["sets"], Path(made["config"])
        summary = write_report(plan, made["steps"])
        print(f"wrote {plan.out / 'summary.json'}, {plan.out / 'table.md'}, {len(summary['plots'])} plot(s)")
        return 0
    if args.dry_run:
        steps = config_steps(plan)
        cells = plan.cells()
        validate_cells(plan, cells, steps)
        for c in cells:
            print(c.name)
        est = estimate_seconds(len(cells), steps, plan.jobs, args.assume_step_s, args.assume_startup_s,
                               args.assume_warm_start_s)
        print(f"{len(cells)} cells x {steps} steps, {plan.jobs} at a time ({plan.threads} threads each): about "
              f"{est / 60:.0f} min at {args.assume_step_s} s/step, {args.assume_startup_s:.0f} s start-up per cell, "
              f"{args.assume_warm_start_s:.0f} s warm start")
        return 0
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a killed grid stops its cells at a checkpoint too
    try:
        status = run_grid(plan)
    except KeyboardInterrupt:
        print(f"stability grid: stopped; finished cells are kept, rerun the same command to continue "
              f"(--resume continues the stopped cells from their checkpoints)", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    unfinished = [name for name, s in status.items() if s == "unfinished"]
    more = "..." if len(unfinished) > 5 else ""
    which = f" ({', '.join(unfinished[:5])}{more}; rerun to continue)" if unfinished else ""
    print(f"stability grid: {sum(s == 'done' for s in status.values())} cells run, "
          f"{sum(s == 'skipped' for s in status.values())} done before, {len(unfinished)} unfinished{which}; "
          f"wrote {plan.out / 'table.md'}")
    return 1 if unfinished else 0
