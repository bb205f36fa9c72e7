"""The `group` argument of megapo.learner.logprobs' vocabulary-parallel functions when one rank holds the whole
(padded) vocabulary: no process group is started, and the functions skip their collectives at size 1."""


class OneRankGroup:
    def rank(self):
        return 0

    def size(self):
        return 1


ONE = OneRankGroup()
