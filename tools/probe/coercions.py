"""Probe cases of the class 'wrong: silent coercions': data rows and rewards of the wrong type (null or
integer fields, a number as a string, booleans as token ids) refused instead of coerced.
"""

from __future__ import annotations

from tools.probe.inputs import _data_refusal, _good_rows, _jsonl, _parquet
from tools.probe.registry import case, config_refusal, refused


COERCE = "wrong: silent coercions"


@case(COERCE)
def jsonl_null_answer(ctx):
    def files(d):
        return [_jsonl(d / "train.jsonl", _good_rows(2) + [{"prompt": "3+3=", "answer": None}])]
    return _data_refusal(ctx, "jsonl_null_answer", files, "train.jsonl:3", "answer")


@case(COERCE)
def jsonl_integer_prompt(ctx):
    def files(d):
        return [_jsonl(d / "train.jsonl", [{"prompt": 7, "answer": "7"}] + _good_rows(2))]
    return _data_refusal(ctx, "jsonl_integer_prompt", files, "train.jsonl:1", "prompt")


@case(COERCE)
def parquet_integer_prompts(ctx):
    def files(d):
        return [_parquet(d / "train.parquet", {"prompt": [0, 1, 2], "answer": ["0", "1", "2"]})]
    return _data_refusal(ctx, "parquet_integer_prompts", files, "train.parquet", "prompt")


@case(COERCE)
def parquet_null_answer(ctx):
    def files(d):
        return [_parquet(d / "train.parquet", {"prompt": ["1+1=", "2+2="], "answer": ["2", None]})]
    return _data_refusal(ctx, "parquet_null_answer", files, "train.parquet", "answer")


@case(COERCE)
def reward_returns_number_as_string(ctx):
    return config_refusal(ctx, "reward_string_number", ("data.reward=probe_rewards:string_number",),
                          ("string_number", "'1.0'"))


@case(COERCE)
def logprobs_true_false_as_token_ids(ctx):
    folder = ctx.fresh("logprobs_bool")
    inp = _jsonl(folder / "in.jsonl", [{"tokens": [1, 2, 3]}, {"tokens": [1, True, False]}])
    out = ctx.megapo("logprobs", "--model", ctx.model, "--input", inp, "--output", folder / "out.jsonl")
    return refused(ctx, out, "--input", "in.jsonl:2", "true/false", forbid=(folder / "out.jsonl",))
