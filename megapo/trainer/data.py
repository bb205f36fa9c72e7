"""Prompts for RL: where they come from, how they are tokenized, in what order.

- `read_jsonl` reads JSON Lines naming the file and line of bytes that are not UTF-8 or a line that is
  not JSON (a cut-off last line can be skipped instead: a file still being written).
- `load_examples` reads data sources (one list may mix them) into Examples: local jsonl/json/parquet files
  (megapo's own readers: an error names file:line), .arrow files, folders of such files, a dataset saved with
  HF `datasets`' save_to_disk, or a hub dataset name `org/name` (through `datasets`, its cache, offline mode
  honoured); every row needs a string prompt and a string (or integer) answer, else a ConfigError names the
  file and line (or the dataset and row).
- `check_sources` is the data part of `RunConfig.validate`: files, and when the model folder already
  holds its tokenizer, that some prompt fits data.max_prompt_tokens (a data.task comes from megapo.tasks.registry).
- `encode_prompts` applies the chat template (or not) and drops prompts over the token limit, with a count.
- `PromptSource` hands out batches in a seeded shuffled order; its `DataCursor` (epoch, index, seed)
  is saved in checkpoints so a resumed run continues with exactly the next prompts.
- `select_informative` is DAPO's dynamic sampling: groups whose samples all got the same reward
  carry no group-relative signal, so they are dropped and the batch refilled.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from megapo.config import ConfigError
from megapo.tasks.base import Example

log = logging.getLogger(__name__)

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _format(path: str, field: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ConfigError(field, f"{path}: unsupported file type {suffix!r}; use .jsonl, .json or .parquet")
    return FORMATS[suffix]


# ----------------------------------------------------------------------------- reading files


def read_jsonl(path: str | Path, field: str, skip_cut_tail: bool = False) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line; ConfigError(field) naming `path:line` when a
    line is not UTF-8 or not JSON. A last line without its newline that does not parse is a cut-off
    write: with `skip_cut_tail` it is skipped with a warning, else the error says the file looks cut off."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                value = json.loads(raw.decode("utf-8-sig" if lineno == 1 else "utf-8"))
            except UnicodeDecodeError as exc:
                problem = f"not UTF-8 (byte {exc.start + 1} of the line is {raw[exc.start:exc.start + 1]!r})"
            except json.JSONDecodeError as exc:
                problem = f"not valid JSON ({exc.msg}, column {exc.colno})"
            else:
                yield lineno, value
                continue
            cut = not raw.endswith(b"\n")
            if cut and skip_cut_tail:
                log.warning("%s:%d: skipped a cut-off last line (the file is still being written?)", path, lineno)
                return
            raise ConfigError(field, f"{path}:{lineno}: {problem}"
                              + ("; the file looks cut off (its last line has no newline)" if cut else ""))


def _describe(value: Any) -> str:
    """A JSON value as a user wrote it: null, true, the number 3, a list, ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return f"a {type(value).__name__}"


def _example(row: Any, where: str, prompt_key: str, answer_key: str, field: str) -> Example:
    """The Example of one row; ConfigError naming `where` (file:line or file: row N) when the row lacks a
    string prompt or a string/integer answer (a null, boolean or float answer would be scored as its
    text -- "None", "True", "4.0" -- so it is refused rather than converted)."""
    if not isinstance(row, dict):
        raise ConfigError(field, f"{where}: row is {_describe(row)}, not a JSON object")
    for key, key_field in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
        if key not in row:
            raise ConfigError(field, f"{where}: no field {key!r} ({key_field})")
    prompt, answer = row[prompt_key], row[answer_key]
    if not isinstance(prompt, str):
        raise ConfigError(field, f"{where}: {prompt_key!r} is {_describe(prompt)}; prompts must be strings")
    if isinstance(answer, bool) or not isinstance(answer, (str, int)):
        raise ConfigError(field, f"{where}: {answer_key!r} is {_describe(answer)}; answers must be strings "
                          "(or integers)")
    return Example(prompt, str(answer))


def _json_rows(path: str, field: str) -> Iterator[tuple[str, Any]]:
    """(where, row) of a .jsonl file, or of a .json file holding one array of rows."""
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if path.lower().endswith(".json") and head.startswith(b"["):
        try:
            rows = json.loads(Path(path).read_bytes().decode("utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(field, f"{path}: not a valid JSON array of rows ({exc})") from None
        yield from ((f"{path}: item {i + 1}", row) for i, row in enumerate(rows))
        return
    yield from ((f"{path}:{lineno}", row) for lineno, row in read_jsonl(path, field))


def _parquet_rows(path: str, prompt_key: str, answer_key: str, field: str) -> Iterator[tuple[str, Any]]:
    """(where, row) of a parquet file's prompt and answer columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path)
        columns = meta.schema_arrow.names
        for key, key_field in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
            if key not in columns:
                raise ConfigError(key_field, f"{path} has no column {key!r} (columns: {', '.join(columns)})")
        table = meta.read(columns=list(dict.fromkeys((prompt_key, answer_key))))
        prompts, answers = table.column(prompt_key).to_pylist(), table.column(answer_key).to_pylist()
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        raise ConfigError(field, f"{path}: not a readable parquet file ({exc})") from None
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        yield f"{path}: row {i + 1}", {prompt_key: prompt, answer_key: answer}


def file_examples(path: str, prompt_key: str, answer_key: str, field: str) -> list[Example]:
    """Every row of one jsonl/json/parquet file; ConfigError(field) naming the file (and line) when it is
    missing, unreadable, empty, or holds a malformed row."""
    if not Path(path).is_file():
        raise ConfigError(field, f"{path} does not exist")
    rows = (_parquet_rows(path, prompt_key, answer_key, field) if _format(path, field) == "parquet"
            else _json_rows(path, field))
    examples = [_example(row, where, prompt_key, answer_key, field) for where, row in rows]
    if not examples:
        raise ConfigError(field, f"{path} holds no rows")
    return examples


def load_examples(paths: Sequence[str], prompt_key: str, answer_key: str,
                  field: str = "data.train_files", split: str = "train") -> list[Example]:
    """All rows of the sources (see source_examples; kinds may be mixed) as Examples, in order."""
    return [ex for i, path in enumerate(paths)
            for ex in source_examples(path, prompt_key, answer_key, f"{field}[{i}]", split)]


DATA_SUFFIXES = (*FORMATS, ".arrow")
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name, as the hub spells a dataset


def source_examples(source: str, prompt_key: str, answer_key: str, field: str, split: str = "train") -> list[Example]:
    """One data source's rows: a data file, a folder (a save_to_disk dataset, or its data files in sorted order),
    or a hub dataset name; a dataset with several splits gives `split`'s rows."""
    path = Path(source)
    if path.is_dir():
        if any((path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
            import datasets

            return dataset_examples(datasets.load_from_disk(str(path)), str(path), prompt_key, answer_key, field, split)
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES)
        if not files:
            raise ConfigError(field, f"{path}: a folder with no {'/'.join(DATA_SUFFIXES)} file, and not a dataset "
                                     "saved with datasets' save_to_disk")
        return [ex for f in files for ex in source_examples(str(f), prompt_key, answer_key, field, split)]
    if path.suffix.lower() == ".arrow" and path.is_file():
        import datasets

        return dataset_examples(datasets.Dataset.from_file(str(path)), str(path), prompt_key, answer_key, field, split)
    if path.exists() or not HUB_NAME.match(source):
        return file_examples(source, prompt_key, answer_key, field)
    return dataset_examples(_hub_dataset(source, split, field), source, prompt_key, answer_key, field, split)


def _hub_dataset(name: str, split: str, field: str):
    """`datasets.load_dataset(name, split=...)`: from the local cache when the hub is offline (HF_HUB_OFFLINE /
    HF_DATASETS_OFFLINE), else a ConfigError saying so."""
    import datasets

    try:
        return datasets.load_dataset(name, split=split)
    except ValueError as exc:  # an unknown split
        raise ConfigError(field, f"{name}: {exc}") from None
    except (ConnectionError, FileNotFoundError, OSError) as exc:
        offline = any(os.environ.get(v, "0") not in ("", "0") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
        why = "not in the local datasets cache and the hub is offline (HF_HUB_OFFLINE)" if offline else str(exc)
        raise ConfigError(field, f"{name}: no such local path, and as a hub dataset: {why}") from None


def dataset_examples(ds, name: str, prompt_key: str, answer_key: str, field: str, split: str) -> list[Example]:
    """The Examples of a `datasets` Dataset (or `split` of a DatasetDict); errors name the dataset and row."""
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            split_field = "data.val_split" if field.startswith("data.val_files") else "data.train_split"
            raise ConfigError(split_field, f"{name} has no split {split!r} (splits: {', '.join(ds)})")
        ds = ds[split]
    for key, key_field in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
        if key not in ds.column_names:
            raise ConfigError(key_field, f"{name} has no column {key!r} (columns: {', '.join(ds.column_names)})")
    rows = ds.select_columns(list(dict.fromkeys((prompt_key, answer_key))))
    examples = [_example(row, f"{name}: row {i + 1}", prompt_key, answer_key, field) for i, row in enumerate(rows)]
    if not examples:
        raise ConfigError(field, f"{name} holds no rows")
    return examples


def check_sources(cfg) -> Example:
    """The data checks of `RunConfig.validate` that read files (after the cheap field checks): every
    data.train_files / data.val_files row well-formed, and, when the model folder already holds its
    tokenizer, at least one training prompt within data.max_prompt_tokens (a tiny model written at
    start-up is checked by `prompt_pool` instead, still before the learner is built). Returns the
    first training example (the reward's start-up check scores it)."""
    d = cfg.data
    if d.task:
        from megapo.tasks.registry import get_task

        return get_task(d.task, d.task_options).examples("train", 1)[0]
    examples = load_examples(d.train_files, d.prompt_key, d.answer_key, "data.train_files", d.train_split)
    if d.val_files:
        load_examples(d.val_files, d.prompt_key, d.answer_key, "data.val_files", d.val_split)
    tokenizer = _tokenizer_if_present(cfg.model.path)
    if tokenizer is not None:
        check_prompts_fit(tokenizer, examples, d.chat_template, d.max_prompt_tokens)
    return examples[0]


def _tokenizer_if_present(model_path: str):
    from megapo.trainer.config import TOKENIZER_FILES

    path = Path(model_path)
    if not (path / "config.json").is_file() or not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError("model.path", f"cannot load the tokenizer of {path}: {exc}") from None


def check_prompts_fit(tokenizer, examples: Sequence[Example], chat_template: bool, max_prompt_tokens: int) -> None:
    """ConfigError when no prompt fits max_prompt_tokens (stops at the first that does)."""
    shortest = None
    for ex in examples:
        n = len(encode_prompt(tokenizer, ex.prompt, chat_template))
        if n <= max_prompt_tokens:
            return
        shortest = n if shortest is None else min(shortest, n)
    raise ConfigError("data.max_prompt_tokens", f"every one of the {len(examples)} prompts of data.train_files is "
                      f"longer than {max_prompt_tokens} tokens (the shortest has {shortest})")


def prompt_pool(cfg, tokenizer) -> "PromptPool":
    """The training prompts of `cfg.data`, tokenized (files) or on demand (a task); ConfigError when no
    prompt fits data.max_prompt_tokens, a warning with the count when some do not."""
    d = cfg.data
    if d.task:
        from megapo.tasks.registry import get_task

        return PromptPool(tokenizer, d.chat_template, d.max_prompt_tokens, task=get_task(d.task, d.task_options))
    examples = load_examples(d.train_files, d.prompt_key, d.answer_key, "data.train_files", d.train_split)
    pool = PromptPool(tokenizer, d.chat_template, d.max_prompt_tokens, examples=examples)
    if len(pool) == 0:
        check_prompts_fit(tokenizer, examples, d.chat_template, d.max_prompt_tokens)  # raises, naming the lengths
    if pool.dropped_too_long:
        log.warning("data: dropped %d of %d prompts longer than data.max_prompt_tokens=%d", pool.dropped_too_long,
                    len(examples), d.max_prompt_tokens)
    return pool


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
    A task's (megapo.tasks.registry: a name or a Task) training split may have ~10^6 problems: those are
    made and tokenized on demand (the task's prompts are all short, so none is dropped)."""

    def __init__(self, tokenizer, chat_template: bool, max_prompt_tokens: int, *, task=None,
                 examples: Sequence[Example] | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.dropped_too_long = 0
        self._ids: list[list[int]] | None = None  # pre-tokenized prompts (files), or None (made on demand)
        if task:
            from megapo.tasks.registry import get_task

            task = get_task(task)
            self._size = task.size("train")
            self._get = lambda i: task.example("train", i)
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
