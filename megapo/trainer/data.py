"""Prompts for RL: where they come from, how they are tokenized, in what order.

- `read_jsonl` reads JSON Lines naming the file and line of bytes that are not UTF-8 or a line that is
  not JSON (a cut-off last line can be skipped instead: a file still being written).
- `load_examples` reads data sources (one list may mix them) into Examples, all through HF `datasets` (its
  cache; offline mode honoured): local jsonl/json/parquet/.arrow files, folders of such files, a dataset saved
  with save_to_disk, or a hub dataset name `org/name`. Each row gives a string prompt (data.prompt_key, or the
  turns of a chat-messages column, data.messages_key) and a string (or integer) answer (data.answer_key); the
  rows are checked in `datasets.map` (data.num_proc workers). A bad row is a ConfigError naming file:line (a
  JSON file: a line-by-line pass finds the line) or dataset: row N, and the field.
- `check_sources` is the data part of `RunConfig.validate`: files, and when the model folder already
  holds its tokenizer, that some prompt fits data.max_prompt_tokens (a data.task comes from megapo.tasks.registry).
- `encode_prompts` applies the chat template (or not) and drops prompts over the token limit, with a count.
- `PromptSource` hands out batches in a seeded shuffled order; its `DataCursor` (epoch, index, seed)
  is saved in checkpoints so a resumed run continues with exactly the next prompts.
- `PrioritizedPromptSource` is SPO's prioritised prompt sampling (algorithm.advantage_options.prioritized_sampling):
  a window of shuffled candidates, of which each batch is drawn with weight √(v̂(1 − v̂)) + ε from SPO's value
  tracker; `CurriculumPromptSource` is the semantic-entropy curriculum (data.curriculum: semantic_entropy), each
  epoch ordered from low to high semantic entropy of the prompts' answers in the previous epoch. `prompt_source`
  picks the run's; all three save their whole state in the checkpoint's data cursor.
- `select_informative` is DAPO's dynamic sampling: groups whose samples all got the same reward
  carry no group-relative signal, so they are dropped and the batch refilled.
"""

from __future__ import annotations

import contextlib
import functools
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


@dataclass(frozen=True)
class Keys:
    """Where a row's prompt and answer are (data.prompt_key, data.answer_key, data.messages_key: a chat-messages
    column read instead of prompt_key when set) and how many processes check the rows (data.num_proc)."""

    prompt: str = "prompt"
    answer: str = "answer"
    messages: str = ""
    num_proc: int = 1

    def columns(self) -> list[tuple[str, str]]:
        """(column, its config field) of the columns a row is read from."""
        source = (self.messages, "data.messages_key") if self.messages else (self.prompt, "data.prompt_key")
        return [source, (self.answer, "data.answer_key")]


# ----------------------------------------------------------------------------- one row


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


class RowError(ValueError):
    """What is wrong with one row (the caller adds where it is)."""


def row_example(row: Any, keys: Keys) -> Example:
    """The Example of one row; RowError when it lacks a string prompt (or well-formed chat turns) or a
    string/integer answer (a null, boolean or float answer would be scored as its text -- "None", "True",
    "4.0" -- so it is refused rather than converted)."""
    if not isinstance(row, dict):
        raise RowError(f"row is {_describe(row)}, not a JSON object")
    for key, key_field in keys.columns():
        if key not in row:
            raise RowError(f"no field {key!r} ({key_field})")
    turns = prompt_turns(row[keys.messages], keys.messages) if keys.messages else None
    prompt = render_turns(turns) if turns else row[keys.prompt]
    answer = row[keys.answer]
    if not isinstance(prompt, str):
        raise RowError(f"{keys.prompt!r} is {_describe(prompt)}; prompts must be strings")
    if isinstance(answer, bool) or not isinstance(answer, (str, int)):
        raise RowError(f"{keys.answer!r} is {_describe(answer)}; answers must be strings (or integers)")
    return Example(prompt, str(answer), meta={"messages": turns} if turns else {})


def prompt_turns(value: Any, key: str) -> list[dict[str, str]]:
    """The turns of a chat-messages value before its last assistant turn (that one is a demonstration, not
    the prompt); RowError unless it is a list of {role, content} strings with a turn left."""
    if not isinstance(value, list):
        raise RowError(f"{key!r} is {_describe(value)}; chat messages are a list of {{role, content}} turns")
    turns = []
    for j, turn in enumerate(value):
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)):
            raise RowError(f"{key!r} turn {j + 1} is {_describe(turn)}; each turn needs a string 'role' and "
                           "'content'")
        turns.append({"role": turn["role"], "content": turn["content"]})
    last = max((j for j, t in enumerate(turns) if t["role"] == "assistant"), default=len(turns))
    if last == 0:
        raise RowError(f"{key!r} has no turn before its {'last assistant turn' if turns else 'end'}")
    return turns[:last]


def render_turns(turns: Sequence[dict[str, str]]) -> str:
    """A prompt's turns as text, what a run without the chat template feeds the model (and what logs and
    per-prompt statistics key on): one user turn is its content (what a prompt column would hold), more are
    `role: content` lines ending with `assistant:`, the cue for the response."""
    if len(turns) == 1 and turns[0]["role"] == "user":
        return turns[0]["content"]
    return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"


# ----------------------------------------------------------------------------- rows of a dataset


def _check_batch(batch: dict[str, list], keys: Keys) -> dict[str, list]:
    """datasets.map over a batch of rows: each row's prompt, answer and chat turns, or its problem (names of
    their own: a column named like an input column would be cast back to the input's type)."""
    out: dict[str, list] = {"_prompt": [], "_answer": [], "_turns": [], "_problem": []}
    for i in range(len(next(iter(batch.values())))):
        try:
            ex, problem = row_example({k: v[i] for k, v in batch.items()}, keys), ""
        except RowError as exc:
            ex, problem = Example("", ""), str(exc)
        for name, value in (("_prompt", ex.prompt), ("_answer", ex.answer), ("_turns", ex.meta.get("messages", [])),
                            ("_problem", problem)):
            out[name].append(value)
    return out


def dataset_rows(ds, keys: Keys) -> tuple[list[Example], tuple[int, str] | None]:
    """The Examples of a `datasets` Dataset holding the key columns, or ([], (index, problem)) of its first bad
    row. The rows are checked in `ds.map` (keys.num_proc processes; kept in memory: no cache files written
    beside a user's save_to_disk folder)."""
    ds = ds.select_columns([key for key, _ in keys.columns()])
    if len(ds) == 0:  # map of no rows makes no columns
        return [], None
    checked = ds.map(functools.partial(_check_batch, keys=keys), batched=True, remove_columns=ds.column_names,
                     num_proc=keys.num_proc if keys.num_proc > 1 and len(ds) > 1 else None, keep_in_memory=True,
                     desc="checking rows")
    problems = checked["_problem"]
    bad = next((i for i, p in enumerate(problems) if p), None)
    if bad is not None:
        return [], (bad, problems[bad])
    return [Example(p, a, meta={"messages": t} if t else {})
            for p, a, t in zip(checked["_prompt"], checked["_answer"], checked["_turns"])], None


def _missing_column(ds, keys: Keys) -> tuple[str, str] | None:
    return next(((key, f) for key, f in keys.columns() if key not in ds.column_names), None)


def dataset_examples(ds, name: str, keys: Keys, field: str, split: str) -> list[Example]:
    """The Examples of a `datasets` Dataset (or `split` of a DatasetDict); errors name the dataset and row."""
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            split_field = "data.val_split" if field.startswith("data.val_files") else "data.train_split"
            raise ConfigError(split_field, f"{name} has no split {split!r} (splits: {', '.join(ds)})")
        ds = ds[split]
    missing = _missing_column(ds, keys)
    if missing:
        raise ConfigError(missing[1], f"{name} has no column {missing[0]!r} (columns: {', '.join(ds.column_names)})")
    examples, bad = dataset_rows(ds, keys)
    if bad:
        raise ConfigError(field, f"{name}: row {bad[0] + 1}: {bad[1]}")
    if not examples:
        raise ConfigError(field, f"{name} holds no rows")
    return examples


# ----------------------------------------------------------------------------- files


def _load_file(builder: str, path: str):
    """`datasets.load_dataset(builder, data_files=path)`'s rows: read once into datasets' cache (keyed on the
    file's path and modification time), then from there; no network."""
    import datasets

    return datasets.load_dataset(builder, data_files=path, split="train")


@contextlib.contextmanager
def _datasets_quiet():
    import datasets

    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)


def _holds_json_text(feature) -> bool:
    """Whether datasets stores (part of) a column as JSON text, its way with a field of mixed types."""
    return "Json(" in repr(feature)  # at any depth: Json, or List({'content': Json, ...}) of chat turns


def _json_head(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")


def _json_through_datasets(path: str, keys: Keys) -> list[Example] | None:
    """The file's Examples through `datasets`, or None where datasets cannot read it as megapo does: it fails
    (not JSON, empty; bytes that are not UTF-8 fail only when read back), lacks a key column, stores a key
    column of mixed types as JSON text (which loses the difference between "4" and 4), reads a .jsonl holding
    one array as rows, or a row is bad (the line pass then names its line)."""
    if path.lower().endswith(".jsonl") and _json_head(path).startswith(b"["):
        return None
    try:
        with _datasets_quiet():  # its log of a failed read names no line; megapo's own error follows
            ds = _load_file("json", path)
        if _missing_column(ds, keys) or any(_holds_json_text(ds.features[key]) for key, _ in keys.columns()):
            return None
        examples, bad = dataset_rows(ds, keys)
    except Exception:  # datasets' and pyarrow's errors (DatasetGenerationError, StopIteration, ...) name no line
        return None
    return None if bad or not examples else examples


def _json_rows(path: str, field: str) -> Iterator[tuple[str, Any]]:
    """(where, row) of a .jsonl file, or of a .json file holding one array of rows."""
    if path.lower().endswith(".json") and _json_head(path).startswith(b"["):
        try:
            rows = json.loads(Path(path).read_bytes().decode("utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(field, f"{path}: not a valid JSON array of rows ({exc})") from None
        yield from ((f"{path}: item {i + 1}", row) for i, row in enumerate(rows))
        return
    yield from ((f"{path}:{lineno}", row) for lineno, row in read_jsonl(path, field))


def line_examples(path: str, keys: Keys, field: str) -> list[Example]:
    """A JSON file read line by line (json.loads): the pass that names file:line of a bad row, and the reader
    of the files `datasets` cannot read faithfully."""
    examples = []
    for where, row in _json_rows(path, field):
        try:
            examples.append(row_example(row, keys))
        except RowError as exc:
            raise ConfigError(field, f"{where}: {exc}") from None
    if not examples:
        raise ConfigError(field, f"{path} holds no rows")
    return examples


def json_examples(path: str, keys: Keys, field: str) -> list[Example]:
    """A .jsonl/.json file's Examples through `datasets`; when it cannot read the file faithfully or a row is
    bad, the line-by-line pass reads it (and names the line of the first bad row)."""
    examples = _json_through_datasets(path, keys)
    return examples if examples is not None else line_examples(path, keys, field)


def parquet_examples(path: str, keys: Keys, field: str) -> list[Example]:
    """A parquet file's Examples through `datasets`; errors name the file and row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:  # the footer first: pyarrow's error says what is wrong, and datasets fails on a file of no rows
        rows = pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(field, f"{path}: not a readable parquet file ({exc})") from None
    if rows == 0:
        raise ConfigError(field, f"{path} holds no rows")
    try:
        ds = _load_file("parquet", path)
    except Exception as exc:  # datasets wraps pyarrow's error: show the cause, which says what is wrong
        raise ConfigError(field, f"{path}: not a readable parquet file ({exc.__cause__ or exc})") from None
    return dataset_examples(ds, path, keys, field, "train")


def file_examples(path: str, keys: Keys, field: str) -> list[Example]:
    """Every row of one jsonl/json/parquet file; ConfigError(field) naming the file (and line) when it is
    missing, unreadable, empty, or holds a malformed row."""
    if not Path(path).is_file():
        raise ConfigError(field, f"{path} does not exist")
    if _format(path, field) == "parquet":
        return parquet_examples(path, keys, field)
    return json_examples(path, keys, field)


# ----------------------------------------------------------------------------- sources


def load_examples(paths: Sequence[str], prompt_key: str, answer_key: str, field: str = "data.train_files",
                  split: str = "train", *, messages_key: str = "", num_proc: int = 1) -> list[Example]:
    """All rows of the sources (see source_examples; kinds may be mixed) as Examples, in order."""
    keys = Keys(prompt_key, answer_key, messages_key, num_proc)
    return [ex for i, path in enumerate(paths) for ex in source_examples(path, keys, f"{field}[{i}]", split)]


def config_examples(d, which: str = "train") -> list[Example]:
    """The Examples of a DataConfig's train_files (or val_files) with its keys and split."""
    paths, split = (d.train_files, d.train_split) if which == "train" else (d.val_files, d.val_split)
    return load_examples(paths, d.prompt_key, d.answer_key, f"data.{which}_files", split,
                         messages_key=d.messages_key, num_proc=d.num_proc)


DATA_SUFFIXES = (*FORMATS, ".arrow")
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name, as the hub spells a dataset


def source_examples(source: str, keys: Keys, field: str, split: str = "train") -> list[Example]:
    """One data source's rows: a data file, a folder (a save_to_disk dataset, or its data files in sorted order),
    or a hub dataset name; a dataset with several splits gives `split`'s rows."""
    path = Path(source)
    if path.is_dir():
        if any((path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
            return dataset_examples(_load_saved(path, field), str(path), keys, field, split)
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES)
        if not files:
            raise ConfigError(field, f"{path}: a folder with no {'/'.join(DATA_SUFFIXES)} file, and not a dataset "
                                     "saved with datasets' save_to_disk")
        return [ex for f in files for ex in source_examples(str(f), keys, field, split)]
    if path.suffix.lower() == ".arrow" and path.is_file():
        import datasets

        return dataset_examples(datasets.Dataset.from_file(str(path)), str(path), keys, field, split)
    if path.exists() or not HUB_NAME.match(source):
        return file_examples(source, keys, field)
    return dataset_examples(_hub_dataset(source, split, field), source, keys, field, split)


def _load_saved(path: Path, field: str):
    """`datasets.load_from_disk`; a ConfigError naming the folder where datasets cannot open it (one saved with
    no rows is one such)."""
    import datasets

    try:
        return datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets' own errors vary (IndexError, FileNotFoundError, ValueError)
        raise ConfigError(field, f"{path}: datasets cannot load this saved dataset ({type(exc).__name__}: {exc})") \
            from None


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
    examples = config_examples(d, "train")
    if d.val_files:
        config_examples(d, "val")
    tokenizer = _tokenizer_if_present(cfg.model.path)
    if tokenizer is not None:
        check_prompts_fit(tokenizer, examples, d.chat_template, d.max_prompt_tokens)
    return examples[0]


def _tokenizer_if_present(model_path: str):
    from megapo.models.config import TOKENIZER_FILES

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
        n = len(encode_example(tokenizer, ex, chat_template))
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
    examples = config_examples(d, "train")
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
        return _template_ids(tokenizer, [{"role": "user", "content": text}])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    return list(ids)


def encode_example(tokenizer, ex: Example, chat_template: bool) -> list[int]:
    """Token ids of an Example's prompt: its chat turns (data.messages_key) through the chat template with the
    assistant header appended, else encode_prompt of its text."""
    turns = ex.meta.get("messages")
    if turns and chat_template:
        return _template_ids(tokenizer, turns)
    return encode_prompt(tokenizer, ex.prompt, chat_template)


def encode_examples(tokenizer, examples: Sequence[Example], chat_template: bool) -> list[list[int]]:
    """[encode_example(tokenizer, ex, chat_template) for ex in examples], the raw-text prompts tokenized in one batch
    call (the tokenizer's per-call overhead is most of a short prompt's cost)."""
    plain = [i for i, ex in enumerate(examples) if not chat_template]
    out: list[list[int] | None] = [None] * len(examples)
    if plain:
        bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        batch = tokenizer([examples[i].prompt for i in plain], add_special_tokens=False)["input_ids"]
        for i, ids in zip(plain, batch):
            out[i] = bos + list(ids)
    return [ids if ids is not None else encode_example(tokenizer, ex, chat_template) for ids, ex in zip(out, examples)]


def _template_ids(tokenizer, turns: Sequence[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(list(turns), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
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
        p = encode_example(tokenizer, ex, chat_template)
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
        return ex, encode_example(self.tokenizer, ex, self.chat_template)

    def items(self, indices: Sequence[int]) -> list[tuple[Example, list[int]]]:
        """[pool[i] for i in indices], a task's prompts tokenized in one call (encode_examples)."""
        if self._ids is not None:
            return [self[i] for i in indices]
        examples = [self._get(i) for i in indices]
        return list(zip(examples, encode_examples(self.tokenizer, examples, self.chat_template)))


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


class PrioritizedPromptSource:
    """SPO's prioritised prompt sampling (Xu & Ding 2025, Single-stream Policy Optimization, arXiv:2509.13232):
    each `next_batch(k)` takes `candidates × k` prompts from the seeded per-epoch shuffle (a PromptSource) and draws
    k of them without replacement with probability ∝ w(x) = √(v̂(x)(1 − v̂(x))) + ε, v̂ the value tracker's success
    rate of prompt x (`values(indices)` gives them; value_tracker.priority_weights). The draw's RNG is seeded by
    (seed, the draw's number), so the batches are a function of train.seed, the draw count and the tracker; the
    draw count is saved with the cursor (`state_dict`), the tracker in the checkpoint's extra, so a resumed run
    draws what the unstopped one would.
    Assumption: the paper gives the weight, not the pool it is drawn from; here a window of candidates of the
    shuffle (the public code re-weights a data-loader batch), the candidates not drawn are skipped this epoch."""

    def __init__(self, size: int, values: Callable[[list[int]], list[float]], seed: int = 0, candidates: int = 4,
                 eps: float = 0.05, shuffle: bool = True):
        self.base = PromptSource(size, seed=seed, shuffle=shuffle)
        self.values, self.candidates, self.eps = values, candidates, eps
        self.draws = 0  # next_batch calls so far: the draw's RNG stream

    @property
    def cursor(self) -> DataCursor:
        return self.base.cursor

    def next_batch(self, k: int) -> list[int]:
        from megapo.algorithms.value_tracker import priority_weights

        pool = self.base.next_batch(k * self.candidates)
        w = priority_weights(list(self.values(pool)), self.eps).numpy()
        rng = np.random.default_rng([self.base.cursor.seed, self.draws, 0x5350])  # 0x5350: "SP", its own stream
        self.draws += 1
        picked = rng.choice(len(pool), size=min(k, len(pool)), replace=False, p=w / w.sum())
        return [pool[int(j)] for j in picked]

    def state_dict(self) -> dict:
        return {**self.base.state_dict(), "draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        self.draws = int(state.pop("draws", 0))
        self.base.load_state_dict(state)


class CurriculumPromptSource(PromptSource):
    """The semantic-entropy curriculum of Cao et al. 2025, Efficient Reinforcement Learning with Semantic and Token
    Entropy for LLM Reasoning (arXiv:2512.04359): each epoch hands the prompts out from low to high semantic
    entropy (megapo.algorithms.semantic_entropy.curriculum_order), easier to harder. `observe(index, answers)`
    records a prompt's semantic entropy from its sampled answers; the order of epoch e is fixed when it begins,
    from the entropies observed by then (`basis`, saved in the state with the newer ones, so a resumed run keeps
    its epoch's order).
    Assumption: the entropies are measured on the run's own rollouts of the previous epoch, not a separate
    pre-pass of samples; epoch 0, before any is measured, is the seeded shuffle; a prompt not measured yet goes
    after the measured ones, in the seeded shuffle's order."""

    def __init__(self, size: int, seed: int = 0, cursor: DataCursor | None = None):
        super().__init__(size, seed=seed, shuffle=True, cursor=cursor)
        self.latest: dict[int, float] = {}  # prompt index -> its last measured semantic entropy
        self.basis: dict[int, float] = {}  # the entropies the current epoch's order was made from
        self.basis_epoch = -1

    def _order_for(self, epoch: int) -> np.ndarray:
        from megapo.algorithms.semantic_entropy import curriculum_order

        if self.basis_epoch != epoch:  # entering the epoch: its order is made from what was measured by now
            self.basis, self.basis_epoch = dict(self.latest), epoch
        if epoch != self._order_epoch:
            shuffle = np.random.default_rng([self.cursor.seed, epoch]).permutation(self.size)
            self._order = np.asarray(curriculum_order(shuffle.tolist(), self.basis), dtype=np.int64)
            self._order_epoch = epoch
        return self._order

    def observe(self, index: int, answers: Sequence[str | None]) -> None:
        """Record prompt `index`'s semantic entropy from its sampled responses' extracted answers."""
        from megapo.algorithms.semantic_entropy import semantic_entropy

        if answers:
            self.latest[int(index)] = semantic_entropy(answers)

    def state_dict(self) -> dict:
        return {**self.cursor.state_dict(), "basis_epoch": self.basis_epoch,
                "basis": {str(k): v for k, v in self.basis.items()},
                "latest": {str(k): v for k, v in self.latest.items()}}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        self.basis_epoch = int(state.pop("basis_epoch", -1))
        self.basis = {int(k): float(v) for k, v in state.pop("basis", {}).items()}
        self.latest = {int(k): float(v) for k, v in state.pop("latest", {}).items()}
        super().load_state_dict(state)


def prompt_source(cfg, pool, tracker: Callable[[], Any] | None = None):
    """The run's prompt order over `pool`: SPO's prioritised sampling (algorithm.advantage spo with
    advantage_options.prioritized_sampling; `tracker()` gives the run's current ValueTracker), the semantic-entropy
    curriculum (data.curriculum), else the seeded shuffle."""
    a = cfg.algorithm
    if a.advantage == "spo" and a.advantage_options.get("prioritized_sampling"):
        from megapo.algorithms.stages import prompt_key
        from megapo.algorithms.value_tracker import SPOOptions

        o = SPOOptions(**a.advantage_options)

        def values(indices: list[int]) -> list[float]:
            t = tracker() if tracker is not None else None
            return [t.value(prompt_key(pool[i][0].prompt), o) if t is not None else o.prior for i in indices]

        return PrioritizedPromptSource(len(pool), values, seed=cfg.train.seed, candidates=o.sampling_candidates,
                                       eps=o.sampling_eps)
    if cfg.data.curriculum == "semantic_entropy":
        return CurriculumPromptSource(len(pool), seed=cfg.train.seed)
    return PromptSource(len(pool), seed=cfg.train.seed)


def _order_name(keys: set) -> str:
    if "draws" in keys:
        return "SPO's prioritised sampling"
    return "the semantic-entropy curriculum" if "latest" in keys else "the seeded shuffle"


def check_prompt_order(source, saved: dict, checkpoint) -> None:
    """ConfigError when `checkpoint`'s prompt cursor (`saved`) was written under another prompt order than
    `source`'s (this run's), naming the option that picks the order."""
    base = {"epoch", "index", "seed"}
    theirs, mine = set(saved) - base, set(source.state_dict()) - base
    if theirs != mine:
        field = ("algorithm.advantage_options.prioritized_sampling" if "draws" in theirs | mine
                 else "data.curriculum")
        raise ConfigError(field, f"{checkpoint} was saved drawing prompts by {_order_name(theirs)}, this run draws "
                          f"them by {_order_name(mine)}: resume with the order it was saved with")


def observe_answers(source, groups, tokenizer) -> None:
    """The curriculum's measurement (a CurriculumPromptSource only): each group's responses decoded, their final
    answers extracted (megapo.trainer.rewards.extract_answer), its prompt's semantic entropy recorded."""
    if not isinstance(source, CurriculumPromptSource):
        return
    from megapo.trainer.rewards import extract_answer

    for g in groups:
        if g.prompt_index is None or g.extra:  # hdpo's privileged, anytime's summary groups: not the prompt's own
            continue
        texts = [tokenizer.decode(list(s.output_ids), skip_special_tokens=True) for s in g.samples]
        source.observe(g.prompt_index, [extract_answer(t) for t in texts])


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
