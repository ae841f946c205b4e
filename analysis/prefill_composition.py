"""Where a split request's time to first token goes, and how much of it prompt chunking can hide.

A U-shape prefill runs in sequence: the device's input submodel over the whole prompt, the upload of its
hidden states, the server's middle submodel, the download and the device's output submodel. Prompt
chunking (HAT Sec. 3.3) overlaps the upload of one chunk with the server's compute of the one before and
the device's of the one after, but every byte still has to cross the uplink, and the time a request waits
for a free device slot is not touched: at best a chunked prefill hides all the compute behind the upload.
So the TTFT without the whole request's device and server time is the *floor* no chunk size beats, and
``(device + server) / TTFT`` the most chunking can take off a request that waits alone (under load,
shorter prefills also shorten the next requests' wait for a slot, and chunking can beat that floor).
HAT's own measurement (Sec. 2.3, Fig. 1(b)) puts the compute at 10.3% of a 2k-token prompt's U-shape
TTFT, the network at 89.6%.

Columns come from the device's request log (``prefill_device_head_s``, ``prefill_network_s``,
``prefill_server_residence_s``, ...), in the target's seconds once :func:`analysis.load.load` has divided
a dilated run back. A request is the same request in both methods when its node, id and repetition
(where the frames have one) are: a campaign replays one schedule per repetition to every method.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from analysis.uncertainty import mean_interval

KEY = ["node", "request_id"]


def _key(frame: pd.DataFrame) -> list[str]:
    return ["repetition", *KEY] if "repetition" in frame else KEY


def composition(requests: pd.DataFrame) -> pd.DataFrame:
    """One row per request: its TTFT split into device, network, server and the rest (waiting for a
    device slot, messaging), and the network's share of it."""
    out = requests[[*_key(requests), "prompt_tokens", "ttft_s"]].copy()
    out["device_s"] = requests["prefill_device_head_s"] + requests["prefill_device_tail_s"]
    out["network_s"] = requests["prefill_network_s"]
    out["server_s"] = requests["prefill_server_residence_s"]
    out["other_s"] = out["ttft_s"] - out["device_s"] - out["network_s"] - out["server_s"]
    out["network_share"] = out["network_s"] / out["ttft_s"]
    return out


def chunked_against_whole(chunked: pd.DataFrame, whole: pd.DataFrame) -> pd.DataFrame:
    """The same requests (node, request id) prefilled in chunks and whole: TTFT ratio, the floor
    chunking can reach (the whole request's TTFT without its compute, over its TTFT) and the share of the
    attainable gain it reached (1 when all the compute hid behind the upload, 0 when nothing did)."""
    key = [c for c in _key(whole) if c in chunked]
    pairs = composition(whole).merge(chunked[[*key, "ttft_s"]], on=key, suffixes=("_whole", "_chunked"))
    pairs["ratio"] = pairs["ttft_s_chunked"] / pairs["ttft_s_whole"]
    pairs["floor_ratio"] = 1 - (pairs["device_s"] + pairs["server_s"]) / pairs["ttft_s_whole"]
    pairs["attainable_reached"] = (1 - pairs["ratio"]) / (1 - pairs["floor_ratio"])
    return pairs


def summary(pairs: pd.DataFrame) -> dict[str, Any]:
    """Totals over the requests (a campaign's mean TTFT change is a ratio of sums) and medians per request;
    the floor and the shares also with their 95% intervals (bootstrap over requests and repetitions)."""
    whole, chunked = pairs["ttft_s_whole"].sum(), pairs["ttft_s_chunked"].sum()
    clusters = pairs.get("repetition")
    compute = pairs["device_s"].sum() + pairs["server_s"].sum()
    return {
        "requests": len(pairs),
        "ttft_change": float(chunked / whole - 1),
        "floor_change": float(-compute / whole),
        "attainable_reached": float((whole - chunked) / compute),
        "network_share_of_whole_ttft": float(pairs["network_s"].sum() / whole),
        "device_share_of_whole_ttft": float(pairs["device_s"].sum() / whole),
        "server_share_of_whole_ttft": float(pairs["server_s"].sum() / whole),
        "waiting_share_of_whole_ttft": float(pairs["other_s"].sum() / whole),
        "median_ratio": float(pairs["ratio"].median()),
        "median_floor_ratio": float(pairs["floor_ratio"].median()),
        "intervals": {
            name: mean_interval(part, pairs["ttft_s_whole"], clusters).as_dict()
            for name, part in (("floor_change", -(pairs["device_s"] + pairs["server_s"])),
                               ("network_share_of_whole_ttft", pairs["network_s"]),
                               ("waiting_share_of_whole_ttft", pairs["other_s"]))
        },
    }  # fmt: skip
