"""The train sample's old address: megapo.algorithms.sample defines TrainSample (there, below megapo.replay,
which takes train samples too, and the learner); this re-exports it for the tests and tools that import it from
here."""

from megapo.algorithms.sample import (FIELDS, OPTIONAL_FIELDS, TOKEN_FIELDS, MappingSample,  # noqa: F401
                                      TrainSample, as_train_samples, without_routes)
