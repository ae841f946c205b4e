"""The LLM service as apps see it: a real daemon process on a Unix socket, apps as separate client
processes (the CLI) and the client library; LLMS's API, its limits, a client gone mid-stream, and a
SIGKILLed daemon that restarts with every context that was written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nodes.context_service.client import ContextClient, ServiceRefused

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "models" / "tiny"


def _start(tmp_path: Path, *extra: str, model: Path = TINY, budget_mib: str = "0.3") -> tuple[subprocess.Popen, str]:
    sock = str(tmp_path / "llms.sock")
    process = subprocess.Popen([sys.executable, "-m", "nodes.context_service", "--model", str(model), "--socket", sock,
                                "--state-dir", str(tmp_path / "state"), "--budget-mib", budget_mib,
                                "--contexts-per-app", "2", "--context-tokens", "400", *extra],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    ready = json.loads(process.stdout.readline() or "{}")
    assert ready.get("serving") == sock, process.stderr.read()
    return process, sock


def _cli(sock: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nodes.context_service.client", "--socket", sock, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip


@pytest.fixture
def daemon(tmp_path: Path):
    process, sock = _start(tmp_path)
    yield process, sock
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert "Traceback" not in process.stderr.read()  # (a client that left mid-stream included)


def test_apps_in_their_own_processes_make_call_and_delete_contexts(daemon) -> None:
    _, sock = daemon
    mail = _cli(sock, "new", "--app", "mail", "--system-prompt", "You answer mail.")
    chat = _cli(sock, "new", "--app", "chat")
    assert mail.returncode == 0 and chat.returncode == 0, mail.stderr + chat.stderr
    mail_ctx, chat_ctx = mail.stdout.strip(), chat.stdout.strip()
    first = _cli(sock, "call", mail_ctx, "Dear Ann, the meeting", "--max-tokens", "8")
    assert first.returncode == 0 and first.stdout.strip(), first.stderr
    assert json.loads(first.stderr.splitlines()[-1])["context"] == mail_ctx  # the call's switching record
    client = ContextClient(sock)
    listed = {c["ctx"]: c for c in client.contexts()}
    assert listed[mail_ctx]["app"] == "mail" and listed[mail_ctx]["tokens"] > 8 and listed[chat_ctx]["tokens"] == 0
    again = client.call(mail_ctx, " and then", 4)
    assert again["context_tokens"] == listed[mail_ctx]["tokens"] + again["prompt_tokens"] + len(again["output_ids"])
    # the same context, the same text: greedy output is reproducible from the same state
    assert client.call(chat_ctx, "Dear Ann, the meeting", 8)["output_ids"] == client.call(
        client.new_context("chat"), "Dear Ann, the meeting", 8)["output_ids"]
    assert _cli(sock, "delete", chat_ctx).returncode == 0
    assert chat_ctx not in {c["ctx"] for c in client.contexts()}


def test_bad_requests_get_clear_errors_and_leave_the_other_contexts_alone(daemon) -> None:
    _, sock = daemon
    client = ContextClient(sock)
    kept = client.new_context("notes")
    client.call(kept, "A list of things to buy:", 6)
    before = {c["ctx"]: c["tokens"] for c in client.contexts()}
    unknown = _cli(sock, "call", "nosuchctx", "hello")
    assert unknown.returncode == 2 and "unknown_context" in unknown.stderr
    with pytest.raises(ServiceRefused, match="over the limit of 400") as refused:
        client.call(kept, "word " * 500, 4)
    assert refused.value.field == "prompt"
    client.new_context("notes")
    with pytest.raises(ServiceRefused, match="the most an app may"):
        client.new_context("notes")  # a third context of one app (limit 2)
    # a client that goes away mid-stream: its call is rolled back, nothing else changes
    stream = client.call_stream(kept, "Then, after that, we", 350)  # (near the limit: the call outlasts the close)
    assert "token_id" in next(stream)
    stream.close()
    record = client.call(kept, " eggs", 3)  # the context takes calls again, after the abandoned one (its turn)
    assert record["context_tokens"] == before[kept] + record["prompt_tokens"] + len(record["output_ids"])
    after = {c["ctx"]: c["tokens"] for c in client.contexts()}
    assert after[kept] == record["context_tokens"]


def test_a_killed_daemon_restarts_with_every_written_context_and_loads_their_chunks(tmp_path: Path) -> None:
    process, sock = _start(tmp_path)
    client = ContextClient(sock)
    contexts = [client.new_context(f"app{i}") for i in range(3)]
    for i, ctx in enumerate(contexts):
        client.call(ctx, f"Story {i}: once upon a time there was", 12)
    before = {c["ctx"]: c["tokens"] for c in client.contexts()}
    stats = client.stats()
    assert stats["aot_bytes_written"] > 0 and stats["faults"] == 0
    assert stats["recompute_overruns"] == 0  # unpaced: no target time to overrun
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    process, sock = _start(tmp_path)
    try:
        client = ContextClient(sock)
        assert {c["ctx"]: c["tokens"] for c in client.contexts()} == before
        record = client.call(contexts[0], " The end.", 4)
        assert record["switch"]["missing_chunks"] > 0 and record["switch"]["faults"] == 0
        assert record["switch"]["bytes_written"] == 0  # nothing to write at switch time
        assert client.stats()["store"]["bytes_read"] + record["switch"]["recomputed_chunks"] > 0
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert not Path(sock).exists()


def test_an_app_with_token_ids_calls_teacher_forced_and_bad_ids_are_refused(daemon) -> None:
    _, sock = daemon
    client = ContextClient(sock)
    ctx = client.new_context("trace")
    first = client.call_ids(ctx, [100, 101, 102, 103], [104, 105])
    assert first["output_ids"] == [104, 105] and first["prompt_tokens"] == 5  # the BOS the context begins with
    second = client.call_ids(ctx, [106], [])
    assert second["prompt_tokens"] == 1 and second["context_tokens"] == 8  # no BOS in the middle of a context
    for bad in ([-1], [10**9], ["a"]):
        with pytest.raises(ServiceRefused) as refused:
            client.call_ids(ctx, bad, [])
        assert refused.value.field == "prompt_ids"
    assert {c["ctx"]: c["tokens"] for c in client.contexts()}[ctx] == 8  # refused calls changed nothing
    stats = _cli(sock, "stats")
    assert stats.returncode == 0 and json.loads(stats.stdout)["memory_method"] == "llms"


def test_a_baseline_runs_in_the_same_daemon_and_max_seconds_ends_it(tmp_path: Path) -> None:
    process, sock = _start(tmp_path, "--memory", "lmk", "--max-seconds", "20")
    try:
        stats = ContextClient(sock).stats()
        assert stats["memory_method"] == "lmk" and stats["settings"]["keep_on_reclaim"] is False
        assert stats["settings"]["unit"] == "context" and stats["settings"]["compression"] is False
        assert process.wait(timeout=60) == 0  # ended by itself: a daemon whose controller died does not linger
        assert not os.path.exists(sock)
    finally:
        if process.poll() is None:
            process.kill()


def test_the_service_keeps_smollm2_contexts_through_compression_and_swapping(tmp_path: Path) -> None:
    """LLMS's service on the pretrained model: three contexts in a budget that holds about one, so
    switching moves chunks out and back in (read or recomputed); each context still answers from
    its own history, in readable text."""
    from testbed.models.packaged import PACKAGED, up_to_date

    packaged = PACKAGED["smollm2-135m"]
    assert up_to_date(packaged), f"SmolLM2-135M is not imported; fetch it: {packaged.fetch_command}"
    process, sock = _start(tmp_path, model=packaged.directory, budget_mib="0.8")
    try:
        client = ContextClient(sock)
        facts = {"paris": "The capital of France is Paris. The capital of Italy is Rome. The capital of France is",
                 "water": "Water freezes at zero degrees Celsius and boils at one hundred. Water boils at",
                 "cats": "Cats are small furry animals that purr and chase mice. A small furry animal that purrs is a"}
        contexts = {name: client.new_context(name) for name in facts}
        first = {name: client.call(ctx, facts[name] + " " + facts[name], 6) for name, ctx in contexts.items()}
        again = {name: client.call(ctx, " So, once more:", 6) for name, ctx in contexts.items()}
        stats = client.stats()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    assert "Traceback" not in process.stderr.read()
    assert "Paris" in first["paris"]["text"]  # readable text from the model's own context
    came_back = sum(r["switch"]["read_chunks"] + r["switch"]["recomputed_chunks"] for r in again.values())
    assert stats["store"]["writes"] > 0 and came_back > 0 and stats["faults"] == 0  # contexts left memory, came back
    for name in facts:  # each call continued its own context
        assert again[name]["context_tokens"] > first[name]["context_tokens"]
