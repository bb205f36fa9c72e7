"""The `group` argument of megapo.learner.logprobs' vocabulary-parallel functions when one rank holds the whole
(padded) vocabulary: no process group is started, and the functions skip their collectives at size 1."""


class OneRankGroup:
    def rank(self):
        return 0

    def size(self):
        return 1


ONE = OneRankGroup()


def response_pass_stub(logits, vocab: int, mb):
    """A stand-in `self` for Learner's response-position passes (Learner._response_pass and the methods on it):
    one micro-batch `mb` (its select, order, sizes; targets where the pass reads them) whose forward gives
    `logits` ([rows, W, V]: picked at mb.select as the learner's forward step does), on one rank. Call e.g. `Learner.response_sum_p2(stub, sequences, prompt_lens)`."""
    from functools import partial
    from types import SimpleNamespace

    from megapo.learner.learner import Learner

    model = SimpleNamespace(eval=lambda: None, train=lambda: None)
    me = SimpleNamespace(spec=SimpleNamespace(vocab_size=vocab), route_hook=None, model=model,
                         _micro_batches=lambda *a, **k: [mb],
                         _run=lambda mbs, collect, forward_only: [Learner._at_selected(collect, m, logits)[1] for m in mbs],
                         _share_results=lambda items: items)
    me._per_sequence = partial(Learner._per_sequence, me)
    me._response_micro_batches = partial(Learner._response_micro_batches, me)
    me._response_pass = partial(Learner._response_pass, me)
    return me
