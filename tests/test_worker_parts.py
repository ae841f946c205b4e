"""Unit tests of the split-inference worker parts that need no MPI launch, root or network.

The wire format, HAT's state monitor, the run config and schedules, the U-shape partition, the KV
cache, and the controller's mpiexec plan and spec checks.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from foundation.errors import TestbedError
from nodes.contracts import run_config
from nodes.contracts.run_config import RunConfigError, load_schedule
from nodes.inference.kv_cache import KVCache
from nodes.inference.partition import PartitionError, UShapePartition
from nodes.workers import wire
from nodes.workers.split.state_monitor import StateMonitor, bucket_of
from nodes.workers.wire import DATA, DECODE, PREFILL, RELEASE, STOP, Segment, WireError, decode, encode
from testbed.inventory import Inventory, load_inventory
from testbed.workers.mpi_launch import MpiLaunchPlan, RankGroup, data_plane_env
from testbed.workers.split_spec import SplitRunSpec, check_spec, device_schedule

# --------------------------------------------------------------------------------------------
# wire


def frame_size(*payload_bytes: int) -> int:
    return 20 + 64 * len(payload_bytes) + sum(payload_bytes)  # frame header: 20 bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_float_hidden_states_round_trip_exactly(dtype):
    hidden = torch.randn(3, 5, generator=torch.Generator().manual_seed(1)).to(dtype)
    segment = Segment(request_id=7, device=2, phase=PREFILL, start=11, tokens=3, payload=hidden)
    buffer = encode(DATA, 42, [segment])
    assert len(buffer) == frame_size(3 * 5 * hidden.element_size())
    frame = decode(buffer)
    assert (frame.kind, frame.iteration, len(frame.segments)) == (DATA, 42, 1)
    got = frame.segments[0]
    assert got.payload.dtype == dtype and got.payload.shape == (3, 5)
    assert torch.equal(got.payload, hidden)
    assert (got.request_id, got.device, got.phase, got.start, got.tokens) == (7, 2, PREFILL, 11, 3)


def test_bfloat16_travels_as_its_exact_bit_pattern():
    # Patterns a float conversion would disturb: -0, +inf, a NaN with payload bits, a subnormal, extremes.
    bits = torch.tensor([[0x0000, -32768, 0x7F80, 0x7FC1], [0x0001, 0x7F7F, -129, 0x3F80]], dtype=torch.int16)
    hidden = bits.view(torch.bfloat16)
    buffer = encode(DATA, 1, [Segment(1, 0, DECODE, 0, 2, hidden)])
    assert len(buffer) == frame_size(2 * 4 * 2)
    got = decode(buffer).segments[0].payload
    assert got.dtype == torch.bfloat16 and got.shape == (2, 4)
    assert torch.equal(got.view(torch.int16), bits)


def test_int32_token_ids_round_trip():
    ids = torch.tensor([[5], [2**31 - 1], [-1], [0]], dtype=torch.int32)
    buffer = encode(DATA, 0, [Segment(9, 1, DECODE, 4, 4, ids)])
    assert len(buffer) == frame_size(4 * 4)
    got = decode(buffer).segments[0].payload
    assert got.dtype == torch.int32 and torch.equal(got, ids)


def test_non_contiguous_payload_is_sent_as_its_values():
    base = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    transposed = base.t()  # [3, 4], not contiguous
    got = decode(encode(DATA, 0, [Segment(1, 0, PREFILL, 0, 3, transposed)])).segments[0].payload
    assert torch.equal(got, transposed)


def test_several_segments_with_a_release_and_server_times():
    hidden16 = torch.tensor([[1.5, -2.25, 3.0]], dtype=torch.float16)  # 6 bytes: later payloads start unaligned
    hidden32 = torch.tensor([[0.1, 0.2], [0.3, 0.4]], dtype=torch.float32)
    segments = [
        Segment(1, 0, PREFILL, 0, 1, hidden16, flags=wire.LAST_CHUNK, queue_s=0.25, compute_s=1.5),
        Segment(2, 1, RELEASE, 17, 0),
        Segment(3, 1, DECODE, 8, 2, hidden32, server_arrival_s=12345.678, server_depart_s=12346.5),
    ]
    buffer = encode(DATA, 2**40 + 3, segments)
    assert len(buffer) == frame_size(6, 0, 16)
    frame = decode(buffer)
    assert frame.iteration == 2**40 + 3
    first, release, third = frame.segments
    assert torch.equal(first.payload, hidden16) and first.last_chunk
    assert (first.queue_s, first.compute_s) == (0.25, 1.5)
    assert release.payload is None and release.phase == RELEASE and not release.last_chunk
    assert (release.request_id, release.device, release.start, release.tokens) == (2, 1, 17, 0)
    assert torch.equal(third.payload, hidden32) and not third.last_chunk
    assert (third.server_arrival_s, third.server_depart_s) == (12345.678, 12346.5)


def test_stop_frame_is_only_the_frame_header():
    buffer = encode(STOP, 5, [])
    assert len(buffer) == 20
    assert decode(buffer) == wire.Frame(STOP, 5, ())


def test_layout_is_little_endian_at_fixed_offsets():
    ids = torch.tensor([[1], [2]], dtype=torch.int32)
    buffer = encode(DATA, 0x0102030405060708, [Segment(0xAABBCCDD11, 0x01020304, DECODE, 300, 2, ids, flags=1)])
    assert bytes(buffer[0:4]) == b"HILW"
    assert buffer[4] == wire.VERSION and buffer[5] == DATA
    assert struct.unpack_from("<H", buffer, 6) == (1,)
    assert bytes(buffer[8:16]) == bytes([8, 7, 6, 5, 4, 3, 2, 1])
    assert struct.unpack_from("<I", buffer, 16) == (0,)  # no padding
    seg = 20
    assert struct.unpack_from("<Q", buffer, seg) == (0xAABBCCDD11,)
    assert bytes(buffer[seg + 8 : seg + 12]) == bytes([4, 3, 2, 1])  # device rank, least significant first
    assert (buffer[seg + 12], buffer[seg + 13], buffer[seg + 14]) == (DECODE, 3, 1)  # phase, int32 code, flags
    assert struct.unpack_from("<IIII", buffer, seg + 16) == (300, 2, 1, 8)  # start, tokens, width, bytes
    assert struct.unpack_from("<ii", buffer, 20 + 64) == (1, 2)  # payload right after the headers


def test_decoded_payload_shares_the_buffer():
    buffer = encode(DATA, 0, [Segment(1, 0, DECODE, 0, 1, torch.tensor([[7]], dtype=torch.int32))])
    payload = decode(buffer).segments[0].payload
    struct.pack_into("<i", buffer, 20 + 64, 99)
    assert payload.item() == 99


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b.__setitem__(slice(0, 4), b"XXXX"), "magic"),
        (lambda b: b.__setitem__(4, wire.VERSION + 1), "version"),
        (lambda b: b.extend(b"\0\0\0"), "3 bytes after its payloads, its header says 0"),
        (lambda b: b.__delitem__(slice(8, None)), "shorter than its header"),
    ],
)
def test_decode_rejects_damaged_frames(mutate, message):
    buffer = encode(DATA, 0, [Segment(1, 0, DECODE, 0, 1, torch.zeros(1, 2))])
    mutate(buffer)
    with pytest.raises(WireError, match=message):
        decode(buffer)


def test_encode_rejects_a_token_count_that_disagrees_with_the_payload():
    with pytest.raises(WireError, match="says 3 tokens, payload has 2"):
        encode(DATA, 0, [Segment(4, 0, PREFILL, 0, 3, torch.zeros(2, 8))])


@pytest.mark.parametrize("payload", [torch.zeros(2, 2, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.int64)])
def test_encode_rejects_unsupported_dtypes(payload):
    with pytest.raises(WireError, match="cannot cross the wire"):
        encode(DATA, 0, [Segment(1, 0, PREFILL, 0, 2, payload)])


def test_encode_rejects_payloads_that_are_not_two_dimensional():
    with pytest.raises(WireError, match=r"\[tokens, width\]"):
        encode(DATA, 0, [Segment(1, 0, DECODE, 0, 3, torch.zeros(3, dtype=torch.int32))])


# --------------------------------------------------------------------------------------------
# state monitor (HAT Eq. 1 and Eq. 2)


@pytest.mark.parametrize(
    "tokens, bucket",
    [(0, 1), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (100, 128), (128, 128), (129, 256), (2**20 + 1, 2**21)],
)
def test_bucket_of_is_the_power_of_two_at_or_above(tokens, bucket):
    assert bucket_of(tokens) == bucket


def test_equations_1_and_2_with_alpha_0_8():
    monitor = StateMonitor()
    assert monitor.alpha == 0.8
    monitor.observe(100, 0.5)
    assert monitor.mu == 100 and monitor.predict_s(100) == pytest.approx(0.5)
    monitor.observe(100, 1.0)
    assert monitor.mu == pytest.approx(100)
    assert monitor.predict_s(100) == pytest.approx(0.8 * 0.5 + 0.2 * 1.0)  # 0.6
    monitor.observe(200, 2.0)  # another bucket (256): mu moves, g(128) does not
    assert monitor.mu == pytest.approx(0.8 * 100 + 0.2 * 200)  # 120
    assert monitor.snapshot() == {
        "mu_tokens": pytest.approx(120),
        "g_128_s": pytest.approx(0.6),
        "g_256_s": pytest.approx(2.0),
    }
    monitor.observe(250, 3.0)
    assert monitor.snapshot()["g_256_s"] == pytest.approx(0.8 * 2.0 + 0.2 * 3.0)  # 2.2
    assert monitor.mu == pytest.approx(0.8 * 120 + 0.2 * 250)  # 146


def test_predict_is_none_before_any_observation():
    monitor = StateMonitor()
    assert monitor.predict_s(10) is None and monitor.mu is None
    assert monitor.snapshot() == {"mu_tokens": 0.0}


def test_predict_interpolates_between_buckets_and_extrapolates_beyond():
    monitor = StateMonitor()
    monitor.observe(4, 1.0)
    monitor.observe(16, 3.0)
    assert monitor.predict_s(1) == pytest.approx(1.0)  # below the smallest bucket: its delay
    assert monitor.predict_s(4) == pytest.approx(1.0)
    assert monitor.predict_s(10) == pytest.approx(1.0 + 2.0 * 6 / 12)  # 2.0
    assert monitor.predict_s(16) == pytest.approx(3.0)
    assert monitor.predict_s(40) == pytest.approx(3.0 + (2.0 / 12) * 24)  # 7.0, the two largest's slope


def test_extrapolation_never_predicts_less_than_the_largest_bucket():
    monitor = StateMonitor()
    monitor.observe(8, 2.0)
    monitor.observe(32, 1.0)  # a noisy, faster large batch
    assert monitor.predict_s(20) == pytest.approx(2.0 - 1.0 * 12 / 24)  # 1.5
    assert monitor.predict_s(1000) == pytest.approx(1.0)


def test_one_bucket_scales_per_token_above_it():
    monitor = StateMonitor()
    monitor.observe(8, 2.0)
    assert monitor.predict_s(3) == pytest.approx(2.0)
    assert monitor.predict_s(24) == pytest.approx(6.0)


@pytest.mark.parametrize("alpha", [-0.01, 1.01])
def test_alpha_outside_the_unit_interval_is_rejected(alpha):
    with pytest.raises(ValueError, match="alpha"):
        StateMonitor(alpha)


def test_alpha_at_the_ends_of_the_interval():
    frozen, latest = StateMonitor(1.0), StateMonitor(0.0)
    for monitor in (frozen, latest):
        monitor.observe(10, 1.0)
        monitor.observe(30, 5.0)
    assert frozen.mu == 10 and frozen.predict_s(16) == pytest.approx(1.0)
    assert latest.mu == 30 and latest.predict_s(32) == pytest.approx(5.0)


# --------------------------------------------------------------------------------------------
# run config and schedules


def config(**changes) -> dict:
    raw = {
        "run_id": "r1",
        "method": "ushape",
        "model": "/models/tiny",
        "partition": {"device_layers": 2, "stages": 2},
        "chunk_tokens": 64,
        "out_dir": "/tmp/out",
        "ranks": [
            {"role": "stage", "node": "server"},
            {"role": "stage", "node": "server", "torch_device": "cuda", "threads": 4},
            {"role": "device", "node": "orin", "schedule": "/s/orin.jsonl"},
            {"role": "device", "node": "nano", "schedule": "/s/nano.jsonl"},
        ],
    }
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None}


def test_parse_a_good_config():
    parsed = run_config.parse(config())
    assert (parsed.method, parsed.device_layers, parsed.stages, parsed.chunk_tokens) == ("ushape", 2, 2, 64)
    assert [(r.role, r.index, r.node) for r in parsed.ranks] == [
        ("stage", 0, "server"),
        ("stage", 1, "server"),
        ("device", 0, "orin"),
        ("device", 1, "nano"),
    ]
    assert parsed.ranks[1].torch_device == "cuda" and parsed.ranks[1].threads == 4
    assert parsed.ranks[0].torch_device == "cpu" and parsed.ranks[3].schedule == "/s/nano.jsonl"
    assert parsed.device_ranks == [2, 3]
    assert parsed.rank_dir(0) == os.path.join("/tmp/out", "stage-0-server")
    assert parsed.rank_dir(1) == os.path.join("/tmp/out", "stage-1-server")
    assert parsed.rank_dir(3) == os.path.join("/tmp/out", "device-1-nano")


def test_server_device_layers_is_zero_only_for_centralized():
    assert run_config.parse(config()).server_device_layers == 2
    assert run_config.parse(config(method="usarathi")).server_device_layers == 2
    centralized = run_config.parse(config(method="centralized"))
    assert centralized.device_layers == 2 and centralized.server_device_layers == 0


def with_ranks(*roles: str) -> list[dict]:
    return [
        {"role": r, "node": f"n{i}", **({"schedule": "s.jsonl"} if r == "device" else {})} for i, r in enumerate(roles)
    ]


@pytest.mark.parametrize(
    "raw, message",
    [
        (config(method=None), "run.json: field 'method' is missing"),
        (config(method="pipeline"), "run.json: field 'method' is 'pipeline'; choose one of centralized"),
        (config(method=3), "run.json: field 'method' must be str"),
        (config(partition={"stages": 3}), "run.json: partition.stages is 3 but 2 stage ranks are listed"),
        (
            config(partition={"stages": 2}, ranks=with_ranks("stage", "device", "stage")),
            r"run.json: ranks\[2\]: server stages come before devices",
        ),
        (
            config(ranks=[{"role": "stage"}, {"role": "stage"}, {"role": "device", "node": "orin"}]),
            r"run.json: ranks\[2\].schedule is missing",
        ),
        (config(ranks=with_ranks("stage", "stage")), "run.json: no device ranks"),
        (config(ranks=with_ranks("stage", "phone")), r"run.json: ranks\[1\].role must be 'stage' or 'device'"),
        (config(chunk_tokens=0), "run.json: field 'chunk_tokens' must be >= 1"),
        (config(model=None), "run.json: field 'model' is missing"),
        (config(partition={"stages": 2, "device_layers": -1}), "run.json: partition.device_layers must be >= 0"),
    ],
)
def test_parse_errors_name_the_source_and_field(raw, message):
    with pytest.raises(RunConfigError, match=message):
        run_config.parse(raw, "run.json")


def test_load_names_the_file_it_cannot_read(tmp_path):
    path = tmp_path / "run.json"
    path.write_text("{not json")
    with pytest.raises(RunConfigError, match=f"{re.escape(str(path))}: cannot read the run config"):
        run_config.load(str(path))
    path.write_text(json.dumps(config()))
    assert run_config.load(str(path)).run_id == "r1"


def write_schedule(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "schedule.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_load_schedule_sorts_by_arrival_then_id(tmp_path):
    path = write_schedule(
        tmp_path,
        '{"request_id": 3, "arrival_s": 2.0, "prompt": "c", "max_new_tokens": 4}',
        "",
        '{"request_id": 2, "arrival_s": 0.5, "prompt_ids": [1, 2, 3]}',
        '{"request_id": 1, "arrival_s": 2.0, "prompt": "a"}',
        '{"request_id": 0, "prompt": "first"}',
    )
    requests = load_schedule(path)
    assert [(r.request_id, r.arrival_s) for r in requests] == [(0, 0.0), (2, 0.5), (1, 2.0), (3, 2.0)]
    assert requests[1].prompt is None and requests[1].prompt_ids == [1, 2, 3]
    assert requests[3].max_new_tokens == 4 and requests[0].max_new_tokens == 32


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", "bad request"),
        ('{"arrival_s": 1, "prompt": "x"}', "bad request"),  # no request_id
        ('{"request_id": 5, "max_new_tokens": 3}', "field 'prompt' or 'prompt_ids' is needed"),
        ('{"request_id": 5, "prompt_ids": []}', "field 'prompt' or 'prompt_ids' is needed"),
        ('{"request_id": 5, "prompt": "x", "max_new_tokens": 0}', "field 'max_new_tokens' must be >= 1"),
    ],
)
def test_load_schedule_errors_name_the_file_and_line(tmp_path, bad_line, message):
    path = write_schedule(tmp_path, '{"request_id": 1, "prompt": "ok"}', "", bad_line)
    with pytest.raises(RunConfigError, match=f"^{re.escape(path)}:3: {message}"):
        load_schedule(path)


# --------------------------------------------------------------------------------------------
# U-shape partition


@pytest.mark.parametrize(
    "layers, m, stages, expected",
    [
        (8, 2, 4, [(2, 3), (4, 5), (6,), (7,)]),  # 6 middle layers over 4 stages: the first two take the extra
        (8, 2, 3, [(2, 3), (4, 5), (6, 7)]),
        (7, 1, 4, [(1, 2), (3, 4), (5,), (6,)]),
        (5, 0, 1, [(0, 1, 2, 3, 4)]),
        (4, 1, 3, [(1,), (2,), (3,)]),
    ],
)
def test_stage_splits_are_even_with_the_remainder_on_earlier_stages(layers, m, stages, expected):
    partition = UShapePartition.make(layers, m, stages)
    assert partition.stage_layer_ids() == expected
    assert partition.device_layer_ids() == tuple(range(m))


def test_describe_names_the_device_and_stage_layers():
    assert UShapePartition.make(8, 2, 2).describe() == (
        "device: embedding, layers 0-1, norm, head; server stages: 2-4, 5-7"
    )


@pytest.mark.parametrize(
    "layers, m, stages, message",
    [(8, -1, 2, "m must be >= 0"), (8, 2, 0, "P >= 1"), (8, 6, 3, "leaves 2 middle layers for P=3"), (4, 5, 1, "-1")],
)
def test_partition_errors(layers, m, stages, message):
    with pytest.raises(PartitionError, match=message):
        UShapePartition.make(layers, m, stages)


# --------------------------------------------------------------------------------------------
# KV cache


def chunk(n: int, start: float, heads: int = 2, dim: int = 3) -> torch.Tensor:
    return torch.arange(start, start + heads * n * dim).reshape(heads, n, dim)


def test_growth_beyond_capacity_keeps_every_layers_contents():
    cache = KVCache([0, 1], num_kv_heads=2, head_dim=3, capacity=2)
    k0, v0 = chunk(2, 0), chunk(2, 100)
    k1, v1 = chunk(2, 200), chunk(2, 300)
    cache.append(0, k0, v0)
    cache.append(1, k1, v1)
    cache.advance(2)
    assert cache.length == 2 and cache.capacity == 2
    k0b, v0b = chunk(3, 400), chunk(3, 500)
    keys, values = cache.append(0, k0b, v0b)  # needs 5: doubles twice
    assert cache.capacity == 8
    assert torch.equal(keys, torch.cat([k0, k0b], dim=1)) and torch.equal(values, torch.cat([v0, v0b], dim=1))
    k1b, v1b = chunk(3, 600), chunk(3, 700)
    keys, values = cache.append(1, k1b, v1b)
    assert torch.equal(keys, torch.cat([k1, k1b], dim=1)) and torch.equal(values, torch.cat([v1, v1b], dim=1))
    cache.advance(3)
    assert cache.length == 5
    assert cache.nbytes() == 2 * 2 * (2 * 8 * 3) * 4  # keys and values of two layers at capacity 8, float32


def test_append_returns_views_up_to_the_new_chunk_and_advance_commits():
    cache = KVCache([3], num_kv_heads=1, head_dim=2, capacity=16)
    keys, _ = cache.append(3, chunk(4, 0, 1, 2), chunk(4, 0, 1, 2))
    assert keys.shape == (1, 4, 2)
    again, _ = cache.append(3, chunk(1, 50, 1, 2), chunk(1, 50, 1, 2))  # not advanced: overwrites position 0
    assert again.shape == (1, 1, 2) and torch.equal(again, chunk(1, 50, 1, 2))
    cache.advance(1)
    keys, _ = cache.append(3, chunk(2, 90, 1, 2), chunk(2, 90, 1, 2))
    assert torch.equal(keys, torch.cat([chunk(1, 50, 1, 2), chunk(2, 90, 1, 2)], dim=1))


def test_truncate_rolls_back_and_later_appends_overwrite():
    cache = KVCache([0], num_kv_heads=1, head_dim=2, capacity=4)
    cache.append(0, chunk(3, 0, 1, 2), chunk(3, 10, 1, 2))
    cache.advance(3)
    cache.truncate(1)
    assert cache.length == 1 and cache.capacity == 4
    keys, values = cache.append(0, chunk(1, 70, 1, 2), chunk(1, 80, 1, 2))
    assert torch.equal(keys, torch.cat([chunk(3, 0, 1, 2)[:, :1], chunk(1, 70, 1, 2)], dim=1))
    assert torch.equal(values, torch.cat([chunk(3, 10, 1, 2)[:, :1], chunk(1, 80, 1, 2)], dim=1))
    cache.truncate(1)  # to the current length: allowed
    cache.truncate(0)
    assert cache.length == 0
    for bad in (-1, 1):
        with pytest.raises(ValueError, match="cannot truncate"):
            cache.truncate(bad)


# --------------------------------------------------------------------------------------------
# the controller's split run: mpiexec plan, environment, schedules, spec checks


def test_mpi_launch_plan_argv_for_a_server_and_one_device():
    server_env = (("FI_TCP_IFACE", "eth1"), ("PYTHONPATH", "/code a"))
    plan = MpiLaunchPlan(
        launch_node="gpu",
        mpiexec="/venv/bin/mpiexec",
        groups=(
            RankGroup("gpu", "192.168.1.2", 2, ("python3", "-m", "nodes.workers", "/w/run.json"), server_env),
            RankGroup("orin", "192.168.1.3", 1, ("python3", "-m", "nodes.workers", "/o/run.json"), (("X", "1"),)),
        ),
        timeout_s=60.0,
    )
    assert plan.hosts_argument() == "192.168.1.2:2,192.168.1.3:1"
    assert plan.argv() == [
        "/venv/bin/mpiexec", "-launcher", "ssh", "-hosts", "192.168.1.2:2,192.168.1.3:1",
        "-n", "2", "-env", "FI_TCP_IFACE", "eth1", "-env", "PYTHONPATH", "/code a",
        "python3", "-m", "nodes.workers", "/w/run.json",
        ":",
        "-n", "1", "-env", "X", "1", "python3", "-m", "nodes.workers", "/o/run.json",
    ]  # fmt: skip
    assert shlex.split(plan.apply_commands()[0]) == plan.argv()
    assert plan.undo_commands() == []


def test_data_plane_env_pins_mpi_to_tcp_on_the_interface():
    assert data_plane_env("veth-d3") == {
        "MPIR_CVAR_NOLOCAL": "1",
        "UCX_TLS": "tcp,self",
        "UCX_NET_DEVICES": "veth-d3",
        "FI_PROVIDER": "tcp",
        "FI_TCP_IFACE": "veth-d3",
    }


def test_data_plane_env_on_loopback_uses_shared_memory():
    # local mode: UCX's TCP transport will not connect two processes over lo, and there is nothing to shape
    env = data_plane_env("lo")
    assert env["UCX_TLS"] == "self,posix,sysv" and "UCX_NET_DEVICES" not in env and "MPIR_CVAR_NOLOCAL" not in env


def test_ranks_on_one_host_talk_with_the_loopback_environment():
    # three real ranks of this machine's MPI, started the way local mode starts them: an allreduce must
    # complete (over loopback TCP, UCX refuses with "Destination is unreachable")
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env_args = [a for k, v in data_plane_env("lo").items() for a in ("-env", k, v)]
    program = "from mpi4py import MPI; c = MPI.COMM_WORLD; total = c.allreduce(c.rank); c.rank or print(total)"
    result = subprocess.run([str(mpiexec), "-n", "3", *env_args, sys.executable, "-c", program],
                            capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["3"]  # 0 + 1 + 2, printed by rank 0


def test_device_schedule_makes_request_ids_unique_per_device():
    schedule = ({"request_id": 5, "prompt": "a"}, {"prompt": "b", "arrival_s": 1.0}, {"request_id": "7", "prompt": "c"})
    spec = SplitRunSpec(method="ushape", model="/m", server="gpu", devices=("orin", "nano"), schedule=schedule)
    first, second = device_schedule(spec, 0), device_schedule(spec, 2)
    assert [r["request_id"] for r in first] == [5, 1, 7]  # a missing id is the request's position
    assert [r["request_id"] for r in second] == [2_000_005, 2_000_001, 2_000_007]
    assert second[1] == {"request_id": 2_000_001, "prompt": "b", "arrival_s": 1.0}
    assert spec.schedule[0] == {"request_id": 5, "prompt": "a"}  # the spec's schedule is left alone


INVENTORY = """\
nodes:
  - name: gpu
    kind: server
    model: a6000-server
    address: 192.168.1.2
    data: {interface: eth1, address: 10.0.0.2}
  - name: orin
    kind: jetson
    model: agx-orin
    address: 192.168.1.3
    data: {interface: eth1, address: 10.0.0.3}
  - name: nodata
    kind: jetson
    model: agx-orin
    address: 192.168.1.4
  - name: phone
    kind: android
    model: pixel-7-pro
    adb: {serial: 28011FDH2000AB, usb_host: gpu}
"""


@pytest.fixture
def inventory(tmp_path: Path) -> Inventory:
    path = tmp_path / "inventory.yaml"
    path.write_text(textwrap.dedent(INVENTORY))
    return load_inventory(path)


def spec(**changes) -> SplitRunSpec:
    fields = {"method": "ushape", "model": "/m", "server": "gpu", "devices": ("orin",), "schedule": ({"prompt": "x"},)}
    return SplitRunSpec(**{**fields, **changes})


def test_check_spec_accepts_a_good_run(inventory):
    server, devices = check_spec(inventory, spec())
    assert server.name == "gpu" and [d.name for d in devices] == ["orin"]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"method": "pipeline"}, "method 'pipeline': choose one of centralized, ushape, usarathi"),
        ({"schedule": ()}, "the schedule is empty"),
        ({"devices": ()}, "at least one device"),
        ({"devices": ("nodata",)}, "node 'nodata' has no 'data:' interface"),
        ({"devices": ("phone",)}, r"phone \(kind android\) runs no MPI ranks"),
        ({"server": "typo"}, "no node named 'typo'"),
        ({"devices": ("orin", "nano-typo")}, "no node named 'nano-typo'"),
        ({"stages": 0}, "stages must be >= 1"),
        ({"device_layers": -1}, "device_layers >= 0"),
    ],
)
def test_check_spec_rejects_what_cannot_run(inventory, changes, message):
    with pytest.raises(TestbedError, match=message):
        check_spec(inventory, spec(**changes))


def _one_segment_frame() -> bytearray:
    return encode(DATA, 1, [Segment(5, 2, PREFILL, 0, 1, torch.ones(1, 2))])


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: struct.pack_into("<H", b, 6, 2),  # two segments announced, one present
        lambda b: b.__delitem__(slice(len(b) - 4, None)),  # payload cut short
        lambda b: struct.pack_into("<B", b, 20 + 13, 9),  # unknown dtype code
        lambda b: struct.pack_into("<I", b, 20 + 24, 3),  # width that disagrees with the byte count
        lambda b: struct.pack_into("<I", b, 16, 5),  # padding the frame does not have
    ],
)
def test_decode_names_every_inconsistent_frame_a_wire_error(damage):
    frame = _one_segment_frame()
    damage(frame)
    with pytest.raises(WireError):
        decode(frame)


def test_encode_rejects_a_request_id_that_does_not_fit_the_header():
    with pytest.raises(WireError, match="does not fit"):
        encode(DATA, 0, [Segment(-1, 0, RELEASE, 0, 0)])


def test_malformed_run_config_values_are_run_config_errors():
    raw = {"method": "ushape", "model": "/m", "out_dir": "/o", "partition": {"stages": "two"}, "ranks": []}
    with pytest.raises(RunConfigError, match=r"run\.json: malformed"):
        run_config.parse(raw, "run.json")
