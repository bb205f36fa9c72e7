"""The addition task: splits are disjoint and fixed, prompts/answers are right (checked by arithmetic)."""

import numpy as np

from megapo.tasks import addition
from megapo.tasks.base import Example


def test_splits_disjoint_sizes_and_stable():
    test = set(addition.split_ids("test").tolist())
    val = set(addition.split_ids("validation").tolist())
    train = addition.split_ids("train")
    assert len(test) == 1000 and len(val) == 500
    assert len(train) == 1000 * 1000 - 1500
    assert not test & val
    train_set = set(train.tolist())
    assert not train_set & test and not train_set & val
    assert len(train_set | test | val) == 1000 * 1000
    # seeded training subsets never touch the evaluation splits
    for seed in (0, 1, 2):
        ids = {ex.meta["id"] for ex in addition.examples("train", 2000, seed)}
        assert len(ids) == 2000 and not ids & (test | val)
    assert [e.prompt for e in addition.examples("test", 5)] == [e.prompt for e in addition.examples("test", 5)]


def test_prompt_and_answer_by_hand():
    ex = addition.example(123 * 1000 + 456)
    assert ex.prompt == "123+456=" and ex.answer == "0579"
    ex = addition.example(999 * 1000 + 999)
    assert ex.prompt == "999+999=" and ex.answer == "1998"
    ex = addition.example(7)
    assert ex.prompt == "000+007=" and ex.answer == "0007"
    rng = np.random.default_rng(0)
    for ex in addition.examples("validation"):
        a, b = int(ex.prompt[:3]), int(ex.prompt[4:7])  # parse the text independently of meta
        assert int(ex.answer) == a + b and len(ex.answer) == 4
    assert rng is not None


def test_verify_hand_made():
    ex = Example("123+456=", "0579")
    assert addition.verify(ex, "0579") == 1.0
    assert addition.verify(ex, " 0579\n") == 1.0
    assert addition.verify(ex, "579") == 0.0  # must be zero-padded
    assert addition.verify(ex, "0578") == 0.0
    assert addition.verify(ex, "05790") == 0.0
    assert addition.verify(ex, "") == 0.0


def test_tokenizer_digits_single_tokens(tiny_moe):
    from transformers import AutoTokenizer

    from megapo.trainer.data import encode_answer, encode_prompt

    tok = AutoTokenizer.from_pretrained(tiny_moe)
    ids = encode_prompt(tok, "123+456=", chat_template=False)
    assert len(ids) == 8 + (tok.bos_token_id is not None)
    assert tok.decode(ids, skip_special_tokens=True) == "123+456="
    ans = encode_answer(tok, "0579")
    assert len(ans) == 5 and ans[-1] == tok.eos_token_id
    chat = encode_prompt(tok, "123+456=", chat_template=True)
    assert tok.decode(chat).endswith("<|im_start|>assistant\n") and len(chat) > len(ids)
