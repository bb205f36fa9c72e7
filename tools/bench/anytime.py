"""`megapo bench anytime`: AnytimeReasoner's anytime accuracy of a model, per thinking budget, as a JSON table.

    megapo bench anytime --model HF_DIR --budgets 20,40,80,160 --out anytime.json
                         [--task addition_cot] [--task-options '{graded: first}'] [--split test] [--n 200]
                         [--trigger ";"] [--summary-tokens 16] [--chat-template] [--batch-size 256]

Optimizing Anytime Reasoning via Budget Relative Policy Optimization (arXiv:2505.13438): each example's greedy
thinking is cut at every budget, the summary after the cut and the trigger is written greedily and verified; the
table holds acc@b per budget and their mean, the area under the anytime curve (megapo/trainer/anytime_eval.py, the
same code a training run with stage anytime logs as eval/anytime_acc@<b> and eval/anytime_auc).

HF_DIR: any HF causal-LM folder megapo's embedded engine loads (a run's base model or SFT warm start; a trainer
checkpoint step_N/ becomes one with `megapo convert megatron-to-hf --ckpt step_N --model BASE_HF_DIR --out HF_DIR`).
The trigger defaults to the task's summary_trigger (addition_cot: ";"). Every flag is checked before the model is
loaded; a refusal names it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megapo.config import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF causal-LM folder (the engine's weights and tokenizer)")
    parser.add_argument("--budgets", required=True, help="thinking budgets in response tokens, increasing: 20,40,80")
    parser.add_argument("--out", required=True, help="JSON file written: the per-budget table")
    parser.add_argument("--task", default="addition_cot", help="a built-in task or module:function")
    parser.add_argument("--task-options", default="{}", help="the task's options (YAML/JSON mapping)")
    parser.add_argument("--split", default="test", help="the task's split (held-out: test)")
    parser.add_argument("--n", type=int, default=None, help="the first n examples of the split (default: all)")
    parser.add_argument("--trigger", default=None, help="text after the cut that asks for the answer "
                        "(default: the task's summary_trigger)")
    parser.add_argument("--summary-tokens", type=int, default=16, help="max new tokens of a summary")
    parser.add_argument("--chat-template", action="store_true", help="wrap prompts in the tokenizer's chat template")
    parser.add_argument("--batch-size", type=int, default=256, help="prompts per engine call")


def parse_budgets(text: str) -> list[int]:
    """--budgets "20,40,80" as ints; ConfigError("--budgets") unless increasing positive ints."""
    from megapo.algorithms.anytime import checked_budgets

    parts = [x.strip() for x in str(text).split(",")]
    if not all(x.isdigit() for x in parts):
        raise ConfigError("--budgets", f"must be a comma-separated list of positive ints (response tokens), got {text!r}")
    try:
        return checked_budgets("--budgets", [int(x) for x in parts])
    except ValueError as err:
        raise ConfigError("--budgets", str(err).removeprefix("--budgets: ")) from None


def check_args(args: argparse.Namespace):
    """(task, budgets, trigger text) after every flag's refusal, each naming its flag."""
    import yaml

    from megapo.tasks.registry import get_task

    budgets = parse_budgets(args.budgets)
    for name in ("summary_tokens", "batch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", f"must be >= 1, got {getattr(args, name)}")
    options = yaml.safe_load(args.task_options) if args.task_options else {}
    if not isinstance(options, dict):
        raise ConfigError("--task-options", f"expected a mapping, got {args.task_options!r}")
    task = get_task(args.task, options, field="--task")
    if args.split not in task.sizes:
        raise ConfigError("--split", f"task {task.name!r} has the splits {', '.join(task.sizes)}, got {args.split!r}")
    if args.n is not None and not 1 <= args.n <= task.size(args.split):
        raise ConfigError("--n", f"must be in [1, {task.size(args.split)}] (the {args.split} split), got {args.n}")
    trigger = args.trigger if args.trigger is not None else task.summary_trigger or ""
    if not trigger:
        raise ConfigError("--trigger", f"task {task.name!r} has no summary_trigger: give the text that ends the "
                          "thinking and asks for the answer")
    if not (Path(args.model) / "config.json").is_file():
        raise ConfigError("--model", f"{args.model} holds no config.json (an HF folder)")
    return task, budgets, trigger


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from megapo.engines.embedded import EmbeddedEngine
    from megapo.trainer.anytime_eval import evaluate_anytime
    from megapo.trainer.likelihood_reward import encode_text

    task, budgets, trigger = check_args(args)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    engine = EmbeddedEngine(args.model, seed=0)
    try:
        result = evaluate_anytime(engine, task, tokenizer, budgets, encode_text(tokenizer, trigger),
                                  args.summary_tokens, split=args.split, n=args.n, chat_template=args.chat_template,
                                  batch_size=args.batch_size)
    finally:
        engine.close()
    table = {"model": str(args.model), "task": task.name, "split": args.split, "trigger": trigger,
             "summary_tokens": args.summary_tokens, **result.table()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=2) + "\n")
    print("budget  accuracy  ended  summaries")
    for row in table["rows"]:
        print(f"{row['budget']:>6}  {row['accuracy']:8.3f}  {row['ended']:5.2f}  {row['summaries']:>9}")
    print(f"AUC (mean over budgets) {table['auc']:.3f} on {table['examples']} examples -> {out}")
    return 0
