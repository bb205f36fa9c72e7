"""Held-out anytime accuracy: AnytimeReasoner's evaluation of a policy under every thinking budget (stage anytime).

Qi, Liu, Pang, Du, Lee, Lin 2025, Optimizing Anytime Reasoning via Budget Relative Policy Optimization
(arXiv:2505.13438): a policy is judged by its answer when its thinking is cut at each budget b of a budget set, and
by the area under that anytime curve.

For each held-out example x (the task's test split, the first n), greedy decoding writes one thinking z of up to
max(budgets) tokens. For each budget b (increasing):

    z ended on its own (end-of-sequence) within b tokens   right_b(x) = the verifier's verdict on z's own answer
    otherwise                                              right_b(x) = the verdict on the summary the engine writes,
                                                           greedy, behind x ⊕ z[:b] ⊕ trigger (at most
                                                           summary_tokens tokens; it must end with end-of-sequence)

    acc@b = (1/N) Σ_x right_b(x)                           eval/anytime_acc@<b>
    auc   = (1/S) Σ_b acc@b                                eval/anytime_auc

The summaries are drawn by stage anytime's own code (megapo/trainer/anytime.py: draw_summaries, summary_prompt,
ended_within), one engine call per budget (per `batch_size` prompts) with the cut prefixes of the thinkings that
had not ended within it; a budget longer than a thinking that ran out of tokens summarises the whole of it.
Verdicts as megapo/trainer/eval.py: the task's verifier on the decoded text above 0.5, and the text ended with
end-of-sequence.

Assumption: a thinking that ended within b is scored by its own answer, no summary drawn there (the stage's rule
while training; the authors append the answer delimiter to the complete thinking and draw a summary). Assumption:
the area under the curve is the plain mean of acc@b over the budgets (a Riemann sum on evenly spaced budgets),
whatever the training prior's weights. Assumption: greedy decoding, as megapo's other held-out evals.

Budgets: stage anytime's eval_budgets, else its budgets (a training run, at each train.eval_every step beside
eval/accuracy); `megapo bench anytime` (tools/bench/anytime.py) runs it on any HF folder and writes the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from megapo.engines.base import Sample, SamplingParams
from megapo.tasks.base import Example
from megapo.trainer.anytime import draw_summaries, ended_within
from megapo.trainer.eval import greedy_params


@dataclass
class AnytimeEval:
    """Each example's verdict at each budget (`right[i][s]`), the summaries drawn at each budget, the thinkings'
    lengths (response tokens, end-of-sequence included) and whether each ended on its own."""

    budgets: list[int]
    right: list[list[bool]]
    summaries: list[int]
    lengths: list[int]
    stopped: list[bool]

    def accuracies(self) -> list[float]:
        """acc@b: the share of examples right at each budget."""
        n = len(self.right)
        return [sum(row[s] for row in self.right) / n if n else 0.0 for s in range(len(self.budgets))]

    def auc(self) -> float:
        """The area under the anytime curve: the mean of acc@b over the budgets."""
        return math.fsum(self.accuracies()) / len(self.budgets)

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """<prefix>anytime_acc@<b> per budget and <prefix>anytime_auc."""
        out = {f"{prefix}anytime_acc@{b}": a for b, a in zip(self.budgets, self.accuracies())}
        out[f"{prefix}anytime_auc"] = self.auc()
        return out

    def table(self) -> dict:
        """The per-budget table (JSON): accuracy, thinkings ended within the budget, summaries drawn; the AUC."""
        n = len(self.right)
        ended = [sum(stop and length <= b for length, stop in zip(self.lengths, self.stopped)) for b in self.budgets]
        return {"examples": n, "budgets": list(self.budgets), "auc": self.auc(),
                "rows": [{"budget": b, "accuracy": a, "ended": e / n if n else 0.0, "summaries": k}
                         for b, a, e, k in zip(self.budgets, self.accuracies(), ended, self.summaries)],
                "mean_thinking_len": sum(self.lengths) / n if n else 0.0}


def greedy_thinkings(engine, prompt_ids: Sequence[list[int]], params: SamplingParams,
                     batch_size: int) -> list[Sample]:
    """Each prompt's greedy thinking, `batch_size` prompts per engine call."""
    prompts = [list(p) for p in prompt_ids]
    return [g[0] for i in range(0, len(prompts), batch_size) for g in engine.generate(prompts[i:i + batch_size],
                                                                                      params)]


def right_answer(tokenizer, verify: Callable[[Example, str], float], example: Example, sample: Sample,
                 eos_token_id: int) -> bool:
    """The verdict on a response (a thinking or a summary): it ended with end-of-sequence and the verifier scores its
    decoded text (special tokens removed) above 0.5."""
    ids = list(sample.output_ids)
    if not ids or ids[-1] != eos_token_id:
        return False
    return verify(example, tokenizer.decode(ids[:-1], skip_special_tokens=True)) > 0.5


def summaries_at(engine, thinkings: list[Sample], budget: int, trigger_ids: list[int], params: SamplingParams,
                 batch_size: int) -> dict[int, Sample]:
    """The greedy summary behind x ⊕ z[:budget] ⊕ trigger of each thinking that did not end within `budget`, by its
    index (stage anytime's draw_summaries, `batch_size` prompts per call)."""
    pending = [i for i, z in enumerate(thinkings) if not ended_within(z, budget)]
    out: dict[int, Sample] = {}
    for start in range(0, len(pending), batch_size):
        chunk = pending[start:start + batch_size]
        drawn = draw_summaries(engine, [thinkings[i] for i in chunk], [budget] * len(chunk), trigger_ids, params)
        out.update((i, samples[0]) for i, samples in zip(chunk, drawn))
    return out


def anytime_accuracy(engine, tokenizer, examples: Sequence[Example], prompt_ids: Sequence[list[int]],
                     verify: Callable[[Example, str], float], budgets: list[int], trigger_ids: list[int],
                     summary_tokens: int, batch_size: int = 256) -> AnytimeEval:
    """Each example's greedy thinking of up to max(budgets) tokens, then at each budget its own answer (ended within
    it) or its greedy summary after the cut and the trigger, scored by `verify` (module docstring)."""
    eos = tokenizer.eos_token_id
    thinkings = greedy_thinkings(engine, prompt_ids, greedy_params(eos, max(budgets)), batch_size)
    own = [right_answer(tokenizer, verify, ex, z, eos) for ex, z in zip(examples, thinkings)]
    params = greedy_params(eos, summary_tokens)
    right = [[False] * len(budgets) for _ in thinkings]
    drawn = []
    for s, b in enumerate(budgets):
        summaries = summaries_at(engine, thinkings, b, trigger_ids, params, batch_size)
        drawn.append(len(summaries))
        for i, (ex, z) in enumerate(zip(examples, thinkings)):
            right[i][s] = (own[i] if ended_within(z, b)
                           else right_answer(tokenizer, verify, ex, summaries[i], eos))
    return AnytimeEval(list(budgets), right, drawn, [len(z.output_ids) for z in thinkings],
                       [z.finish_reason == "stop" for z in thinkings])


def evaluate_anytime(engine, task, tokenizer, budgets: list[int], trigger_ids: list[int], summary_tokens: int, *,
                     split: str = "test", n: int | None = None, chat_template: bool = False,
                     batch_size: int = 256) -> AnytimeEval:
    """anytime_accuracy on the first `n` examples of a task's split (`task`: a name or a Task) with the task's own
    verifier."""
    from megapo.tasks.registry import get_task
    from megapo.trainer.data import encode_prompt
    from megapo.trainer.eval import task_verifier

    task = get_task(task)
    examples = task.examples(split, n)
    prompts = [encode_prompt(tokenizer, ex.prompt, chat_template) for ex in examples]
    return anytime_accuracy(engine, tokenizer, examples, prompts, task_verifier(task), budgets, trigger_ids,
                            summary_tokens, batch_size)


def run_anytime_eval(cfg, engine, tokenizer, anytime) -> dict[str, float]:
    """A training run's held-out anytime accuracy (Run.evaluate, rank 0; `anytime` the run's AnytimeRollouts): the
    stage's evaluated budgets on the first train.eval_prompts test examples, eval/anytime_acc@<b> and
    eval/anytime_auc."""
    from megapo.tasks.registry import get_task

    o = anytime.options
    return evaluate_anytime(engine, get_task(cfg.data.task, cfg.data.task_options), tokenizer, o.evaluated_budgets(),
                            anytime.trigger_ids, o.summary_tokens, n=cfg.train.eval_prompts,
                            chat_template=cfg.data.chat_template).metrics("eval/")
