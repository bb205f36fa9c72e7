"""Input files and readers several case groups share: data configs and files (JSONL, Parquet), a data
refusal, and a run's metrics rows.
"""

from __future__ import annotations

import json
from pathlib import Path

from tools.probe.registry import refused


def _metrics_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _data_config(ctx, folder: Path, files: list[Path], **data):
    return ctx.config(folder, data={"task": "", "train_files": [str(f) for f in files], **data})


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _good_rows(n=4):
    return [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(1, n + 1)]


def _parquet(path: Path, columns: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def _data_refusal(ctx, name, files_of, *names, **data):
    folder = ctx.fresh(name)
    files = files_of(folder)
    out = ctx.train(_data_config(ctx, folder, files, **data))
    return refused(ctx, out, *names, forbid=(folder / "run",))
