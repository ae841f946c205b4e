"""The serving engine behind the OpenAI-compatible API (DiSCo's server endpoint on our engine): many
clients at once through the official ``openai`` client, token-exact under preemption in a small KV
budget, and a client that goes away is dropped from the engine."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from nodes.contracts.run_config import parse
from nodes.endpoints.openai_api import Endpoint, make_server
from nodes.endpoints.pace import EnginePace
from nodes.inference.checkpoint import load_whole
from nodes.inference.generate import greedy_generate
from nodes.inference.tokenizer import Tokenizer
from nodes.workers.engines.engine_endpoint import EngineEndpoint
from tests.conftest import json_log_rows
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "examples" / "models" / "tiny")


@pytest.fixture()
def engine_api(tmp_path):
    config = parse({
        "method": "disco", "model": TINY, "out_dir": str(tmp_path / "out"), "partition": {"stages": 1},
        "ranks": [{"role": "stage", "node": "server"}, {"role": "device", "node": "d", "schedule": "/unused"}],
        "serving": {"scheduler": "fcfs", "capacity_tokens": 160, "swap_tokens": 0, "max_batch": 8},
        "dispatch": {"server_endpoint": "engine"},
    })  # fmt: skip
    engine = EngineEndpoint(config, None, 0)
    engine.start(time.monotonic())
    loop = threading.Thread(target=engine.serve, daemon=True)
    loop.start()
    endpoint = Endpoint(engine.streams, EnginePace("fcfs", False), "tiny", str(tmp_path / "api.jsonl"))
    server, port = make_server(endpoint, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{port}/v1", engine, tmp_path
    server.shutdown()
    endpoint.close()
    engine.stop()
    loop.join(timeout=30)
    assert not loop.is_alive()


def test_many_clients_stream_from_the_engine_token_exact_under_preemption(engine_api):
    url, _engine, directory = engine_api
    tokenizer, model = Tokenizer(TINY), load_whole(TINY)
    prompts = [f"def function_{i}(x, y):\n    return" for i in range(8)]
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)

    def ask(prompt: str) -> tuple[str, int]:
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, stream=True,
                                                stream_options={"include_usage": True}))  # fmt: skip
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, prompts))
    for prompt, (text, count) in zip(prompts, answers, strict=True):
        reference = greedy_generate(model, tokenizer.encode(prompt), 24, tokenizer.eos_id)
        assert text == tokenizer.decode(reference) and count == len(reference)
    path = next((directory / "out").rglob("engine_requests.jsonl"))
    # it hands a request its last token, then logs it
    wait_until(lambda: len(json_log_rows(path)) >= 8, "the engine's 8 log lines")
    rows = json_log_rows(path)
    assert len(rows) == 8
    assert sum(row["preemptions"] for row in rows) > 0  # 8 requests of ~40 tokens in a 160-token cache


def test_a_client_that_goes_away_is_dropped_from_the_engine(engine_api):
    url, engine, directory = engine_api
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    stream = client.completions.create(model="tiny", prompt="class A:", max_tokens=100, stream=True)
    next(iter(stream))
    stream.close()
    (path,) = (directory / "out").rglob("engine_requests.jsonl")
    # the engine drops the request, then logs it: wait for both (bounded: fails only on a hang)
    wait_until(lambda: not engine.state.live and json_log_rows(path), "the engine to drop and log the request")
    rows = json_log_rows(path)
    assert rows[-1]["finished_by"] == "cancelled" and rows[-1]["output_tokens"] < 100
