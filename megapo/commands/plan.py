"""`megapo plan CONFIG [--nodes N --gpus-per-node G --gpu h100|h200|b200 --rollout-nodes M] [section.field=value ...]`:
the memory one learner GPU holds under the run's layout (weights, gradients, optimizer state, megapo's guard copy,
activations, routes, a colocated engine), term by term, and whether it fits the GPU (megapo/launch/plan.py has the
formulas). A layout that does not fit ends with exit code 2, naming the largest term and a layout of the same GPUs
that fits; `megapo launch slurm` runs the same check before it submits anything.
"""

from __future__ import annotations

import argparse

from megapo.config import ConfigError

INTERMIXED_ARGS = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG", help="run config YAML (as for `megapo train`)")
    p.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="dotted overrides, e.g. parallel.ep=8")
    p.add_argument("--nodes", type=int, default=1, help="nodes in all (learner + rollout), as for `megapo launch "
                                                        "slurm`")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--rollout-nodes", type=int, default=0, help="nodes that only run engine servers")
    p.add_argument("--gpu", default="h100", choices=("h100", "h200", "b200"), help="the GPU kind (its memory)")


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from megapo.launch import slurm
    from megapo.launch.plan import RunShape, check_fits, format_plan, plan_memory
    from megapo.models.family import family_for

    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ConfigError("--nodes", f"--nodes and --gpus-per-node must be >= 1, got {args.nodes}, {args.gpus_per_node}")
    if not 0 <= args.rollout_nodes < args.nodes:
        raise ConfigError("--rollout-nodes", f"must be in [0, --nodes={args.nodes}), got {args.rollout_nodes}")
    world = (args.nodes - args.rollout_nodes) * args.gpus_per_node
    run_spec = slurm.read_run(args.config, args.overrides)
    slurm.resolve_layout(run_spec, world, f"{args.nodes - args.rollout_nodes} learner node(s) x {args.gpus_per_node} GPUs")
    p = run_spec.parallel
    if not run_spec.dp_given:
        p = dataclasses.replace(p, dp=world // (p.tp * p.pp))
    shape = RunShape.from_config(run_spec.data, args.rollout_nodes)
    model = str(run_spec.data.get("model", {}).get("path"))
    print(format_plan(plan_memory(family_for(run_spec.hf_config).spec(run_spec.hf_config), p, shape, args.gpu,
                                  model)))
    check_fits(run_spec.hf_config, p, shape, world, args.gpu, model)  # LayoutError (exit 2) when it does not fit
    return 0
