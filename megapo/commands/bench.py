"""`megapo bench`: one entry point for megapo's benchmarks; each lives in its own module.

    megapo bench scaling [--layouts tp1,tp2,pp2,ep2,tp2xep2,dp2] [--sizes small,medium] --out DIR
    megapo bench projection --model qwen3-30b-a3b --gpus 8 --out FILE.json
    megapo bench stability [--grid small|full] [--out DIR] [--seeds N] [--jobs J] [--steps S] [--report-only]
    megapo bench length [--out DIR] [--methods all|a,b] [--seeds 2] [--jobs J] [--report-only]
    megapo bench tools --out DIR [--seeds 1] [--report-only]       (the multi-turn calculator task learns)
    megapo bench anytime --model HF_DIR --budgets 20,40,80 --out FILE.json   (anytime accuracy per thinking budget)
    megapo bench routes --out FILE.json [--prompts 64] [--samples 8] [--max-new 64]   (routes' host memory)
    megapo bench floor --out FILE.json [--steps 8] [section.field=value ...]   (tools/bench/floor.py)
    megapo bench distill --student DIR --teacher DIR --out DIR [--steps 60]   (distillation vs RL alone)
    megapo bench mismatch --out DIR [--quick] [--models ...] [--pairs ...]   (train-inference mismatch by precision)
    megapo bench share-prefix --out FILE.json [--repeats 5] [--cases main,long]   (shared-prefix packing)
    megapo bench memory --out FILE.json [--threads 1] [--steps 10] [--layouts ...]   (bytes per parameter)
    megapo bench second-models --out FILE.json [--rounds 5]   (teacher, reward model, critic vs the policy's step)
    megapo bench train-step --out FILE.json [...]     (tools/bench/train_step.py, its own arguments)
    megapo bench rollout --engine embedded [...]      (tools/bench/rollout.py)
    megapo bench weight-sync [...]                    (tools/bench/weight_sync.py)
    megapo bench learner-passes --baseline REV --out benchmarks/results/learner_passes.json [...]
                                                      (tools/bench/learner_passes.py)

scaling, projection, stability, length, tools, anytime, routes, floor, memory, distill, second-models, share-prefix
and mismatch parse their arguments here; the other four get the rest of the command line unchanged, as if their
module had been run with `python -m tools.bench.<name>`.
"""

from __future__ import annotations

import argparse
import importlib

SUBCOMMAND = "bench"  # megapo.cli names it in error messages: `megapo bench scaling: ...`
# name -> (module, help); "own" modules expose add_arguments/run, the others main(argv)
OWN = {"scaling": ("tools.bench.scaling", "RL step over layouts x model sizes: JSON + strong/weak scaling plots"),
       "projection": ("tools.bench.projection", "projected step and weight-sync time of Qwen3 MoE on N GPUs"),
       "stability": ("tools.bench.stability", "grid of short RL runs (objective x replay x off-policy degree x "
                                             "correction x seeds): collapse table and curves"),
       "floor": ("tools.bench.floor", "megapo's RL step vs a plain single-process PyTorch step (the floor)"),
       "length": ("tools.bench.length", "every length method x seeds from one warm start: accuracy vs tokens "
                                       "(summary, table, Pareto plot)"),
       "anytime": ("tools.bench.anytime", "AnytimeReasoner's held-out accuracy of a model at each thinking budget "
                   "(the thinking cut, the summary forced) and its mean, the area under the curve (JSON table)"),
       "tools": ("tools.bench.tools", "the multi-turn calculator task: held-out accuracy and tool use, warm start "
                                     "-> RL, per seed (summary, table, curves)"),
       "routes": ("tools.bench.routes", "host memory of routing-replay routes: one tiny batch measured, a "
                                       "DeepSeek-V3-sized batch projected"),
       "distill": ("tools.bench.distill", "RL with and without on-policy distillation from a teacher, same student "
                                         "and seed: held-out curves"),
       "memory": ("tools.bench.memory", "bytes per parameter of weights, grads and optimizer state (fp32 / bf16, "
                                       "distributed optimizer) on the tiny model, bf16 vs fp32 step time; projected "
                                       "GiB per GPU for Qwen3-30B-A3B and DeepSeek-V3"),
       "second-models": ("tools.bench.second_models", "each second model's cost per step (teacher log-probs, reward "
                         "model scores, critic values + update) against the policy's own train step, in one run; the "
                         "bytes of each role's weights"),
       "share-prefix": ("tools.bench.share_prefix", "the learner's train pass with each prompt held once "
                        "(train.share_prefix) vs unshared packing: tokens run and step time, main-job and long-prompt "
                        "batches"),
       "mismatch": ("tools.bench.mismatch", "train-inference mismatch, learner x engine precision on tiny MoE models: "
                                           "router disagreement, |dlogp|, k3, R3 off/on (summary.json, table.md)")}
PASSTHROUGH = {"train-step": ("tools.bench.train_step", "megapo train step vs raw Megatron forward_backward"),
               "rollout": ("tools.bench.rollout", "rollout throughput (embedded engine, vLLM)"),
               "weight-sync": ("tools.bench.weight_sync", "weight sync transports"),
               "learner-passes": ("tools.bench.learner_passes", "the learner's passes of one RL step on the main "
                                  "job's batch vs a baseline revision (benchmarks/results/learner_passes.json)")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name, (module, help_text) in OWN.items():
        importlib.import_module(module).add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    for name, (_, help_text) in PASSTHROUGH.items():
        # no option prefix: every argument after the name, options included, goes to the module untouched
        p = sub.add_parser(name, help=help_text, add_help=False, prefix_chars="\0")
        p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the benchmark module")


def run(args: argparse.Namespace) -> int:
    if args.bench in OWN:
        return int(importlib.import_module(OWN[args.bench][0]).run(args) or 0)
    module_name = PASSTHROUGH[args.bench][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        print(f"megapo bench {args.bench}: {module_name.replace('.', '/')}.py is not in this checkout")
        return 2
    return int(module.main(list(args.rest)) or 0)
