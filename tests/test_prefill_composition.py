"""The TTFT split of a split request and the floor prompt chunking cannot beat (analysis.prefill_composition)."""

import shutil
from pathlib import Path

import pandas as pd
import pytest

from analysis import prefill_composition

SAMPLE = Path(__file__).resolve().parent / "data" / "sample-campaign"


def requests(ttft_s: list[float]) -> pd.DataFrame:
    # two requests: 0.1 s device, 0.6 s network, 0.2 s server; the second also waited 0.5 s for a slot
    return pd.DataFrame({
        "node": ["a", "b"], "request_id": [0, 1], "prompt_tokens": [100, 400], "ttft_s": ttft_s,
        "prefill_device_head_s": [0.08, 0.08], "prefill_device_tail_s": [0.02, 0.02],
        "prefill_network_s": [0.6, 0.6], "prefill_server_residence_s": [0.2, 0.2],
    })  # fmt: skip


def test_the_rest_of_ttft_is_waiting_and_the_network_share_is_of_the_whole():
    split = prefill_composition.composition(requests([0.9, 1.4]))
    assert list(split["other_s"]) == pytest.approx([0.0, 0.5])
    assert list(split["network_share"]) == pytest.approx([0.6 / 0.9, 0.6 / 1.4])


def test_chunking_that_hides_all_compute_reaches_the_floor_and_none_reaches_nothing():
    whole = requests([0.9, 1.4])
    hidden_all = prefill_composition.chunked_against_whole(requests([0.6, 1.1]), whole)
    assert list(hidden_all["floor_ratio"]) == pytest.approx([0.6 / 0.9, 1.1 / 1.4])
    assert list(hidden_all["attainable_reached"]) == pytest.approx([1.0, 1.0])
    total = prefill_composition.summary(hidden_all)
    assert total["ttft_change"] == pytest.approx(total["floor_change"]) == pytest.approx(-0.6 / 2.3)
    assert total["waiting_share_of_whole_ttft"] == pytest.approx(0.5 / 2.3)
    gained_nothing = prefill_composition.summary(prefill_composition.chunked_against_whole(whole, whole))
    assert gained_nothing["ttft_change"] == 0 and gained_nothing["attainable_reached"] == 0


def test_the_same_request_of_each_repetition_pairs_with_itself_only():
    whole = pd.concat([requests([0.9, 1.4]).assign(repetition=r) for r in (0, 1)])
    chunked = pd.concat([requests([0.6 + r, 1.1]).assign(repetition=r) for r in (0, 1)])
    pairs = prefill_composition.chunked_against_whole(chunked, whole)
    assert len(pairs) == 4  # not 8: request ids repeat across repetitions
    assert sorted(pairs["ttft_s_chunked"]) == pytest.approx([0.6, 1.1, 1.1, 1.6])
    intervals = prefill_composition.summary(pairs)["intervals"]
    floor = intervals["floor_change"]
    assert floor["estimate"] == pytest.approx(-1.2 / 4.6)  # device and server, 0.3 s a request, of all TTFT
    assert floor["low"] <= floor["estimate"] <= floor["high"]


def test_a_campaign_s_chunking_groups_pair_with_the_whole_group_of_the_same_other_settings(tmp_path):
    from analysis.load import load
    from bench.hat_prefill_composition import by_group

    sample = Path(shutil.copytree(SAMPLE, tmp_path / "sample"))
    by = ["method", "workload.rate_per_s", "power.orin"]
    rows = by_group(sample, by, chunked=("centralized",))  # centralized stands in for a chunking method
    assert len(rows) == 4  # two rates x two power modes, each against U-shape's group of the same
    data = load(sample)
    requests = data.requests.merge(data.runs[["run_id", *by]], on="run_id")
    for row in rows:
        settings = row["settings"]
        assert row["against"] == {**settings, "method": "ushape"}
        same = (requests["workload.rate_per_s"] == settings["workload.rate_per_s"]) & (
            requests["power.orin"] == settings["power.orin"])  # fmt: skip
        pairs = requests[same & (requests["method"] == "centralized")].merge(
            requests[same & (requests["method"] == "ushape")], on=["node", "request_id"], suffixes=("_c", "_u"))
        assert row["requests"] == len(pairs) > 0
        assert row["ttft_change"] == pytest.approx(pairs["ttft_s_c"].sum() / pairs["ttft_s_u"].sum() - 1)
