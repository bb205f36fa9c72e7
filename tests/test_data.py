"""Prompt loading, filtering, resumable order and dynamic sampling."""

import json

import pytest

from megapo.config import ConfigError
from megapo.trainer import data


def test_load_jsonl_and_parquet_via_datasets(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(5)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pq.write_table(pa.table({"q": [r["q"] for r in rows], "a": [r["a"] for r in rows]}), tmp_path / "d.parquet")
    for name in ("d.jsonl", "d.parquet"):
        path = str(tmp_path / name)
        assert data.check_data_files([path], "q", "a") == 5
        exs = data.load_examples([path], "q", "a")
        assert [(e.prompt, e.answer) for e in exs] == [(r["q"], r["a"]) for r in rows]


def test_malformed_row_names_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a", "answer": "b"}\n{"prompt": 3, "answer": "b"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2") as err:
        data.check_data_files([str(p)], "prompt", "answer", "data.val_files")
    assert err.value.field == "data.val_files[0]"


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
