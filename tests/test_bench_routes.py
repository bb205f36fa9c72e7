"""megapo bench routes: the measured bytes are positions x MoE layers x top-k x 1 byte (int8 for 8 experts), the
learner's check keeps that type, and the projection is the formula written out here."""

from tools.bench.routes import LARGE, measured, projected


def test_measured_bytes_of_a_tiny_batch():
    m = measured(prompts=3, samples=2, max_new=5)
    per_id = 1  # int8: 8 experts and -1 fit
    assert m["dtype"] == "int8" and m["samples"] == 6
    assert m["bytes_engine"] == m["positions"] * m["model"]["moe_layers"] * m["model"]["topk"] * per_id
    assert m["bytes_learner_check"] == m["bytes_engine"] and m["bytes_int64"] == 8 * m["bytes_engine"]


def test_projection_formula():
    p = projected(LARGE)
    ids = 64 * 8 * 8191 * 58 * 8
    assert p["ids"] == ids and p["dtype"] == "int16" and p["bytes"] == 2 * ids and p["bytes_int64"] == 8 * ids
