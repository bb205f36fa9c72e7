"""`megapo rm-train`: train a Bradley-Terry reward model on preference pairs.

    megapo rm-train --model RM_DIR --pairs PAIRS.jsonl --out OUT_DIR [--steps N --lr X --batch-pairs B
                    --eval-pairs HELD_OUT.jsonl --chat-template --tp N --pp N --ep N --dp N ...]

RM_DIR: an HF *ForSequenceClassification folder with one label (`megapo tiny-model --head score`, or one this
command wrote), or a *ForCausalLM folder of a family with a score head (the SFT policy, as InstructGPT starts its
reward model: the body's weights, the LM head left out, the score head starting at zeros). PAIRS lines:
{"prompt": P, "chosen": C, "rejected": R}, each a string (encoded with RM_DIR's tokenizer: the prompt as the
trainer encodes prompts, raw or through the chat template with --chat-template; a response as the answer then
end-of-sequence, the shape of the policy's samples) or a list of token ids (used as they are). The loss is
−log σ(r(P+C) − r(P+R)), averaged over --batch-pairs pairs per Adam step, the score r taken at each sequence's last
token (megapo.learner.score). OUT_DIR: the trained model as an HF folder transformers loads
(AutoModelForSequenceClassification; from a causal LM, its config.json made a one-label
<Family>ForSequenceClassification one), with rm_train.jsonl (one line of metrics per step, then the held-out
accuracy on --eval-pairs). Inputs and layout are checked before any process starts; a layout of more than one
process runs under torchrun.

`addition_pairs(split, n, seed, negatives)` makes pairs from the addition task: the correct sum against a wrong one,
drawn uniformly or one digit away from it (negatives="near", the mistakes a policy makes).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from megapo.config import ConfigError, OptimConfig, ParallelConfig

FIELDS = ("prompt", "chosen", "rejected")
MAX_SUM = 1998  # 999 + 999: the largest answer of the addition task


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="HF *ForSequenceClassification folder, or a *ForCausalLM one (head at zeros)")
    parser.add_argument("--pairs", required=True, help='JSONL of {"prompt", "chosen", "rejected"} (text or token ids)')
    parser.add_argument("--out", required=True, help="where to write the trained HF folder")
    parser.add_argument("--eval-pairs", default=None, help="held-out pairs: the accuracy r_chosen > r_rejected at the end")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-pairs", type=int, default=32, help="pairs per optimizer step")
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--chat-template", action="store_true", help="text prompts through the tokenizer's chat template")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--dispatcher", default="alltoall", choices=("alltoall", "allgather"))
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before the processes are killed")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set for torchrun's processes


# ----------------------------------------------------------------------------- pairs


def addition_pairs(split: str, n: int, seed: int, negatives: str = "uniform") -> list[dict]:
    """`n` pairs of the addition task's `split`: the prompt, its correct sum, and a wrong sum (four digits, as the
    answers are). `negatives`: "uniform" draws it from the other possible sums 0..1998; "near" changes one digit of
    the correct sum (see `near_miss`)."""
    from megapo.tasks import addition

    wrong_sum = {"uniform": uniform_miss, "near": near_miss}.get(negatives)
    if wrong_sum is None:
        raise ValueError(f"negatives: must be uniform or near, got {negatives!r}")
    rng = random.Random(seed)
    return [{"prompt": ex.prompt, "chosen": ex.answer, "rejected": wrong_sum(ex.answer, rng)}
            for ex in addition.examples(split, n, seed)]


def uniform_miss(answer: str, rng: random.Random) -> str:
    """A sum other than `answer`, uniform over 0..1998."""
    wrong = rng.randrange(MAX_SUM)
    wrong += wrong >= int(answer)  # skips the right one
    return f"{wrong:04d}"


def near_miss(answer: str, rng: random.Random) -> str:
    """`answer` with one digit changed (a random position, a random other digit), redrawn until it is a sum the
    task can have (<= 1998): the near misses a policy makes, harder to tell apart than a uniform wrong sum."""
    while True:
        i = rng.randrange(len(answer))
        digit = rng.choice([d for d in "0123456789" if d != answer[i]])
        wrong = answer[:i] + digit + answer[i + 1:]
        if int(wrong) <= MAX_SUM:
            return wrong


def read_pairs(path, field: str) -> list[dict]:
    """The rows of a pairs file; ConfigError(field) naming `path:line` for one without the three fields as strings
    or non-empty token-id lists, or a file with none."""
    from megapo.commands.logprobs import _is_token_id
    from megapo.trainer.data import read_jsonl

    path = Path(path)
    if not path.is_file():
        raise ConfigError(field, f"{path} does not exist")
    rows = []
    for n, row in read_jsonl(path, field):
        if not isinstance(row, dict) or any(k not in row for k in FIELDS):
            raise ConfigError(field, f'{path}:{n}: expected {{"prompt": ..., "chosen": ..., "rejected": ...}}')
        for k in FIELDS:
            value = row[k]
            ids = isinstance(value, list) and all(_is_token_id(t) for t in value) and (value or k == "prompt")
            if not (isinstance(value, str) or ids):
                raise ConfigError(field, f"{path}:{n}: {k} must be a string or a list of token ids")
        rows.append(row)
    if not rows:
        raise ConfigError(field, f"{path} holds no pairs")
    return rows


def encode_pairs(rows: list[dict], tokenizer, chat_template: bool, vocab: int, field: str):
    """(prompt + chosen, prompt + rejected) token lists of each row; text through `tokenizer` (None: refused,
    naming the row)."""
    from megapo.trainer.data import encode_answer, encode_prompt

    def tokens(row: dict, key: str, n: int) -> list[int]:
        value = row[key]
        if isinstance(value, list):
            return value
        if tokenizer is None:
            raise ConfigError(field, f"row {n}: {key} is text, but --model has no tokenizer (give token ids)")
        return encode_prompt(tokenizer, value, chat_template) if key == "prompt" else encode_answer(tokenizer, value)

    pairs = []
    for n, row in enumerate(rows, 1):
        prompt = tokens(row, "prompt", n)
        chosen, rejected = prompt + tokens(row, "chosen", n), prompt + tokens(row, "rejected", n)
        if max(chosen + rejected) >= vocab or min(chosen + rejected) < 0:
            raise ConfigError(field, f"row {n}: token ids must be in [0, {vocab})")
        pairs.append((chosen, rejected))
    return pairs


def load_pairs(path, model_dir, chat_template: bool, vocab: int, field: str):
    return encode_pairs(read_pairs(path, field), _tokenizer(model_dir), chat_template, vocab, field)


def _tokenizer(model_dir):
    from megapo.trainer.data import _tokenizer_if_present

    try:
        return _tokenizer_if_present(str(model_dir))
    except ConfigError as err:
        raise ConfigError("--model", err.message) from None


# ----------------------------------------------------------------------------- command


def _optim(args) -> OptimConfig:
    optim = OptimConfig(lr=args.lr, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
                        grad_clip=args.grad_clip)
    try:
        optim.validate()
    except ConfigError as err:  # named as the flag that set the field
        raise ConfigError(f"--{err.field.split('.')[-1].replace('_', '-')}", err.message) from None
    return optim


def check_model_folder(model_dir, parallel: ParallelConfig) -> dict:
    """config.json of a reward-model folder, or of a causal LM of a family with a score head, that fits
    `parallel`; ConfigError naming --model or the layout's field."""
    from megapo.commands.score import check_model
    from megapo.layout import check_layout, read_hf_config
    from megapo.learner.score import head_source

    hf = read_hf_config(model_dir, "--model")
    if head_source(hf, "--model", model_dir) == "score":
        return check_model(model_dir, parallel)  # the reward-model checks `megapo score` makes
    check_layout(parallel, hf)
    _check_causal_folder(model_dir, hf)
    return hf


def _check_causal_folder(model_dir, hf: dict) -> None:
    """ConfigError("--model") unless the causal LM's family has a score head and the folder has weights."""
    from megapo.learner.score import score_family
    from megapo.models.family import family_for
    from megapo.weights.hf_load import SafetensorsReader

    try:
        family = family_for(hf)
    except ConfigError as err:  # it names "model"
        raise ConfigError("--model", err.message) from None
    score_family(family, "--model")
    try:
        SafetensorsReader(model_dir)
    except FileNotFoundError as err:
        raise ConfigError("--model", str(err).removeprefix("model: ")) from None


def check_args(args) -> tuple[ParallelConfig, dict]:
    """Everything checked before a process starts (ConfigError naming the flag)."""
    for name in ("steps", "batch_pairs", "micro_batch_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", f"must be >= 1, got {getattr(args, name)}")
    _optim(args)
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, dp=args.dp, dispatcher=args.dispatcher)
    hf = check_model_folder(args.model, parallel)
    load_pairs(args.pairs, args.model, args.chat_template, hf["vocab_size"], "--pairs")
    if args.eval_pairs is not None:
        load_pairs(args.eval_pairs, args.model, args.chat_template, hf["vocab_size"], "--eval-pairs")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{out} exists and is not a folder")
    if out.resolve() == Path(args.model).resolve():
        raise ConfigError("--out", "must differ from --model (the model is read while the result is written)")
    return parallel, hf


def run(args: argparse.Namespace) -> int:
    parallel, hf = check_args(args)
    if args.worker or parallel.world_size == 1:
        return _work(args, parallel, hf)
    from megapo.launch.local import run_workers

    return run_workers(["-m", "megapo.commands.rm_train", "--worker", *_to_argv(args)], parallel.world_size,
                       timeout_s=args.timeout)


def _to_argv(args) -> list[str]:
    argv = ["--model", str(args.model), "--pairs", str(args.pairs), "--out", str(args.out),
            "--steps", str(args.steps), "--lr", repr(args.lr), "--batch-pairs", str(args.batch_pairs),
            "--warmup-steps", str(args.warmup_steps), "--weight-decay", repr(args.weight_decay),
            "--grad-clip", repr(args.grad_clip), "--seed", str(args.seed),
            "--tp", str(args.tp), "--pp", str(args.pp), "--ep", str(args.ep), "--dp", str(args.dp),
            "--dispatcher", args.dispatcher, "--micro-batch-tokens", str(args.micro_batch_tokens)]
    if args.eval_pairs is not None:
        argv += ["--eval-pairs", str(args.eval_pairs)]
    if args.chat_template:
        argv.append("--chat-template")
    return argv


def _work(args, parallel: ParallelConfig, hf: dict) -> int:
    import torch

    from megapo.learner.score import ScoreModel, head_source

    pairs = load_pairs(args.pairs, args.model, args.chat_template, hf["vocab_size"], "--pairs")
    model = ScoreModel(args.model, parallel, _optim(args), seed=args.seed, micro_batch_tokens=args.micro_batch_tokens,
                       total_steps=args.steps, frozen=False, head=head_source(hf, "--model", args.model),
                       field="--model")
    rank0 = torch.distributed.get_rank() == 0
    log = []
    for step, batch in enumerate(_batches(pairs, args.batch_pairs, args.steps, args.seed), 1):
        metrics = model.train_pairs(batch)
        log.append({"step": step, **{k: metrics[k] for k in ("loss", "accuracy", "margin", "grad_norm", "lr")}})
        if rank0 and (step == 1 or step % 20 == 0 or step == args.steps):
            print(f"rm-train step {step}: loss {metrics['loss']:.4f}, batch accuracy {metrics['accuracy']:.3f}",
                  flush=True)
    held_out = None
    if args.eval_pairs is not None:
        held_out = pair_accuracy(model, load_pairs(args.eval_pairs, args.model, args.chat_template,
                                                   hf["vocab_size"], "--eval-pairs"))
    out = write_hf_folder(model, args.model, args.out)
    if rank0:
        if held_out is not None:
            log.append({"held_out_accuracy": held_out})
            print(f"rm-train: held-out accuracy {held_out:.3f} ({args.eval_pairs})")
        (out / "rm_train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in log))
        print(f"rm-train: {args.steps} steps; wrote {out}")
    model.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


def write_hf_folder(model, source_dir, out_dir) -> Path | None:
    """The score model as an HF folder transformers loads (collective; rank 0 writes): its tensors, the source
    folder's config.json (a causal LM's made a one-label *ForSequenceClassification one) and tokenizer files.
    Returns the folder on rank 0."""
    import shutil

    import torch

    from megapo.convert.hf_writer import ShardWriter
    from megapo.layout import read_hf_config
    from megapo.learner.score import head_source

    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    out_dir, source_dir = Path(out_dir), Path(source_dir)
    writer = None
    if rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
        writer = ShardWriter(out_dir, max_shard_bytes=2 * 2**30, dtype=torch.float32)
    for name, tensor in model.hf_state_dict():
        if writer is not None:
            writer.add(name, tensor)
    if writer is None:
        return None
    writer.close()
    for f in source_dir.iterdir():  # config, tokenizer, chat template: everything but the weights
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out_dir / f.name)
    if head_source(read_hf_config(source_dir, "--model"), "--model", source_dir) == "zeros":  # a causal LM's config
        write_score_config(source_dir, out_dir)
    return out_dir


def write_score_config(source_dir, out_dir) -> None:
    """out_dir/config.json: the causal LM's config as transformers writes a one-label sequence classifier's
    (num_labels 1 as id2label / label2id, architectures <Family>ForSequenceClassification, pad_token_id kept)."""
    import transformers

    from megapo.learner.score import CAUSAL_SUFFIX, SCORE_SUFFIX

    config = transformers.AutoConfig.from_pretrained(source_dir)
    config.num_labels = 1
    config.architectures = [a.removesuffix(CAUSAL_SUFFIX) + SCORE_SUFFIX for a in config.architectures or []
                            if a.endswith(CAUSAL_SUFFIX)]
    config.save_pretrained(out_dir)


def _batches(pairs: list, size: int, steps: int, seed: int):
    """`steps` batches of `size` pairs, each epoch in a new seeded order."""
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(steps):
        batch = []
        while len(batch) < size:
            if not order:
                order = list(range(len(pairs)))
                rng.shuffle(order)
            batch.append(pairs[order.pop()])
        yield batch


def pair_accuracy(model, pairs: list) -> float:
    """The fraction of pairs whose chosen sequence scores above its rejected one (collective)."""
    scores = model.scores([c for c, _ in pairs] + [r for _, r in pairs])
    return sum(scores[i] > scores[len(pairs) + i] for i in range(len(pairs))) / len(pairs)


def main() -> int:  # torchrun's processes (--worker)
    from megapo.cli import module_main

    return module_main("megapo rm-train", add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
