"""Data files through HF `datasets` (megapo/trainer/data.py): the tests' data files read to the same examples as
an independent reading written here (json.loads line by line, json.load of an array, pyarrow's parquet reader);
other column names, save_to_disk folders, a chat-messages column, datasets.map workers (data.num_proc), and a
bad row named by file:line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megapo.config import ConfigError
from megapo.trainer import data

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """datasets' cache in the test's folder (read by load_dataset on each call)."""
    import datasets

    cache = tmp_path / "hf_datasets_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


def _no_line_pass(monkeypatch):
    """Fail if a file is read by the line-by-line pass instead of `datasets`."""
    def refuse(path, keys, field):
        raise AssertionError(f"{path} was read line by line, not through datasets")

    monkeypatch.setattr(data, "line_examples", refuse)


def _reference_jsonl(path, prompt_key, answer_key):
    """The rows of a JSON Lines file read with json.loads, blank lines skipped."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [(r[prompt_key], str(r[answer_key])) for r in rows]


def _pairs(examples):
    return [(e.prompt, e.answer) for e in examples]


# ----------------------------------------------------------------------------- the tests' files


def _tests_files(tmp_path) -> dict[str, tuple[str, str, str, list]]:
    """The data files the tests write, as they write them: name -> (path, prompt key, answer key, reference)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megapo.tasks import countdown

    rows = [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(5)]  # tests/test_data.py
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:3]) + "\n\n")
    (tmp_path / "d.json").write_text(json.dumps(rows[3:]))
    pq.write_table(pa.table({"q": [r["q"] for r in rows], "a": [r["a"] for r in rows]}), tmp_path / "d.parquet")
    (tmp_path / "ints.jsonl").write_text('{"prompt": "2+2=", "answer": 4}\n')
    countdown.write_jsonl(tmp_path / "countdown.jsonl", "train", 10, seed=0)  # tests/test_tasks_countdown.py
    array = json.loads((tmp_path / "d.json").read_text())
    table = pq.read_table(tmp_path / "d.parquet").to_pylist()
    return {
        "jsonl": (str(tmp_path / "d.jsonl"), "q", "a", _reference_jsonl(tmp_path / "d.jsonl", "q", "a")),
        "json array": (str(tmp_path / "d.json"), "q", "a", [(r["q"], r["a"]) for r in array]),
        "parquet": (str(tmp_path / "d.parquet"), "q", "a", [(r["q"], r["a"]) for r in table]),
        "integer answers": (str(tmp_path / "ints.jsonl"), "prompt", "answer", [("2+2=", "4")]),
        "countdown": (str(tmp_path / "countdown.jsonl"), "prompt", "answer",
                      _reference_jsonl(tmp_path / "countdown.jsonl", "prompt", "answer")),
    }


def test_the_tests_files_read_through_datasets_to_the_same_examples(tmp_path, monkeypatch, datasets_cache):
    files = _tests_files(tmp_path)
    _no_line_pass(monkeypatch)
    for name, (path, pk, ak, want) in files.items():
        assert _pairs(data.load_examples([path], pk, ak)) == want, name
    assert list(datasets_cache.rglob("*.arrow")), "nothing in datasets' cache"
    mixed = [files[n][0] for n in ("jsonl", "parquet")]  # one list mixing kinds keeps their order
    assert _pairs(data.load_examples(mixed, "q", "a")) == files["jsonl"][3] + files["parquet"][3]


def test_a_column_of_mixed_types_reads_as_json_loads_reads_it(tmp_path):
    """tests/test_config.py's file: answers "2" and 4 (datasets would store the column as JSON text, where
    the string "[1, 2]" and the list [1, 2] are one and the same)."""
    p = tmp_path / "ok.jsonl"
    p.write_text('{"q": "1+1=", "a": "2"}\n{"q": "2+2=", "a": 4}\n{"q": "[1, 2]", "a": "x"}\n{"q": 5, "a": "y"}\n')
    with pytest.raises(ConfigError, match=r"ok.jsonl:4: 'q' is the number 5; prompts must be strings"):
        data.load_examples([str(p)], "q", "a")
    p.write_text("".join(p.read_text().splitlines(keepends=True)[:3]))
    assert _pairs(data.load_examples([str(p)], "q", "a")) == _reference_jsonl(p, "q", "a")


def test_save_to_disk_folder_and_jsonl_with_other_column_names(tmp_path, monkeypatch):
    import datasets

    rows = [{"question": f"{i}*2=", "solution": i * 2, "extra": [i]} for i in range(4)]
    want = [(r["question"], str(r["solution"])) for r in rows]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "other.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _no_line_pass(monkeypatch)
    for source in (tmp_path / "saved", tmp_path / "other.jsonl"):
        assert _pairs(data.load_examples([str(source)], "question", "solution")) == want, source
    with pytest.raises(ConfigError) as err:
        data.load_examples([str(tmp_path / "saved")], "prompt", "solution")
    assert err.value.field == "data.prompt_key" and "no column 'prompt'" in str(err.value)
    datasets.Dataset.from_list(rows).select([]).save_to_disk(str(tmp_path / "none"))  # datasets cannot load it back
    with pytest.raises(ConfigError, match="none: datasets cannot load this saved dataset") as err:
        data.load_examples([str(tmp_path / "none")], "question", "solution")
    assert err.value.field == "data.train_files[0]"


# ----------------------------------------------------------------------------- chat messages


CONVERSATIONS = [
    [{"role": "system", "content": "Answer with the number."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "3+3?"}],  # no assistant turn: all of it is the prompt
    [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "+5?"},
     {"role": "assistant", "content": "7"}],  # the last assistant turn is cut, the earlier one kept
]
PROMPT_TURNS = [CONVERSATIONS[0][:2], CONVERSATIONS[1], CONVERSATIONS[2][:3]]  # written out


def _messages_file(tmp_path) -> str:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c, "answer": a}) + "\n" for c, a in zip(CONVERSATIONS, "467")))
    return str(path)


def test_chat_messages_jsonl_loads_the_turns_before_the_last_assistant_turn(tmp_path, monkeypatch):
    path = _messages_file(tmp_path)
    _no_line_pass(monkeypatch)
    exs = data.load_examples([path], "prompt", "answer", messages_key="messages")
    assert [e.meta["messages"] for e in exs] == PROMPT_TURNS
    assert [e.answer for e in exs] == ["4", "6", "7"]
    # without the chat template: one user turn is its text, more are role lines ending with the response's cue
    assert [e.prompt for e in exs] == [
        "system: Answer with the number.\nuser: 2+2?\nassistant:", "3+3?",
        "user: 1+1?\nassistant: 2\nuser: +5?\nassistant:"]
    saved = tmp_path / "saved"
    import datasets

    datasets.Dataset.from_list([{"messages": c, "answer": a} for c, a in zip(CONVERSATIONS, "467")]).save_to_disk(
        str(saved))
    assert [e.meta["messages"] for e in data.load_examples([str(saved)], "p", "answer", messages_key="messages")] \
        == PROMPT_TURNS


def test_chat_messages_tokenized_through_the_chat_template(tmp_path, tiny_moe):
    from transformers import AutoTokenizer

    from megapo.config import load_config
    from megapo.trainer.config import RunConfig

    tok = AutoTokenizer.from_pretrained(tiny_moe)
    cfg = load_config(RunConfig, None, [f"model.path={tiny_moe}", f"data.train_files=[{_messages_file(tmp_path)}]",
                                        "data.messages_key=messages", "data.chat_template=true", "data.num_proc=2",
                                        "data.max_prompt_tokens=512"])
    assert (cfg.data.messages_key, cfg.data.num_proc) == ("messages", 2)
    pool = data.prompt_pool(cfg, tok)
    for i, turns in enumerate(PROMPT_TURNS):
        want = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        assert tok.decode(pool[i][1]) == want
    plain = data.PromptPool(tok, False, 512, examples=[pool[i][0] for i in range(3)])
    assert tok.decode(plain[0][1], skip_special_tokens=True) == \
        "system: Answer with the number.\nuser: 2+2?\nassistant:"


@pytest.mark.parametrize("row, words", [
    ({"messages": "2+2?", "answer": "4"}, ["chat.jsonl:3:", "'messages' is the string '2+2?'"]),
    ({"messages": [{"role": "user", "content": 4}], "answer": "4"}, ["chat.jsonl:3:", "'messages' turn 1"]),
    ({"messages": [{"role": "assistant", "content": "4"}], "answer": "4"},
     ["chat.jsonl:3:", "no turn before its last assistant turn"]),
    ({"question": "2+2?", "answer": "4"}, ["chat.jsonl:3:", "no field 'messages' (data.messages_key)"]),
])
def test_a_bad_chat_row_names_file_line(tmp_path, row, words):
    path = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "1+1?"}], "answer": "2"}
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(row) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(ConfigError) as err:
        data.load_examples([str(path)], "prompt", "answer", messages_key="messages")
    assert err.value.field == "data.train_files[0]"
    for w in words:
        assert w in str(err.value), str(err.value)


# ----------------------------------------------------------------------------- bad rows, workers, fields


@pytest.mark.parametrize("num_proc", [1, 2])
def test_a_bad_row_names_file_line_and_field_with_any_workers(tmp_path, num_proc):
    """A file datasets reads without complaint: the bad row (line 5, after a blank line) is found by the
    map's check, then named by line."""
    rows = [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(6)]
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = data.load_examples([str(good)], "prompt", "answer", num_proc=num_proc)
    assert _pairs(got) == _reference_jsonl(good, "prompt", "answer")
    rows[3]["answer"] = None
    bad = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) + "\n" for r in rows]
    bad.write_text("".join(lines[:2]) + "\n" + "".join(lines[2:]))  # a blank line 3: row 4 is line 5
    with pytest.raises(ConfigError) as err:
        data.load_examples([str(bad)], "prompt", "answer", "data.val_files", num_proc=num_proc)
    assert err.value.field == "data.val_files[0]"
    assert f"{bad}:5: 'answer' is null" in str(err.value)


def test_the_new_fields_are_checked_and_documented():
    from megapo.config import field_docs, load_config
    from megapo.trainer.config import DataConfig, RunConfig

    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, ["data.task=addition", "data.num_proc=0"])
    assert err.value.field == "data.num_proc"
    docs = field_docs(DataConfig)
    assert "chat-messages" in docs["messages_key"] and "map" in docs["num_proc"]
