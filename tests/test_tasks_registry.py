"""data.task resolves through megapo.tasks.registry: built-in names, a user's module:function, refusals naming
the field; the addition task (the main job's) gives exactly what the code before the registry gave."""

import numpy as np
import pytest
import torch

from megapo.config import ConfigError, load_config
from megapo.tasks.registry import get_task, reward_spec
from megapo.trainer.config import RunConfig


# ---- the pre-registry addition code, written out as the reference (megapo/tasks/addition.py and
# megapo/trainer/sft.py build_examples at commit c8b2ea0)
def _old_split_ids(split):
    perm = np.random.default_rng(20240917).permutation(1000 * 1000)
    return {"test": perm[:1000], "validation": perm[1000:1500], "train": perm[1500:]}[split]


def _old_examples(split, n=None, seed=None):
    ids = _old_split_ids(split)
    if n is not None:
        ids = ids[np.random.default_rng(seed).choice(len(ids), size=n, replace=False)] if seed is not None else ids[:n]
    return [(f"{a:03d}+{b:03d}=", f"{a + b:04d}", {"a": a, "b": b, "id": int(i)})
            for i in ids for a, b in [divmod(int(i), 1000)]]


def _old_sft_tensors(tok, n, seed):
    rows = [(tok(p, add_special_tokens=False)["input_ids"], tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
            for p, a, _ in _old_examples("train", n, seed)]
    width = max(len(p) + len(a) for p, a in rows)
    inputs = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        inputs[i, :len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
    return inputs, labels


def _triples(examples):
    return [(e.prompt, e.answer, e.meta) for e in examples]


def test_addition_examples_are_those_of_the_code_before_the_registry():
    task = get_task("addition")
    assert task.sizes == {"train": 998500, "validation": 500, "test": 1000} and task.reward == "exact_match"
    assert _triples(task.examples("test")) == _old_examples("test")
    assert _triples(task.examples("validation")) == _old_examples("validation")
    assert _triples(task.examples("test", 50)) == _old_examples("test", 50)
    for seed in (0, 7):  # the SFT examples (sft.examples=2000, sft.seed) and a seeded subset
        assert _triples(task.examples("train", 2000, seed)) == _old_examples("train", 2000, seed)
    old_train = _old_split_ids("train")
    for i in (0, 5, 998499):
        a, b = divmod(int(old_train[i]), 1000)
        assert task.example("train", i).prompt == f"{a:03d}+{b:03d}="


def test_addition_sft_demonstrations_and_prompt_pool_unchanged(tiny_moe):
    from transformers import AutoTokenizer

    from megapo.trainer import data
    from megapo.trainer.sft import build_examples

    tok = AutoTokenizer.from_pretrained(tiny_moe)
    inputs, labels = build_examples(tok, "addition", 2000, 0)
    old_inputs, old_labels = _old_sft_tensors(tok, 2000, 0)
    assert torch.equal(inputs, old_inputs) and torch.equal(labels, old_labels)
    pool = data.PromptPool(tok, False, 16, task="addition")
    old_train = _old_split_ids("train")
    assert len(pool) == len(old_train)
    for i in (0, 1, 12345):
        ex, ids = pool[i]
        a, b = divmod(int(old_train[i]), 1000)
        assert (ex.prompt, ex.answer) == (f"{a:03d}+{b:03d}=", f"{a + b:04d}")
        assert ids == tok(ex.prompt, add_special_tokens=False)["input_ids"]


def _cfg(tiny_moe, *over):
    return load_config(RunConfig, None, [f"model.path={tiny_moe}", "data.max_prompt_tokens=16", *over])


def test_unknown_task_and_bad_options_fail_at_config_validation(tiny_moe, user_module):
    with pytest.raises(ConfigError) as err:
        _cfg(tiny_moe, "data.task=no_such_task")
    assert err.value.field == "data.task" and "no_such_task" in err.value.message and "addition_cot" in err.value.message
    with pytest.raises(ConfigError) as err:
        _cfg(tiny_moe, "data.task=megapo_no_such_module_xyz:make")
    assert err.value.field == "data.task" and "cannot import" in err.value.message
    with pytest.raises(ConfigError) as err:
        _cfg(tiny_moe, "data.task=addition_cot", "data.task_options={max_digit: 4}")
    assert err.value.field == "data.task_options" and "max_digit" in err.value.message
    with pytest.raises(ConfigError) as err:
        _cfg(tiny_moe, "data.task=addition_cot", "data.task_options={min_digits: 5, max_digits: 3}")
    assert err.value.field == "data.task_options" and "min_digits=5 exceeds max_digits=3" in err.value.message
    with pytest.raises(ConfigError) as err:
        _cfg(tiny_moe, "data.train_files=[x.jsonl]", "data.task_options={a: 1}")
    assert err.value.field == "data.task_options"
    name = user_module("not_a_task_mod", "def make():\n    return [1, 2]\n")
    with pytest.raises(ConfigError) as err:
        _cfg(tiny_moe, f"data.task={name}:make")
    assert err.value.field == "data.task" and "returned a list" in err.value.message
    with pytest.raises(ConfigError) as err:  # the task's test split is smaller than the eval asks
        _cfg(tiny_moe, "data.task=addition_cot", "data.task_options={min_digits: 2, max_digits: 2}",
             "train.eval_prompts=201")
    assert err.value.field == "train.eval_prompts" and "200 problems" in err.value.message


USER_TASK = '''
from megapo.tasks.base import Example, Task


def make(offset=0):
    """x -> x + offset + 1, digits of the prompt as the difficulty."""
    def get(split, i):
        x = {"train": 100 + i, "validation": 50 + i, "test": i}[split]
        return Example(f"inc {x}:", str(x + offset + 1), difficulty=len(str(x)))
    return Task("inc", {"train": 1000, "validation": 10, "test": 20}, get, reward="exact_match",
                demonstrations=lambda exs, seed: [f"= {e.answer}" for e in exs])
'''


def test_a_user_task_is_module_function(tiny_moe, user_module, tmp_path):
    from transformers import AutoTokenizer

    from megapo.trainer import data
    from megapo.trainer.sft import build_examples

    name = user_module("user_inc_task", USER_TASK)
    cfg = _cfg(tiny_moe, f"data.task={name}:make", "data.task_options={offset: 2}", "train.eval_prompts=20",
               f"train.output_dir={tmp_path / 'run'}")
    assert reward_spec(cfg.data) == "exact_match"
    tok = AutoTokenizer.from_pretrained(tiny_moe)
    pool = data.prompt_pool(cfg, tok)
    assert len(pool) == 1000
    ex, ids = pool[3]
    assert (ex.prompt, ex.answer, ex.difficulty) == ("inc 103:", "106", 3)
    assert tok.decode(ids) == "inc 103:"
    task = get_task(cfg.data.task, cfg.data.task_options)
    assert [e.answer for e in task.examples("test", 3)] == ["3", "4", "5"]
    inputs, labels = build_examples(tok, task, 4, 0)  # the target is the task's demonstration, then EOS
    for row, lab in zip(inputs.tolist(), labels.tolist()):
        start = next(i for i, t in enumerate(lab) if t != -100)
        target = [t for t in lab if t != -100]
        prompt = tok.decode(row[:start])
        assert target[-1] == tok.eos_token_id and row[start:start + len(target)] == target
        assert tok.decode(target[:-1]) == f"= {int(prompt[4:-1]) + 3}"  # offset 2, plus one


def test_reward_auto_is_the_tasks_own(tiny_moe):
    assert reward_spec(_cfg(tiny_moe, "data.task=addition").data) == "exact_match"
    assert reward_spec(_cfg(tiny_moe, "data.task=addition_cot", "data.max_prompt_tokens=32").data) == \
        "megapo.tasks.addition_cot:reward"
    assert reward_spec(_cfg(tiny_moe, "data.task=addition_cot", "data.max_prompt_tokens=32",
                            "data.reward=math").data) == "math"
