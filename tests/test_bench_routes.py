"""megapo bench routes: the measured bytes are positions x MoE layers x top-k x 1 byte (int8 for 8 experts), the
learner's check keeps that type, and the projection is the formula written out here."""

import pytest

from tools.bench.routes import LARGE, measured, projected, stage_moe_layers


def test_measured_bytes_of_a_tiny_batch():
    m = measured(prompts=3, samples=2, max_new=5)
    per_id = 1  # int8: 8 experts and -1 fit
    assert m["dtype"] == "int8" and m["samples"] == 6
    assert m["bytes_engine"] == m["positions"] * m["model"]["moe_layers"] * m["model"]["topk"] * per_id
    assert m["bytes_learner_check"] == m["bytes_engine"] and m["bytes_int64"] == 8 * m["bytes_engine"]
    # PP=2: the tiny model's 2 MoE layers, one per stage; a rank other than 0 receives one column of two
    pp = m["pp2"]
    assert pp["stage_moe_layers"] == [[0], [1]] and pp["route_bytes_broadcast"] == m["bytes_engine"]
    assert pp["route_bytes_by_stage"] == [m["positions"] * 1 * m["model"]["topk"] * per_id] * 2
    assert pp["route_ratio"] == 2.0
    assert all(b < pp["payload_bytes_broadcast"] for b in pp["payload_bytes_by_stage"])
    assert pp["scatter_bytes_per_rank"] == max(pp["payload_bytes_by_stage"])


def test_stage_moe_layers_of_an_even_split():
    # dense first layers (deepseek_v3's first_k_dense_replace): columns count MoE layers only
    assert stage_moe_layers([False, True, True, True], 2) == [[0], [1, 2]]
    assert stage_moe_layers([False, False, False, True, True, True], 3) == [[], [0], [1, 2]]
    assert stage_moe_layers([True, True], 1) == [[0, 1]]
    with pytest.raises(ValueError, match="do not split evenly"):
        stage_moe_layers([True] * 61, 2)


def test_projection_formula():
    p = projected(LARGE)
    ids = 64 * 8 * 8191 * 58 * 8
    assert p["ids"] == ids and p["dtype"] == "int16" and p["bytes"] == 2 * ids and p["bytes_int64"] == 8 * ids
