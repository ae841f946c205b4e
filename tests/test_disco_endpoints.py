"""DiSCo's endpoints over real HTTP: the OpenAI-compatible API checked with the official ``openai``
client, cancellation seen by the endpoint, and the live dispatcher's race and token-id migration,
whose output must equal greedy generation of the same checkpoint token for token."""

from __future__ import annotations

import itertools
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import openai
import pytest

from nodes.contracts.paced_steps import late_tolerance_s
from nodes.dispatch.controller import MigrationRule
from nodes.dispatch.live import EndpointAddress, dispatch_request
from nodes.dispatch.policy import ServerTtft, TokenCosts
from nodes.endpoints.device_speed import DeviceSpeed, LinearTtft
from nodes.endpoints.generator import PacedGenerator
from nodes.endpoints.openai_api import Endpoint, make_server
from nodes.endpoints.pace import DevicePace, Pace
from nodes.inference.generate import greedy_generate
from tests.conftest import json_log_rows
from tests.waiting import HANG_S, wait_until

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "examples" / "models" / "tiny")
R_C = 4.8


class SteadyPace(Pace):
    """A server that answers after ``ttft_s`` and streams one token every ``gap_s``."""

    def __init__(self, ttft_s: float, gap_s: float) -> None:
        self.ttft_s, self.gap, self.label = ttft_s, gap_s, "steady"

    def first_token_s(self, prompt_tokens: int) -> float:
        return self.ttft_s

    def gap_s(self) -> float:
        return self.gap


@pytest.fixture(scope="module")
def generator() -> PacedGenerator:
    return PacedGenerator(TINY)


def serve(generator: PacedGenerator, pace: Pace, log: Path, key: str | None = None):
    endpoint = Endpoint(generator, pace, "tiny", str(log), api_key=key)
    server, port = make_server(endpoint, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, endpoint, f"http://127.0.0.1:{port}/v1"


def test_the_openai_client_streams_completions_and_chat_with_usage(generator, tmp_path):
    server, endpoint, url = serve(generator, SteadyPace(0.05, 0.01), tmp_path / "api.jsonl")
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        prompt = "def add(a, b):"
        reference = greedy_generate(generator.model, generator.encode(prompt), 12, generator.tokenizer.eos_id)
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, stream=True,
                                                stream_options={"include_usage": True}))  # fmt: skip
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == generator.decode(reference)
        assert chunks[-1].usage.completion_tokens == len(reference)
        assert chunks[-1].usage.prompt_tokens == len(generator.encode(prompt))
        by_ids = client.completions.create(model="tiny", prompt=generator.encode(prompt), max_tokens=12)
        assert by_ids.choices[0].text == text  # a prompt given as token ids is the same prompt
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5)  # fmt: skip
        assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
        deltas = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=5, stream=True))  # fmt: skip
        assert deltas[0].choices[0].delta.role == "assistant"
        assert "".join(d.choices[0].delta.content or "" for d in deltas) == chat.choices[0].message.content
        assert [m.id for m in client.models.list()] == ["tiny"]
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt=[10**9], max_tokens=3)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="x", max_tokens=3, n=2)
    finally:
        server.shutdown()
        endpoint.close()
    rows = json_log_rows(tmp_path / "api.jsonl")
    assert len(rows) == 4 and all(row["modeled"] and not row["cancelled"] for row in rows)
    first = rows[0]
    assert first["first_token_s"] - first["taken_s"] >= 0.05  # paced: the first token after its TTFT


def test_each_token_is_a_paced_step_the_fidelity_monitor_counts(generator, tmp_path):
    # a pace the host keeps (50 ms first token, 20 ms a token) and one it cannot (every token due at once)
    from analysis.fidelity import violation_shares
    from testbed.campaign.results import read_steps

    prompt = generator.encode("def add(a, b):")
    produced = {}
    for node, pace in (("phone1", SteadyPace(0.05, 0.02)), ("phone2", SteadyPace(0.0, 0.0))):
        rank = tmp_path / "ranks" / f"device-0-{node}"
        endpoint = Endpoint(generator, pace, "tiny", str(rank / "endpoint_requests.jsonl"),
                            steps_path=str(rank / "steps.csv"))  # fmt: skip
        server, port = make_server(endpoint, "127.0.0.1", 0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            answers = [client.completions.create(model="tiny", prompt=prompt, max_tokens=6) for _ in range(2)]
            produced[node] = sum(a.usage.completion_tokens for a in answers)
        finally:
            server.shutdown()
            endpoint.close()
    steps = read_steps(tmp_path / "ranks")
    kept, missed = steps[steps.node == "phone1"], steps[steps.node == "phone2"]
    assert len(kept) == produced["phone1"] and len(missed) == produced["phone2"]  # a step per token, both requests
    assert produced["phone1"] == produced["phone2"] > 2  # greedy: the same tokens whatever the pace
    first = kept[kept.op == "endpoint_prefill"]
    assert len(first) == 2 and set(first.tokens) == {len(prompt)} and set(first.target_s) == {0.05}
    decode = kept[kept.op == "endpoint_token"]
    assert set(decode.tokens) == {1} and set(decode.target_s) == {0.02}
    n = produced["phone1"] // 2
    assert decode.context_tokens.iloc[: n - 1].tolist() == [len(prompt) + i for i in range(1, n)]
    assert (first.real_s > 0).all() and (decode.real_s >= 0).all() and (kept.layers == 0).all()
    assert ((kept.real_s > kept.target_s) <= kept.overrun.astype(bool)).all()  # late computing is an overrun
    # due at once: every token's computation ends after its due time, and the monitor counts each
    assert missed.overrun.all() and (missed.real_s > missed.target_s).all()
    shares = violation_shares(steps.assign(run_id="r")).set_index("node")
    assert shares.loc["phone2", "violation_share"] == 1.0 and shares.loc["phone2", "flagged"]
    assert shares.loc["phone2", "computed_over"] == produced["phone2"]


def test_a_token_computed_late_delays_the_next_rather_than_bursting(generator):
    # the first token due at once (no host computes a prefill in no time), the rest 50 ms apart
    emitted = list(generator.stream(generator.encode("def add(a, b):"), 4, SteadyPace(0.0, 0.05), stop_at_eos=False))
    assert emitted[0].overran and emitted[0].real_s > emitted[0].target_s == 0.0
    assert emitted[1].began_s == emitted[0].released_s  # its slot starts at the late token's release
    assert emitted[1].released_s - emitted[0].released_s >= 0.05  # a whole gap after it, not less
    # on time, the next slot starts at its due time (no sleep's lateness carried over); late, at its release
    assert emitted[2].began_s == (emitted[1].released_s if emitted[1].overran else emitted[1].began_s + 0.05)


def test_the_next_token_computes_while_the_pace_holds_the_one_before(generator):
    # 100 ms gaps: each next token was handed in as soon as the one before was computed, so it is ready
    # before its slot begins and no real time falls in its slot; the pace alone decides its release (a
    # tiny model's pass takes a few ms: the gap leaves room for a loaded host's stalls)
    emitted = list(generator.stream(generator.encode("def add(a, b):"), 6, SteadyPace(0.1, 0.1), stop_at_eos=False))
    # computed within its slot, every one (a release a few ms late is the loaded host's wake-up, not this)
    assert all(e.real_s <= e.target_s for e in emitted), emitted
    assert sum(e.real_s == 0.0 for e in emitted[1:]) >= 3  # ready ahead (a scheduling hiccup may spare one or two)
    gaps = [b.released_s - a.released_s for a, b in itertools.pairwise(emitted)]
    # never shorter than the pace, but for a release late within the tolerance (the next slot then starts at
    # the late one's due time, not at its release: a wake-up's lateness is not carried over)
    assert min(gaps) >= 0.1 - late_tolerance_s(0.1) - 1e-6, emitted


def test_streams_at_once_share_forward_passes_and_keep_greedy_tokens():
    """Four streams on one endpoint model: the passes that ran while others waited computed several
    streams at once (fewer passes than steps), and each stream's tokens are still greedy generation's."""
    generator = PacedGenerator(TINY)  # its own batcher, so the counts are this test's
    prompts = [generator.encode(text) for text in ("def add(a, b):", "import os\n", "class Point:", "# sum a list")]
    start = threading.Barrier(len(prompts))
    streamed: dict[int, list[int]] = {}

    def run(i: int) -> None:
        start.wait(timeout=HANG_S)
        streamed[i] = [e.token_id for e in generator.stream(prompts[i], 24, SteadyPace(0.0, 0.0), stop_at_eos=False)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_S)
    assert sorted(streamed) == [0, 1, 2, 3]
    batcher = generator.batcher
    assert batcher.steps == 4 * 24  # a prefill and 23 next tokens a stream
    assert batcher.passes < batcher.steps
    for i, prompt in enumerate(prompts):
        assert streamed[i] == greedy_generate(generator.model, prompt, 24, None), i


def test_a_key_is_required_when_the_endpoint_has_one(generator, tmp_path):
    server, endpoint, url = serve(generator, SteadyPace(0.0, 0.0), tmp_path / "api.jsonl", key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).completions.create(
                model="tiny", prompt="x", max_tokens=2)  # fmt: skip
        ok = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0).completions.create(
            model="tiny", prompt="x", max_tokens=2)  # fmt: skip
        assert ok.usage.completion_tokens == 2
    finally:
        server.shutdown()
        endpoint.close()


def test_a_client_that_goes_away_cancels_its_request(generator, tmp_path):
    server, endpoint, url = serve(generator, SteadyPace(0.0, 0.05), tmp_path / "api.jsonl")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    max_tokens = 400  # 20 s of paced tokens: the client leaves after the first
    try:
        body = json.dumps({"prompt": "def f(x):", "max_tokens": max_tokens, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            received = b""
            for _ in range(50):  # the headers, then the first events
                received += sock.recv(4096)
                if b"data:" in received:
                    break
            assert b"data:" in received
        wait_until(lambda: endpoint.served >= 1, "the endpoint to see its client gone")
    finally:
        server.shutdown()
        endpoint.close()
    (row,) = json_log_rows(tmp_path / "api.jsonl")
    assert row["cancelled"] and row["finish_reason"] is None and 1 <= row["completion_tokens"] < max_tokens


FAST_PHONE = DeviceSpeed("fast-phone", prefill_tok_s=200.0, decode_tok_s=50.0, model="bloom-1.1b")


def endpoints_pair(generator, tmp_path, server_pace: Pace, device_pace: Pace):
    server, server_endpoint, server_url = serve(generator, server_pace, tmp_path / "server.jsonl")
    device, device_endpoint, device_url = serve(generator, device_pace, tmp_path / "device.jsonl")
    addresses = {"server": EndpointAddress(server_url, "tiny"), "device": EndpointAddress(device_url, "tiny")}

    def stop() -> None:
        for http, endpoint in ((server, server_endpoint), (device, device_endpoint)):
            http.shutdown()
            endpoint.close()

    return addresses, stop


def test_the_race_keeps_the_first_token_and_cancels_the_loser(generator, tmp_path):
    server_ttft_s = 60.0  # the device's 0.03 s prefill wins however busy this machine is
    addresses, stop = endpoints_pair(generator, tmp_path, SteadyPace(server_ttft_s, 0.01), DevicePace(FAST_PHONE))
    prompt = generator.encode("def fibonacci(n):")
    fit = LinearTtft(1 / FAST_PHONE.prefill_tok_s, 0.0, 1.0, 10)
    try:
        record = dispatch_request(1, prompt, 20, 0.0, 0.0, addresses, R_C, fit)
    finally:
        stop()
    assert record["winner"] == "device" and record["failure"] is None
    assert record["ttft_s"] < server_ttft_s  # the device's first token, not the server's
    assert record["token_ids"] == greedy_generate(generator.model, prompt, 20, generator.tokenizer.eos_id)
    (server_row,) = json_log_rows(tmp_path / "server.jsonl")
    assert server_row["cancelled"] and server_row["completion_tokens"] == 0
    assert record["race_server_input_tokens"] == len(prompt)  # billed although cancelled


@pytest.mark.parametrize("direction", ["server-to-device", "device-to-server"])
def test_a_migrated_stream_is_token_identical_to_greedy_generation(generator, tmp_path, direction):
    slow = SteadyPace(0.05, 0.1)  # 10 tokens/s, just above the reader
    if direction == "server-to-device":  # the server is dear: the fast phone takes over
        server_pace, device_pace, route = slow, DevicePace(FAST_PHONE), (0.0, float("inf"))
        costs = TokenCosts(server_prefill=1.0, server_decode=4.0, device_prefill=1.0, device_decode=1.0)
    else:  # the phone is dear: a fast server takes over
        server_pace, device_pace, route = SteadyPace(0.1, 0.01), DevicePace(FAST_PHONE), (float("inf"), 0.0)
        costs = TokenCosts(server_prefill=1.0, server_decode=1.0, device_prefill=4.0, device_decode=4.0)
    addresses, stop = endpoints_pair(generator, tmp_path, server_pace, device_pace)
    fit = LinearTtft(1 / FAST_PHONE.prefill_tok_s, 0.0, 1.0, 10)
    rule = MigrationRule.from_calibration(costs, R_C, fit, ServerTtft.from_samples([0.1]), [60] * 10)
    prompt = generator.encode("class Stack:\n    def push(self, item):")
    try:
        record = dispatch_request(7, prompt, 40, *route, addresses, R_C, fit, rule)
    finally:
        stop()
    reference = greedy_generate(generator.model, prompt, 40, generator.tokenizer.eos_id)
    assert record["failure"] is None and record["migrated"], record
    assert record["token_ids"] == reference
    assert record["migration_mismatches"] == 0
    assert 0 < record["handoff_tokens"] < len(reference)
    assert record["migration_input_tokens"] == len(prompt) + record["held_tokens"] + (
        record["migration_input_tokens"] - len(prompt) - record["held_tokens"])  # prompt + the ids so far
    assert record["migration_input_tokens"] > len(prompt)
    source = "server" if direction == "server-to-device" else "device"
    rows = json_log_rows(tmp_path / f"{source}.jsonl")
    assert any(row["cancelled"] for row in rows)  # the source was stopped once the target was ready
    # no stall at the handoff: no gap far beyond this run's typical one (or the source's pace), a ratio
    # that holds on a slow machine as on a fast one
    gaps = np.diff(np.array(record["arrivals_s"]))
    assert gaps.max() <= 10 * max(float(np.median(gaps)), slow.gap), gaps


def test_the_endpoint_command_serves_until_terminated(tmp_path):
    port_file = tmp_path / "port"
    process = subprocess.Popen([sys.executable, "-m", "nodes.endpoints", "--model", TINY, "--pace", "device",
                                "--device-speed", "xiaomi14-qwen-0.5b", "--port-file", str(port_file),
                                "--log", str(tmp_path / "device.jsonl")], cwd=REPO, stdout=subprocess.PIPE)  # fmt: skip
    try:
        wait_until(lambda: port_file.exists() and port_file.read_text().strip(), "the endpoint's port file",
                   interval_s=0.1)  # fmt: skip
        url = f"http://127.0.0.1:{int(port_file.read_text())}/v1"
        reply = openai.OpenAI(base_url=url, api_key="x", max_retries=0).completions.create(
            model="tiny", prompt="def f():", max_tokens=3)  # fmt: skip
        assert reply.usage.completion_tokens == 3
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0
    (row,) = json_log_rows(tmp_path / "device.jsonl")
    assert row["pace"] == "device:xiaomi14-qwen-0.5b" and row["modeled"]
    bad = subprocess.run([sys.executable, "-m", "nodes.endpoints", "--model", TINY, "--pace", "trace",
                          "--service", "nope"], cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "unknown service trace" in bad.stderr


def test_a_device_endpoint_serving_smollm2_answers_the_openai_client_in_its_chat_template(tmp_path):
    """DiSCo's device endpoint on the pretrained model: the chat route renders SmolLM2's own template
    (ChatML with its default system prompt), so the answer is readable text, equal to greedy
    generation of that rendered prompt; the tiny model keeps its plain role lines."""
    from nodes.contracts.chat_template import ChatTemplate
    from testbed.models.packaged import PACKAGED, up_to_date

    model = PACKAGED["smollm2-135m"]
    assert up_to_date(model), f"SmolLM2-135M is not imported; fetch it: {model.fetch_command}"
    generator = PacedGenerator(str(model.directory))
    server, endpoint, url = serve(generator, SteadyPace(0.01, 0.001), tmp_path / "api.jsonl")
    question = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        chat = client.chat.completions.create(model="smollm2", messages=question, max_tokens=24)
        rendered = ChatTemplate(generator.tokenizer.chat_template).render(question)
        assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
        ids = generator.encode(rendered)
        reference = greedy_generate(generator.model, ids, 24, generator.tokenizer.eos_id)
        assert chat.choices[0].message.content == generator.decode(reference)
        assert chat.usage.prompt_tokens == len(ids) and "Paris" in chat.choices[0].message.content
        with pytest.raises(openai.BadRequestError):  # a role the API does not serve
            client.chat.completions.create(model="smollm2", messages=[{"role": "tool", "content": "x"}], max_tokens=2)
    finally:
        server.shutdown()
        endpoint.close()
