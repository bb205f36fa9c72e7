"""Prompt loading, filtering, resumable order and dynamic sampling."""

import json
from pathlib import Path

import pytest

from megapo.config import ConfigError
from megapo.trainer import data


def _parquet(path, columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return str(path)


def test_load_jsonl_json_parquet_and_a_mixed_list(tmp_path):
    rows = [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(5)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:3]) + "\n\n")  # a blank line
    (tmp_path / "d.json").write_text(json.dumps(rows[3:]))  # one JSON array
    pq_path = _parquet(tmp_path / "d.parquet", {"q": [r["q"] for r in rows], "a": [r["a"] for r in rows]})
    for paths, expected in (([str(tmp_path / "d.jsonl")], rows[:3]), ([str(tmp_path / "d.json")], rows[3:]),
                            ([pq_path], rows), ([str(tmp_path / "d.jsonl"), pq_path], rows[:3] + rows)):
        exs = data.load_examples(paths, "q", "a")
        assert [(e.prompt, e.answer) for e in exs] == [(r["q"], r["a"]) for r in expected]


def test_integer_answers_kept_as_their_digits(tmp_path):
    p = tmp_path / "ints.jsonl"
    p.write_text('{"prompt": "2+2=", "answer": 4}\n')
    assert data.load_examples([str(p)], "prompt", "answer")[0].answer == "4"


def test_malformed_row_names_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a", "answer": "b"}\n{"prompt": 3, "answer": "b"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2") as err:
        data.load_examples([str(p)], "prompt", "answer", "data.val_files")
    assert err.value.field == "data.val_files[0]"


@pytest.mark.parametrize("name, content, words", [
    # values that str() would silently turn into other answers: null -> "None", true -> "True", 4.0 -> "4.0"
    ("null.jsonl", '{"prompt": "a", "answer": "b"}\n{"prompt": "c", "answer": null}\n',
     ["null.jsonl:2:", "'answer' is null"]),
    ("bool.jsonl", '{"prompt": "a", "answer": true}\n', ["bool.jsonl:1:", "'answer' is true"]),
    ("float.jsonl", '{"prompt": "a", "answer": 4.0}\n', ["float.jsonl:1:", "the number 4.0"]),
    ("list.jsonl", '[1, 2]\n', ["list.jsonl:1:", "not a JSON object"]),
    ("nokey.jsonl", '{"prompt": "a"}\n', ["nokey.jsonl:1:", "no field 'answer'"]),
])
def test_coercions_refused_naming_file_and_line(tmp_path, name, content, words):
    (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError) as err:
        data.load_examples([str(tmp_path / name)], "prompt", "answer")
    assert err.value.field == "data.train_files[0]"
    for w in words:
        assert w in str(err.value), str(err.value)


def test_parquet_integer_prompts_and_null_answers_refused(tmp_path):
    ints = _parquet(tmp_path / "ints.parquet", {"prompt": [0, 1], "answer": ["a", "b"]})
    with pytest.raises(ConfigError, match=r"ints.parquet: row 1: 'prompt' is the number 0; prompts must be strings"):
        data.load_examples([ints], "prompt", "answer")
    nulls = _parquet(tmp_path / "nulls.parquet", {"prompt": ["x", "y"], "answer": ["a", None]})
    with pytest.raises(ConfigError, match=r"nulls.parquet: row 2: 'answer' is null"):
        data.load_examples([nulls], "prompt", "answer")
    with pytest.raises(ConfigError, match=r"has no column 'question'") as err:
        data.load_examples([nulls], "question", "answer")
    assert err.value.field == "data.prompt_key"


def test_unreadable_and_empty_files_named(tmp_path):
    good = '{"prompt": "a", "answer": "b"}\n'
    cases = {
        "latin1.jsonl": (good.encode() + '{"prompt": "caf\u00e9", "answer": "b"}\n'.encode("latin-1"),
                         ["latin1.jsonl:2:", "not UTF-8"]),
        "cut.jsonl": ((good * 2 + good[:12]).encode(), ["cut.jsonl:3:", "not valid JSON", "cut off"]),
        "empty.jsonl": (b"", ["empty.jsonl holds no rows"]),
        "blank.jsonl": (b"\n  \n", ["blank.jsonl holds no rows"]),
        "empty.parquet": (b"", ["empty.parquet: not a readable parquet file"]),
    }
    full = Path(_parquet(tmp_path / "full.parquet", {"prompt": ["a"] * 50, "answer": ["b"] * 50})).read_bytes()
    cases["cut.parquet"] = (full[:len(full) // 2], ["cut.parquet: not a readable parquet file"])
    for name, (content, words) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ConfigError) as err:
            data.load_examples([str(tmp_path / name)], "prompt", "answer")
        for w in words:
            assert w in str(err.value), (name, str(err.value))
    no_rows = _parquet(tmp_path / "norows.parquet", {"prompt": pa_strings([]), "answer": pa_strings([])})
    with pytest.raises(ConfigError, match="norows.parquet holds no rows"):
        data.load_examples([no_rows], "prompt", "answer")


def pa_strings(values):
    import pyarrow as pa

    return pa.array(values, type=pa.string())


def test_read_jsonl_skips_a_cut_off_last_line_when_asked(tmp_path, caplog):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n{"ste')
    with caplog.at_level("WARNING", logger="megapo.trainer.data"):
        assert [row for _, row in data.read_jsonl(p, "f", skip_cut_tail=True)] == [{"step": 1}, {"step": 2}]
    assert any("m.jsonl:3" in r.getMessage() and "cut-off" in r.getMessage() for r in caplog.records)
    p.write_text('{"step": 1}\n{"ste\n{"step": 2}\n')  # damaged in the middle: not a cut-off write
    with pytest.raises(ConfigError, match=r"m.jsonl:2: not valid JSON"):
        list(data.read_jsonl(p, "f", skip_cut_tail=True))


def _prompt_len(tok, text):
    """Token count of a raw prompt, written out: the text's ids plus BOS when the tokenizer has one."""
    return len(tok(text, add_special_tokens=False)["input_ids"]) + (tok.bos_token_id is not None)


def test_every_prompt_too_long_refused_at_validation(tmp_path, tiny_moe):
    from transformers import AutoTokenizer

    from megapo.config import load_config
    from megapo.trainer.config import RunConfig

    tok = AutoTokenizer.from_pretrained(tiny_moe)
    prompts = ["12345+67890=", "1234567+1=", "99999999999+99999999999="]
    p = tmp_path / "long.jsonl"
    p.write_text("".join(json.dumps({"prompt": q, "answer": "x"}) + "\n" for q in prompts))
    shortest = min(_prompt_len(tok, q) for q in prompts)
    over = [f"model.path={tiny_moe}", f"data.train_files=[{p}]", "data.prompts_per_step=8"]
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, over + [f"data.max_prompt_tokens={shortest - 1}"])
    assert err.value.field == "data.max_prompt_tokens"
    assert f"longer than {shortest - 1} tokens (the shortest has {shortest})" in str(err.value)
    load_config(RunConfig, None, over + [f"data.max_prompt_tokens={shortest}"])  # one fits: accepted


def test_every_prompt_too_long_refused_before_the_learner_is_built(tmp_path, monkeypatch):
    """A tiny model written at start-up has no tokenizer at validation: train() finds it before the
    learner and the engine are built."""
    from transformers import AutoTokenizer

    from megapo.config import load_config
    from megapo.trainer import run
    from megapo.trainer.config import RunConfig
    from megapo.trainer.loop import train

    def refuse(*a, **k):
        raise AssertionError("built before the prompts were checked")

    monkeypatch.setattr(run, "build_learner", refuse)
    monkeypatch.setattr(run, "build_engine", refuse)
    p = tmp_path / "long.jsonl"
    p.write_text(json.dumps({"prompt": "123456789+987654321=", "answer": "x"}) + "\n")
    model = tmp_path / "model"
    cfg = load_config(RunConfig, None, [f"model.path={model}", "model.tiny={}", f"data.train_files=[{p}]",
                                        "data.prompts_per_step=8", "data.max_prompt_tokens=4",
                                        f"train.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError) as err:
        train(cfg)
    assert err.value.field == "data.max_prompt_tokens"
    shortest = _prompt_len(AutoTokenizer.from_pretrained(model), "123456789+987654321=")
    assert f"longer than 4 tokens (the shortest has {shortest})" in str(err.value)


def test_over_long_prompts_filtered_with_count(tiny_moe):
    from transformers import AutoTokenizer

    from megapo.tasks.base import Example

    tok = AutoTokenizer.from_pretrained(tiny_moe)
    exs = [Example("1+1=", "2"), Example("1" * 40 + "+1=", "x"), Example("22+2=", "24")]
    enc = data.encode_prompts(tok, exs, chat_template=False, max_prompt_tokens=10)
    assert enc.dropped_too_long == 1
    assert [e.prompt for e in enc.examples] == ["1+1=", "22+2="]
    assert [len(p) for p in enc.prompt_ids] == [4, 5]


def test_prompt_source_epochs_and_resume():
    src = data.PromptSource(10, seed=3)
    first = src.next_batch(4) + src.next_batch(4) + src.next_batch(2)
    assert sorted(first) == list(range(10))  # one epoch is a permutation
    second = src.next_batch(10)
    assert sorted(second) == list(range(10)) and second != first  # reshuffled
    # resume: a fresh source loaded from a mid-epoch cursor continues identically
    a = data.PromptSource(10, seed=3)
    a.next_batch(7)
    state = json.loads(json.dumps(a.state_dict()))
    expected = a.next_batch(9)
    b = data.PromptSource(10, seed=3)
    b.load_state_dict(state)
    assert b.next_batch(9) == expected
    assert b.state_dict() == {"epoch": 1, "index": 6, "seed": 3}


def test_select_informative_and_refill():
    assert data.select_informative([[1, 1, 1], [0, 1, 0], [0, 0], [0.5]]) == [1]
    rounds = iter([
        [[1, 1], [0, 1], [0, 0]],        # 1 informative
        [[0, 0], [1, 0], [1, 1]],        # 1 informative
        [[0, 1], [0, 1], [1, 0]],        # 3 informative
    ])
    kept, stats = data.fill_informative(lambda: next(rounds), lambda g: g, target_groups=4, max_rounds=5)
    assert kept == [[0, 1], [1, 0], [0, 1], [0, 1]]
    assert (stats.rounds, stats.groups_sampled, stats.groups_kept) == (3, 9, 4)
    never = data.fill_informative(lambda: [[1, 1]], lambda g: g, target_groups=2, max_rounds=3)
    assert never[0] == [] and never[1].rounds == 3


def test_prompt_pool_task_is_lazy_and_files_filtered(tiny_moe):
    from transformers import AutoTokenizer

    from megapo.tasks import addition
    from megapo.tasks.base import Example

    tok = AutoTokenizer.from_pretrained(tiny_moe)
    pool = data.PromptPool(tok, False, 16, task="addition")
    assert len(pool) == 1000 * 1000 - 1500
    ex, ids = pool[5]
    a, b = divmod(int(addition.split_ids("train")[5]), 1000)
    assert ex.prompt == f"{a:03d}+{b:03d}=" and tok.decode(ids) == ex.prompt
    files = data.PromptPool(tok, False, 6, examples=[Example("1+1=", "2"), Example("123+456=", "579")])
    assert len(files) == 1 and files.dropped_too_long == 1 and files[0][0].prompt == "1+1="
    # a round's prompts in one call: what one prompt at a time gives (a BOS prepended where the tokenizer has one)
    for template in (False, True):
        task_pool = data.PromptPool(tok, template, 64, task="addition")
        assert task_pool.items([5, 9, 5]) == [task_pool[5], task_pool[9], task_pool[5]]
    tok.bos_token = tok.convert_ids_to_tokens(7)
    with_bos = data.PromptPool(tok, False, 16, task="addition").items([5, 9])
    assert [ids for _, ids in with_bos] == [[7] + tok(ex.prompt, add_special_tokens=False)["input_ids"]
                                            for ex, _ in with_bos]
    assert files.items([0]) == [files[0]]


# ----------------------------------------------------------------------------- sources through HF datasets


ROWS = [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(6)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_save_to_disk_arrow_and_folders_read_the_same_examples_as_the_jsonl(tmp_path):
    """Reference: the jsonl reader (written out rows) on the same rows."""
    import datasets

    want = [(r["q"], r["a"]) for r in ROWS]
    assert [(e.prompt, e.answer) for e in data.load_examples([_jsonl(tmp_path / "d.jsonl", ROWS)], "q", "a")] == want
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": datasets.Dataset.from_list(ROWS[:2])}).save_to_disk(str(tmp_path / "dict"))
    folder = tmp_path / "folder"
    folder.mkdir()
    _jsonl(folder / "b.jsonl", ROWS[3:])
    _jsonl(folder / "a.jsonl", ROWS[:3])  # read in sorted order: a, then b
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for source in (tmp_path / "saved", tmp_path / "dict", folder, arrow):
        got = data.load_examples([str(source)], "q", "a")
        assert [(e.prompt, e.answer) for e in got] == want, source
    held_out = data.load_examples([str(tmp_path / "dict")], "q", "a", "data.val_files", split="test")
    assert [(e.prompt, e.answer) for e in held_out] == want[:2]


def test_other_column_names_through_the_keys(tmp_path):
    rows = [{"question": r["q"], "solution": int(r["a"]), "extra": [1]} for r in ROWS]
    got = data.load_examples([_jsonl(tmp_path / "other.jsonl", rows)], "question", "solution")
    assert [(e.prompt, e.answer) for e in got] == [(r["q"], r["a"]) for r in ROWS]


@pytest.mark.parametrize("case, field, words", [
    ("bad_row", "data.train_files[0]", ["saved: row 3", "'a' is null"]),
    ("no_split", "data.train_split", ["no split 'train'", "splits: test"]),
    ("no_column", "data.prompt_key", ["no column 'q'", "columns: p, a"]),
    ("empty_folder", "data.train_files[0]", ["no .jsonl/.json/.parquet/.arrow file"]),
    ("offline_hub", "data.train_files[0]", ["nobody/no-such-dataset", "offline"]),
])
def test_dataset_sources_refused_naming_the_field_and_row(tmp_path, monkeypatch, case, field, words):
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = str(tmp_path / "saved")
    if case == "bad_row":
        datasets.Dataset.from_list([{"q": "1", "a": "2"}, {"q": "3", "a": "4"}, {"q": "5", "a": None}]).save_to_disk(source)
    elif case == "no_split":
        datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS)}).save_to_disk(source)
    elif case == "no_column":
        datasets.Dataset.from_list([{"p": "1", "a": "2"}]).save_to_disk(source)
    elif case == "empty_folder":
        (tmp_path / "saved").mkdir()
    else:
        source = "nobody/no-such-dataset"
    with pytest.raises(ConfigError) as err:
        data.load_examples([source], "q", "a")
    assert err.value.field == field, err.value
    for w in words:
        assert w in str(err.value), str(err.value)
