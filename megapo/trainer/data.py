"""Prompts for RL: where they come from, how they are tokenized, in what order.

- `check_data_files` reads local jsonl/parquet files cheaply (no tokenizer) so `RunConfig.validate`
  can refuse an empty file or a malformed row before anything starts.
- `load_examples` loads them through Hugging Face `datasets`; `task_examples` gives a built-in task.
- `encode_prompts` applies the chat template (or not) and drops prompts over the token limit, with a count.
- `PromptSource` hands out batches in a seeded shuffled order; its `DataCursor` (epoch, index, seed)
  is saved in checkpoints so a resumed run continues with exactly the next prompts.
- `select_informative` is DAPO's dynamic sampling: groups whose samples all got the same reward
  carry no group-relative signal, so they are dropped and the batch refilled.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from megapo.config import ConfigError
from megapo.tasks.base import Example

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
BUILTIN_TASKS = ("addition",)


def _format(path: str, field: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ConfigError(field, f"{path}: unsupported file type {suffix!r}; use .jsonl or .parquet")
    return FORMATS[suffix]


def check_data_files(paths: Sequence[str], prompt_key: str, answer_key: str, field: str = "data.train_files") -> int:
    """Row count over `paths`; ConfigError naming the file (and line) when a file is missing, empty, or a row
    lacks a string prompt / an answer."""
    total = 0
    for i, path in enumerate(paths):
        fname = f"{field}[{i}]"
        if not Path(path).is_file():
            raise ConfigError(fname, f"{path} does not exist")
        if _format(path, fname) == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path)
            columns = meta.schema_arrow.names
            for key, kname in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
                if key not in columns:
                    raise ConfigError(kname, f"{path} has no column {key!r} (columns: {', '.join(columns)})")
            rows = meta.metadata.num_rows
        else:
            rows = 0
            with open(path, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ConfigError(fname, f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
                    if not isinstance(row, dict):
                        raise ConfigError(fname, f"{path}:{lineno}: row is not a JSON object")
                    if not isinstance(row.get(prompt_key), str):
                        raise ConfigError(fname, f"{path}:{lineno}: no string field {prompt_key!r} (data.prompt_key)")
                    if answer_key not in row:
                        raise ConfigError(fname, f"{path}:{lineno}: no field {answer_key!r} (data.answer_key)")
                    rows += 1
        if rows == 0:
            raise ConfigError(fname, f"{path} holds no rows")
        total += rows
    return total


def load_examples(paths: Sequence[str], prompt_key: str, answer_key: str) -> list[Example]:
    """All rows of local jsonl/parquet files as Examples, read with Hugging Face `datasets`."""
    import datasets

    if not paths:
        return []
    fmt = _format(paths[0], "data.train_files")
    ds = datasets.load_dataset(fmt, data_files=list(paths), split="train")
    return [Example(str(row[prompt_key]), str(row[answer_key])) for row in ds]


def task_examples(task: str, split: str, n: int | None = None, seed: int | None = None) -> list[Example]:
    if task == "addition":
        from megapo.tasks import addition

        return addition.examples(split, n, seed)
    raise ConfigError("data.task", f"unknown task {task!r}; built-in: {', '.join(BUILTIN_TASKS)}")


# ----------------------------------------------------------------------------- tokenization


def encode_prompt(tokenizer, text: str, chat_template: bool) -> list[int]:
    """Token ids of a prompt: raw text (plus the tokenizer's BOS if it has one), or one user turn
    through the tokenizer's chat template with the assistant header appended."""
    if chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    return list(ids)


def encode_answer(tokenizer, text: str) -> list[int]:
    """Target ids for supervised training: the answer then end-of-sequence."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]


@dataclass
class EncodedPrompts:
    examples: list[Example]
    prompt_ids: list[list[int]]
    dropped_too_long: int


def encode_prompts(tokenizer, examples: Sequence[Example], chat_template: bool, max_prompt_tokens: int) -> EncodedPrompts:
    kept, ids, dropped = [], [], 0
    for ex in examples:
        p = encode_prompt(tokenizer, ex.prompt, chat_template)
        if len(p) > max_prompt_tokens:
            dropped += 1
            continue
        kept.append(ex)
        ids.append(p)
    return EncodedPrompts(kept, ids, dropped)


class PromptPool:
    """Indexable prompts: `pool[i] -> (Example, prompt ids)`.

    From files, every prompt is tokenized up front and over-long ones are dropped (with a count).
    A built-in task's training split has ~10^6 problems: those are made and tokenized on demand
    (the task's prompts are all short, so none is dropped)."""

    def __init__(self, tokenizer, chat_template: bool, max_prompt_tokens: int, *, task: str = "",
                 examples: Sequence[Example] | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.dropped_too_long = 0
        self._ids: list[list[int]] | None = None  # pre-tokenized prompts (files), or None (made on demand)
        if task:
            if task != "addition":
                raise ConfigError("data.task", f"unknown task {task!r}; built-in: {', '.join(BUILTIN_TASKS)}")
            from megapo.tasks import addition

            ids = addition.split_ids("train")
            self._size = len(ids)
            self._get = lambda i: addition.example(ids[i])
        else:
            enc = encode_prompts(tokenizer, examples or [], chat_template, max_prompt_tokens)
            self.dropped_too_long = enc.dropped_too_long
            self._size = len(enc.examples)
            self._get = lambda i: enc.examples[i]
            self._ids = enc.prompt_ids

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, i: int) -> tuple[Example, list[int]]:
        ex = self._get(i)
        if self._ids is not None:
            return ex, self._ids[i]
        return ex, encode_prompt(self.tokenizer, ex.prompt, self.chat_template)


# ----------------------------------------------------------------------------- order


@dataclass
class DataCursor:
    """Where a PromptSource is: pass `epoch`, position `index` in that epoch's order, shuffle `seed`."""

    epoch: int = 0
    index: int = 0
    seed: int = 0

    def state_dict(self) -> dict:
        return asdict(self)


class PromptSource:
    """Batches of indices into a dataset of `size` items, reshuffled each epoch (seed + epoch), resumable."""

    def __init__(self, size: int, seed: int = 0, shuffle: bool = True, cursor: DataCursor | None = None):
        if size <= 0:
            raise ValueError("PromptSource needs at least one item")
        self.size = size
        self.shuffle = shuffle
        self.cursor = cursor or DataCursor(seed=seed)
        self._order_epoch = -1
        self._order = np.arange(size)

    def _order_for(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order = (np.random.default_rng([self.cursor.seed, epoch]).permutation(self.size)
                           if self.shuffle else np.arange(self.size))
            self._order_epoch = epoch
        return self._order

    def next_batch(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            order = self._order_for(self.cursor.epoch)
            take = min(k - len(out), self.size - self.cursor.index)
            out.extend(int(i) for i in order[self.cursor.index:self.cursor.index + take])
            self.cursor.index += take
            if self.cursor.index == self.size:
                self.cursor.epoch += 1
                self.cursor.index = 0
        return out

    def state_dict(self) -> dict:
        return self.cursor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.cursor = DataCursor(**state)
        self._order_epoch = -1


# ----------------------------------------------------------------------------- dynamic sampling


def select_informative(group_rewards: Sequence[Sequence[float]], eps: float = 1e-8) -> list[int]:
    """Indices of the groups whose rewards are not all equal."""
    return [i for i, rs in enumerate(group_rewards) if len(rs) > 1 and max(rs) - min(rs) > eps]


@dataclass
class DynamicSamplingStats:
    rounds: int
    groups_sampled: int
    groups_kept: int


def fill_informative(sample_round: Callable[[], list], rewards_of: Callable[[object], Sequence[float]],
                     target_groups: int, max_rounds: int) -> tuple[list, DynamicSamplingStats]:
    """Call `sample_round()` (a list of groups) until `target_groups` informative groups are collected
    or `max_rounds` rounds have run; returns at most target_groups groups (fewer if rounds ran out)."""
    kept: list = []
    sampled = rounds = 0
    while len(kept) < target_groups and rounds < max_rounds:
        groups = sample_round()
        rounds += 1
        sampled += len(groups)
        keep = select_informative([rewards_of(g) for g in groups])
        kept.extend(groups[i] for i in keep)
    kept = kept[:target_groups]
    return kept, DynamicSamplingStats(rounds, sampled, len(kept))
