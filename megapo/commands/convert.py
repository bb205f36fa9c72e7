"""`megapo convert`: Hugging Face <-> Megatron-core (torch_dist) checkpoints, with the learner's mapping.

    megapo convert hf-to-megatron --hf HF_DIR --out CKPT [--tp 2 --pp 1 --ep 2] [--verify]
    megapo convert megatron-to-hf --ckpt CKPT --out HF_DIR [--model HF_DIR] [--tp ...] [--max-shard-size 2GB]
                                  [--dtype auto|float32|bfloat16|float16] [--verify]
    megapo convert verify --hf HF_DIR --ckpt CKPT [--model HF_DIR] [--tp ...]

hf-to-megatron writes the torch_dist files (weights only, under the key Learner.save uses: a learner
loads them with `load(ckpt, load_optimizer=False)`), the HF config/tokenizer files, and
megapo_checkpoint.json (family, source, layout). megatron-to-hf writes safetensors (one file, or
shards + model.safetensors.index.json above --max-shard-size) plus config/tokenizer, so transformers
loads the folder offline. It also reads a trainer checkpoint (step_N/ or its learner/ folder) given
--model, the HF folder it was trained from, for the config and tokenizer.

There is no separate reshard command: a torch_dist checkpoint loads under any layout (--tp/--pp/--ep
of megatron-to-hf, or a learner's own layout), as long as the padded vocabulary matches.

Before any process starts, everything is checked: the config (a field the converter does not
implement is refused, never guessed), tensor names and shapes against the config, the layout, a trainer
checkpoint's files against its manifest (size and sha256). A worker's failure ends the output with its one
line (the first failing rank's, megapo.worker_errors) and exit code 1 (2 for bad input), no traceback. The
work runs in tp*pp*dp processes (torchrun, gloo on CPU) and writes into OUT.tmp-XXXX, renamed to OUT
only when everything (including --verify) succeeded; on failure the temporary folder is removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from megapo.config import ConfigError, ParallelConfig
from megapo.learner.precision import ENGINE_DTYPES
from megapo.progress import Progress
from megapo.worker_errors import WorkersFailed

SUBCOMMAND = "direction"  # megapo.cli names it in error messages: `megapo convert hf-to-megatron: ...`
FORMAT = "megapo-megatron-torch_dist"
DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    h2m = sub.add_parser("hf-to-megatron", help="HF safetensors -> Megatron torch_dist checkpoint")
    h2m.add_argument("--hf", required=True, help="HF model folder (config.json, safetensors, tokenizer)")
    h2m.add_argument("--out", required=True, help="checkpoint folder to create (must not exist)")
    _layout_args(h2m, "layout the model is built with while saving (the checkpoint loads under any layout)")
    _verify_args(h2m)

    m2h = sub.add_parser("megatron-to-hf", help="Megatron torch_dist checkpoint -> HF safetensors")
    m2h.add_argument("--ckpt", required=True, help="torch_dist folder, or a trainer checkpoint step folder")
    m2h.add_argument("--out", required=True, help="HF folder to create (must not exist)")
    m2h.add_argument("--model", help="HF folder with the config and tokenizer (required when the checkpoint "
                                     "has no config.json, e.g. a trainer checkpoint)")
    m2h.add_argument("--max-shard-size", default="2GB", help="largest safetensors file, e.g. 5GB, 500MB (default 2GB)")
    m2h.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16", *ENGINE_DTYPES),
                     help="tensor dtype written (fp32 | bf16 | fp16 name the same three); auto: the source HF dtype "
                          "recorded at conversion, else float32")
    _layout_args(m2h, "layout the checkpoint is loaded with")
    _verify_args(m2h)

    ver = sub.add_parser("verify", help="compare an HF folder with a checkpoint on a few sequences")
    ver.add_argument("--hf", required=True, help="HF model folder")
    ver.add_argument("--ckpt", required=True, help="torch_dist checkpoint folder")
    ver.add_argument("--model", help="HF folder with the checkpoint's config (when the checkpoint has none)")
    _layout_args(ver, "layout the checkpoint is loaded with")
    _verify_args(ver, flag=False)


def _layout_args(parser: argparse.ArgumentParser, what: str) -> None:
    group = parser.add_argument_group("layout", what)
    for name in ("tp", "pp", "ep", "dp"):
        group.add_argument(f"--{name}", type=int, default=1)
    group.add_argument("--timeout", type=float, default=3600, help="seconds before the processes are killed")
    # tests: make the workers fail at a given point, to check that nothing partial is left behind
    group.add_argument("--inject-failure", default="", help=argparse.SUPPRESS)


def _verify_args(parser: argparse.ArgumentParser, flag: bool = True) -> None:
    if flag:
        parser.add_argument("--verify", action="store_true",
                            help="after converting, compare HF transformers and the Megatron learner on a few "
                                 "sequences (log-probs and entropies); fail above --verify-tol")
    parser.add_argument("--verify-tol", type=float, default=None, help="tolerance of --verify (default 1e-4)")


def max_local_processes() -> int:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(4, os.cpu_count() or 1)  # gloo processes may oversubscribe a small CPU


def run(args: argparse.Namespace) -> int:
    planners = {"hf-to-megatron": plan_hf_to_megatron, "megatron-to-hf": plan_megatron_to_hf, "verify": plan_verify}
    with tempfile.TemporaryDirectory(prefix="megapo_convert_") as scratch:
        plan = planners[args.direction](args, Path(scratch))
        return run_plans([plan], args.timeout)[0]


# ----------------------------------------------------------------------------------------- plans


@dataclass
class Plan:
    """One conversion: checked inputs, the workers' job, and what the parent does once they succeed."""

    command: str
    job: object  # megapo.convert.worker.Job
    parallel: ParallelConfig
    finish: Callable[[], bool]  # after the workers: copy files, compare, commit; False = failed
    job_path: Path  # where the job file is written for the workers
    stage: "_Staging | None" = None  # the output folder being written (None for verify)


def run_plans(plans: list[Plan], timeout_s: float) -> list[int]:
    """Run the plans' jobs one after the other in one torchrun launch (so they must share a world
    size), then finish each; returns an exit code per plan. Outputs of failed plans are removed."""
    if len({p.parallel.world_size for p in plans}) != 1:
        raise ConfigError("--tp/--pp/--dp", "plans launched together must use the same number of processes")
    codes = []
    # units: the workers' launch, then each plan's finish (copy, verify, commit); lines on stderr, a bar on a terminal
    bar = Progress(1 + len(plans), "convert", stream=sys.stderr)
    try:
        for plan in plans:
            if plan.stage is not None:
                plan.stage.create()
        commands = ", ".join(p.command for p in plans)
        bar.line(f"convert: {commands} in {plans[0].parallel.world_size} process(es)", done=0)
        start = time.perf_counter()
        try:
            _launch(plans, timeout_s)
        except WorkersFailed as exc:  # the first failing rank's one line, as the last line (megapo.worker_errors)
            bar.clear()
            for plan in plans:
                _failed(plan, str(exc))
            return [exc.code] * len(plans)
        bar.line(f"convert: the workers finished in {time.perf_counter() - start:.0f} s (1/{bar.total})", done=1)
        for i, plan in enumerate(plans, 2):
            bar.clear()  # finish prints its own lines
            ok = plan.finish()
            if plan.stage is not None:
                if ok:
                    plan.stage.commit()
                else:
                    _failed(plan, "verify failed")
            codes.append(0 if ok else 1)
            if ok:
                bar.line(f"convert {plan.command}: done ({i}/{bar.total})", done=i)
        return codes
    finally:
        bar.close()
        for plan in plans:
            if plan.stage is not None:
                plan.stage.discard()


def plan_hf_to_megatron(args, scratch: Path) -> Plan:
    from megapo.convert import inputs

    parallel = _parallel(args)
    src = inputs.read_hf(args.hf, "--hf")
    inputs.check_parallel(parallel, src.hf, max_local_processes())
    out = inputs.check_output(args.out, "--out")
    tol = _tol(args)
    stage = _Staging(out)
    job = _job("hf_to_megatron", src.folder, parallel, args, scratch, hf_dir=str(src.folder), ckpt=str(stage.tmp))
    seqs = _attach_verify(job, args, src.spec)
    start = time.perf_counter()

    def finish() -> bool:
        for path in inputs.side_files(src.folder):
            shutil.copy2(path, stage.tmp / path.name)
        meta = {"format": FORMAT, "version": 1, "family": src.family.name, "contents": "model weights (fp32)",
                "source": {"hf": str(src.folder.resolve()), "dtype": _source_dtype(src.dtypes)},
                "saved_with": {"tp": parallel.tp, "pp": parallel.pp, "ep": parallel.ep, "dp": parallel.dp},
                "padded_vocab": _padded(src.spec.vocab_size, parallel.tp)}
        if seqs is not None:
            result = _compare(src.folder, job, seqs, tol)
            meta["verify"] = {"max_logprob_diff": result.max_logprob_diff, "max_entropy_diff": result.max_entropy_diff}
            if not result.ok:
                return False
        # written last: a folder with this file is a complete conversion
        (stage.tmp / inputs.MEGAPO_META).write_text(json.dumps(meta, indent=1) + "\n")
        print(f"wrote {src.family.name} checkpoint {out} (saved with tp={parallel.tp} pp={parallel.pp} "
              f"ep={parallel.ep}) in {time.perf_counter() - start:.1f} s")
        return True

    return Plan("hf-to-megatron", job, parallel, finish, _job_path(job), stage)


def plan_megatron_to_hf(args, scratch: Path) -> Plan:
    from megapo.convert import inputs
    from megapo.convert.hf_writer import parse_size
    from megapo.convert.support import expected_hf_tensors

    parallel = _parallel(args)
    _check_manifest(args.ckpt, "--ckpt")
    ckpt = inputs.read_checkpoint(args.ckpt, "--ckpt", args.model)
    inputs.check_parallel(parallel, ckpt.model.hf, max_local_processes())
    inputs.check_vocab_rows(ckpt, parallel)
    out = inputs.check_output(args.out, "--out")
    try:
        max_shard = parse_size(args.max_shard_size)
    except ValueError as exc:
        raise ConfigError("--max-shard-size", str(exc)) from None
    dtype = ENGINE_DTYPES.get(args.dtype, args.dtype)  # bf16 -> bfloat16, ...
    if dtype == "auto":
        dtype = (ckpt.meta or {}).get("source", {}).get("dtype") or "float32"
    tol = _tol(args)
    spec = ckpt.model.spec
    stage = _Staging(out)
    job = _job("megatron_to_hf", ckpt.model.folder, parallel, args, scratch, ckpt=str(ckpt.folder),
               out=str(stage.tmp), max_shard_bytes=max_shard, dtype=dtype,
               expected={k: list(v) for k, v in expected_hf_tensors(ckpt.model.family, spec).items()})
    seqs = _attach_verify(job, args, spec)
    start = time.perf_counter()

    def finish() -> bool:
        for path in inputs.side_files(ckpt.model.folder):
            shutil.copy2(path, stage.tmp / path.name)
        config = dict(ckpt.model.hf)
        config["dtype"] = dtype
        config.pop("torch_dtype", None)
        (stage.tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if seqs is not None and not _compare(stage.tmp, job, seqs, tol).ok:
            return False
        files = sorted(p.name for p in stage.tmp.glob("*.safetensors"))
        print(f"wrote {ckpt.model.family.name} HF model {out} ({len(files)} safetensors file(s), {dtype}, loaded "
              f"with tp={parallel.tp} pp={parallel.pp} ep={parallel.ep}) in {time.perf_counter() - start:.1f} s")
        return True

    return Plan("megatron-to-hf", job, parallel, finish, _job_path(job), stage)


def plan_verify(args, scratch: Path) -> Plan:
    from megapo.convert import inputs

    parallel = _parallel(args)
    hf = inputs.read_hf(args.hf, "--hf")
    _check_manifest(args.ckpt, "--ckpt")
    ckpt = inputs.read_checkpoint(args.ckpt, "--ckpt", args.model)
    inputs.check_parallel(parallel, ckpt.model.hf, max_local_processes())
    inputs.check_vocab_rows(ckpt, parallel)
    if hf.spec.vocab_size != ckpt.model.spec.vocab_size:
        raise ConfigError("--hf", f"vocab_size {hf.spec.vocab_size} differs from the checkpoint's "
                                  f"{ckpt.model.spec.vocab_size}")
    tol = _tol(args)
    args.verify = True
    job = _job("verify", ckpt.model.folder, parallel, args, scratch, ckpt=str(ckpt.folder))
    seqs = _attach_verify(job, args, ckpt.model.spec)
    return Plan("verify", job, parallel, lambda: _compare(hf.folder, job, seqs, tol).ok, _job_path(job))


def _check_manifest(path, arg: str) -> None:
    """A trainer checkpoint (step_N/, or its learner/) against its manifest.json, before anything reads it:
    every file of learner/ present, of its size and sha256 (megapo.trainer.checkpoint); ConfigError naming
    the file otherwise. A checkpoint without a manifest (hf-to-megatron's, Megatron's own) is not checked."""
    from megapo.convert.inputs import find_checkpoint
    from megapo.trainer.checkpoint import MANIFEST, manifest_problems

    folder = find_checkpoint(path, arg)
    if folder.name != "learner" or not (folder.parent / MANIFEST).is_file():
        return
    problems = manifest_problems(folder.parent, "learner/")
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ConfigError(arg, f"{folder.parent} does not match its {MANIFEST}: {'; '.join(problems[:3])}{more}")


# ----------------------------------------------------------------------------------------- helpers


class _Staging:
    """OUT.tmp-XXXX next to OUT: renamed to OUT by commit(), removed by discard() if not committed."""

    def __init__(self, out: Path):
        self.out = out
        self.tmp = out.parent / f"{out.name}.tmp-{uuid.uuid4().hex[:8]}"
        self.committed = False

    def create(self) -> None:
        self.tmp.mkdir()

    def commit(self) -> None:
        os.rename(self.tmp, self.out)
        self.committed = True

    def discard(self) -> None:
        if not self.committed:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _parallel(args) -> ParallelConfig:
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, dp=args.dp)
    try:
        parallel.validate()
    except ConfigError as exc:
        raise ConfigError("--" + exc.field.split(".")[-1], str(exc).split(": ", 1)[-1]) from None
    return parallel


def _tol(args) -> float:
    from megapo.convert.verify import DEFAULT_TOL

    tol = DEFAULT_TOL if args.verify_tol is None else args.verify_tol
    if not tol > 0:
        raise ConfigError("--verify-tol", f"must be > 0, got {tol}")
    return tol


def _source_dtype(dtypes: set[str]) -> str:
    """The dtype to write back on export: the source's, when all its tensors share one we can write."""
    return DTYPES[next(iter(dtypes))] if len(dtypes) == 1 and next(iter(dtypes)) in DTYPES else "float32"


def _padded(vocab: int, tp: int) -> int:
    from megapo.models.family import padded_vocab

    return padded_vocab(vocab, tp)


def _job(op: str, config_dir: Path, parallel: ParallelConfig, args, scratch: Path, **kwargs):
    from megapo.convert.worker import Job

    name = uuid.uuid4().hex[:8]
    return Job(op=op, config_dir=str(Path(config_dir).resolve()), inject_failure=args.inject_failure,
               parallel={"tp": parallel.tp, "pp": parallel.pp, "ep": parallel.ep, "dp": parallel.dp},
               verify_out=str(scratch / f"{name}_megatron_logprobs.pt"), **kwargs)


def _attach_verify(job, args, spec):
    """Ask the workers for the learner's log-probs of the verify sequences; return the sequences."""
    from megapo.convert.verify import LENGTHS, sequences

    if not getattr(args, "verify", False):
        return None
    lengths = tuple(min(n, spec.max_positions) for n in LENGTHS)
    job.verify = True
    job.verify_sequences = sequences(spec.vocab_size, lengths=lengths)
    return job.verify_sequences


def _compare(hf_dir: Path, job, seqs, tol: float):
    from megapo.convert.verify import compare

    result = compare(hf_dir, job.verify_out, seqs, tol)
    print(result.summary(), file=sys.stdout if result.ok else sys.stderr)
    return result


def _job_path(job) -> Path:
    out = Path(job.verify_out)  # <scratch>/<id>_megatron_logprobs.pt, set by _job
    return out.with_name(out.name.split("_")[0] + "_job.json")


def _launch(plans: list[Plan], timeout_s: float) -> int:
    from megapo.launch.local import run_workers

    argv = ["-m", "megapo.convert.worker"]
    for plan in plans:
        plan.job.save(plan.job_path)
        argv += ["--job", str(plan.job_path)]
    return run_workers(argv, plans[0].parallel.world_size, timeout_s=timeout_s)


def _failed(plan: Plan, why: str) -> None:
    where = f"; nothing was written to {plan.stage.out}" if plan.stage is not None else ""
    print(f"megapo convert {plan.command}: {why}{where}", file=sys.stderr)
