"""`testbed provision` end to end on the emulated testbed, over real SSH: per-node venvs in each
node's own home, the node wheel installed with its kind's extras (from a wheelhouse: emulated nodes
have no route to a registry), records, weights cut per role, idempotence, repair of a damaged weight
file, resumed transfers, one node's failure leaving the others alone, and split inference running
from the provisioned venvs and parts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.emulation.resolved import load_lab
from testbed.provisioning.node_wheel import node_wheel
from testbed.provisioning.weights import ModelSource, file_sha256, read_safetensors_header
from testbed.transport import open_transport
from tests.conftest import REPO, emulated_inventory, emulated_lab, run_cli

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root"),
    pytest.mark.slow,
    pytest.mark.root,
]

PREFIX = "tv"
TINY = Path(__file__).resolve().parent.parent / "examples" / "models" / "tiny"
SCHEDULE = TINY.parent.parent / "schedules" / "tiny-python.jsonl"
DEVICES = ("orin", "xavier", "orin-nx")
NODES = ("server", *DEVICES)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("provision")
    path = emulated_inventory(directory, PREFIX, 210)
    with emulated_lab(path):
        yield path


def home(lab: Path, node: str) -> Path:
    return lab.parent / "state" / "nodes" / node / "home"


def provision(lab: Path, *extra: str) -> tuple[int, dict]:
    result = run_cli("provision", "-i", str(lab), "--model", str(TINY), "--partition", "m=2,P=2", "--json", *extra)
    try:
        payload = json.loads(result.stdout)
    except ValueError:
        raise AssertionError(result.stdout + result.stderr) from None
    return result.returncode, {n["node"]: n for n in payload["nodes"]} | {"_across": payload["problems_across_nodes"]}


def test_bad_input_exits_2_and_touches_no_node(lab: Path) -> None:
    for args, words in (
        (["--model", str(TINY), "--partition", "m=2"], "needs both m and P"),
        (["--model", str(TINY), "--partition", "m=8,P=1"], "--partition"),
        (["--model", str(lab.parent / "nowhere"), "--partition", "m=2,P=2"], "no config.json"),
        (["--partition", "m=2,P=2"], "--partition needs --model"),
        (["--nodes", "nonesuch"], "no node or group named 'nonesuch'"),
    ):
        result = run_cli("provision", "-i", str(lab), *args)
        assert result.returncode == 2 and words in result.stderr, (args, result.stderr)
    for node in NODES:
        assert not (home(lab, node) / "hil-testbed" / "venv").exists()
    assert not (lab.parent / "state" / "provisioned").exists()


def test_provision_installs_records_and_places_only_each_roles_tensors(lab: Path) -> None:
    status, nodes = provision(lab)
    assert status == 0, nodes
    assert nodes["_across"] == []
    wheel = node_wheel()
    source = ModelSource.open(TINY)
    full_size = sum(p.stat().st_size for p in TINY.glob("*.safetensors"))
    for name in NODES:
        outcome = nodes[name]
        assert outcome["error"] is None and outcome["problems"] == [], outcome
        changes = "\n".join(outcome["changes"])
        assert "made the venv" in changes and f"installed {wheel.filename}" in changes
        record = json.loads((lab.parent / "state" / "provisioned" / f"{name}.json").read_text())
        assert record["wheel"]["sha256"] == wheel.sha256 and record["installed_wheel"] == wheel.version
        installed = record["installed"]
        assert installed["packages"]["hil-testbed-nodes"] == wheel.version
        assert installed["mpi"]["abi"] == "mpich/libmpi.so.12" and installed["torch"]["version"].startswith("2.")
        venv = home(lab, name) / "hil-testbed" / "venv"
        assert record["venv_python"] == str(venv / "bin" / "python") and (venv / "bin" / "mpiexec").exists()
        extra = {"server": "nvidia-ml-py", "orin": "jetson-stats"}.get(name)
        if extra:  # the kind's extra, fetched into a wheelhouse: emulated nodes cannot reach PyPI
            assert installed["packages"][extra] is not None
        assert record["facts"]["l4t_release"] == ("35.4.1" if name != "server" else None)

        role = "server" if name == "server" else "device"
        (placed,) = record["weights"]
        assert placed["role"] == role and Path(placed["directory"]).is_relative_to(home(lab, name))
        weights = list(Path(placed["directory"]).glob("*.safetensors"))
        assert len(weights) == 1 and weights[0].name.startswith(placed["sha256"][:16])
        assert file_sha256(weights[0]) == placed["sha256"] and weights[0].stat().st_size < full_size
        names = set(read_safetensors_header(weights[0]))
        layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
        if role == "device":
            assert layers == {0, 1} and {"model.embed_tokens.weight", "model.norm.weight"} <= names
            assert (Path(placed["directory"]) / "tokenizer.json").exists()
        else:
            assert layers == set(range(2, source.num_layers))
            assert "model.embed_tokens.weight" not in names and "model.norm.weight" not in names
        # the whole checkpoint never went to any node
        sent = [p for p in home(lab, name).rglob("*.safetensors") if p.stat().st_size >= full_size]
        assert sent == []


def test_a_second_run_changes_nothing_and_says_so(lab: Path) -> None:
    status, nodes = provision(lab)
    assert status == 0
    assert all(nodes[n]["changes"] == [] for n in NODES), {n: nodes[n]["changes"] for n in NODES}
    text = run_cli("provision", "-i", str(lab), "--model", str(TINY), "--partition", "m=2,P=2")
    assert text.returncode == 0 and "nothing to do" in text.stdout
    # Without --model the software is checked again and the placed weights stay on record.
    bare = run_cli("provision", "-i", str(lab), "--nodes", "orin")
    assert bare.returncode == 0 and "nothing to do" in bare.stdout, bare.stdout + bare.stderr
    record = json.loads((lab.parent / "state" / "provisioned" / "orin.json").read_text())
    assert [(w["role"], w["device_layers"]) for w in record["weights"]] == [("device", 2)]


def test_a_damaged_weight_file_is_the_only_thing_sent_again(lab: Path) -> None:
    record = json.loads((lab.parent / "state" / "provisioned" / "orin.json").read_text())
    (weights,) = Path(record["weights"][0]["directory"]).glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    before = {n: _mtimes(home(lab, n)) for n in NODES}
    status, nodes = provision(lab)
    assert status == 0
    assert nodes["orin"]["changes"] == [f"replaced {weights} ({weights.stat().st_size / 2**20:.1f} MiB)"]
    assert all(nodes[n]["changes"] == [] for n in NODES if n != "orin")
    assert file_sha256(weights) == record["weights"][0]["sha256"]
    after = {n: _mtimes(home(lab, n)) for n in NODES}
    for node in NODES:
        changed = {p for p in after[node] if before[node].get(p) != after[node][p]}
        assert changed == ({str(weights)} if node == "orin" else set()), (node, changed)


def _mtimes(root: Path) -> dict[str, int]:
    skip = ("runs", "telemetry", "__pycache__")
    return {
        str(p): p.stat().st_mtime_ns
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink() and not any(s in p.parts for s in skip)
    }


def test_an_interrupted_transfer_resumes_and_never_leaves_a_partial_file_under_its_name(lab: Path) -> None:
    record = json.loads((lab.parent / "state" / "provisioned" / "server.json").read_text())
    (weights,) = Path(record["weights"][0]["directory"]).glob("*.safetensors")
    whole = weights.read_bytes()
    weights.unlink()
    partial = weights.with_name(weights.name + ".part")
    partial.write_bytes(whole[: len(whole) // 3])  # what a transfer cut off at a third leaves
    status, nodes = provision(lab, "--nodes", "server")
    assert status == 0 and nodes["server"]["changes"] == [f"resumed {weights} ({len(whole) / 2**20:.1f} MiB)"]
    assert weights.read_bytes() == whole and not partial.exists()

    weights.unlink()
    partial.write_bytes(b"\0" * 1000)  # not a prefix of the file: restart from zero
    status, nodes = provision(lab, "--nodes", "server")
    assert status == 0 and nodes["server"]["changes"] == [f"sent {weights} ({len(whole) / 2**20:.1f} MiB)"]
    assert weights.read_bytes() == whole and not partial.exists()


def test_one_failing_node_never_stops_the_others(lab: Path) -> None:
    venv = home(lab, "orin-nx") / "hil-testbed" / "venv"
    shutil.rmtree(venv)
    venv.write_text("not a directory\n")  # the venv cannot be made here
    try:
        status, nodes = provision(lab)
        assert status == 1
        problems = nodes["orin-nx"]["problems"]
        assert any("making the venv" in p for p in problems), nodes["orin-nx"]
        assert all(nodes[n]["problems"] == [] and nodes[n]["error"] is None for n in NODES if n != "orin-nx")
    finally:
        venv.unlink()
    status, nodes = provision(lab, "--nodes", "orin-nx")
    assert status == 0 and any("made the venv" in c for c in nodes["orin-nx"]["changes"])


def test_split_inference_runs_from_the_provisioned_venvs_and_parts(lab: Path) -> None:
    out = lab.parent / "split"
    result = run_cli(
        "workers", "run", str(SCHEDULE), "-i", str(lab),
        "--method", "ushape", "-P", "2", "-m", "2", "--out", str(out), "--json",
        timeout_s=240,  # (the whole test took 44-52 s beside two other test workers on two cores)
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    requests = json.loads(result.stdout)["requests"]
    assert len(requests) == 3 * 4 and all(r["output_tokens"] > 0 for r in requests)
    launch = (out / "mpiexec.log").read_text().splitlines()[0]
    for node in NODES:
        venv_python = str(home(lab, node) / "hil-testbed" / "venv" / "bin" / "python")
        assert venv_python in launch
        inv = load_lab(lab)
        with open_transport(inv, inv.node(node)) as t:
            config = json.loads(t.run(["cat", t.expand_path("~/hil-testbed/runs/split/run.json")]).check().stdout)
        role = "server" if node == "server" else "device"
        assert config["model"] == str(home(lab, node) / "hil-testbed" / "models" / "tiny" / f"{role}-m2")
    # Exactly the tokens of single-process greedy generation with the whole checkpoint.
    from nodes.inference.checkpoint import load_whole
    from nodes.inference.generate import greedy_generate
    from nodes.inference.tokenizer import Tokenizer

    model, tokenizer = load_whole(str(TINY), dtype="float32"), Tokenizer(str(TINY))
    rows = [json.loads(line) for line in SCHEDULE.read_text().splitlines() if line.strip()]
    for r in requests:
        row = rows[r["request_id"] % 1_000_000]
        expected = greedy_generate(model, tokenizer.encode(row["prompt"]), row["max_new_tokens"], tokenizer.eos_id)
        assert r["token_ids"] == expected, r["node"]


def test_a_run_refuses_nodes_whose_mpi_abis_differ(lab: Path) -> None:
    path = lab.parent / "state" / "provisioned" / "xavier.json"
    original = path.read_text()
    record = json.loads(original)
    record["installed"]["mpi"]["abi"] = "openmpi/libmpi.so.40"  # as if xavier had Open MPI's mpi4py
    path.write_text(json.dumps(record))
    try:
        result = run_cli("workers", "run", str(SCHEDULE), "-i", str(lab), "-P", "2", "-m", "2",
                         "--out", str(lab.parent / "refused"))  # fmt: skip
        assert result.returncode == 2, result.stdout + result.stderr
        assert "xavier: MPI ABI openmpi/libmpi.so.40 differs from mpich/libmpi.so.12" in result.stderr
        assert not (lab.parent / "refused").exists()
    finally:
        path.write_text(original)


def test_a_run_sends_exactly_the_commands_its_dry_run_printed(lab: Path) -> None:
    """The run plan is what runs: every shell line the controller sends during a real run (recorded
    by the transports' command log) is a line of the plan ``--dry-run --json`` printed for the same
    run, and every line the plan sends once is sent. The campaign has a bandwidth trace with
    ``rate_scale``, a power mode and provisioned nodes (the workers' Python is each node's venv)."""
    from testbed.commands.planned import normalised_line
    from testbed.transport.command_log import ENV_VARIABLE, read

    directory = lab.parent / "plan-equals-run"
    directory.mkdir()
    campaign = directory / "traced.yaml"
    campaign.write_text(f"""name: traced
inventory: {lab}
base:
  model: {TINY}
  partition: {{device_layers: 2, stages: 2}}
  devices: [orin]
  workload: {{arrival: constant, rate_per_s: 2.0, requests_per_device: 2, max_new_tokens: 6}}
  link: {{trace: {TINY.parent.parent / "traces" / "hat-mid.csv"}, rate_scale: 0.125}}
  power: {{orin: MODE_50W}}
  drain_s: 0.2
seed: 5
run_timeout_s: 120
""")

    def testbed(log: Path, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, ENV_VARIABLE: str(log)}
        return subprocess.run([sys.executable, "-m", "testbed", *args], capture_output=True, text=True, env=env,
                              cwd=REPO, timeout=300, check=False)  # fmt: skip

    dry = testbed(directory / "dry.log", "run", str(campaign), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    plan = json.loads(dry.stdout)["runs"][0]["plan"]
    assert plan["live"] and not plan["unresolved"], plan["unresolved"]
    planned: dict[tuple[str, str], list[dict]] = {}
    for c in plan["commands"]:
        planned.setdefault((c["host"], normalised_line(c["line"])), []).append(c)
    # planning only reads: what the dry run sent are the plan's own read-backs
    for entry in read(directory / "dry.log"):
        phases = [c["phase"] for c in planned.get((entry["node"], normalised_line(entry["line"])), [])]
        assert "plan" in phases, entry

    out = directory / "out"
    ran = testbed(directory / "run.log", "run", str(campaign), "--out", str(out))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    sent = [(e["node"], normalised_line(e["line"])) for e in read(directory / "run.log")]
    unplanned = [s for s in sent if s not in planned]
    assert not unplanned, "sent but not in the plan:\n" + "\n".join(f"{n}: {line[:300]}" for n, line in unplanned)
    once = {k for k, cs in planned.items() if any(c["when"] in ("once", "per-campaign") for c in cs)}
    missing = once - set(sent)
    assert not missing, "planned but never sent:\n" + "\n".join(f"{n}: {line[:300]}" for n, line in missing)

    # what the plan says: the venvs' Python launches the workers; orin is set to MODE_50W; xavier, no
    # machine of this run, is not shaped (its links are not the run's: another campaign may use it)
    launch = plan["launch"]
    for node in ("server", "orin"):
        assert str(home(lab, node) / "hil-testbed" / "venv" / "bin" / "python") in launch
    assert any("set MODE_50W" in c["line"] and "--journal" in c["line"] for c in plan["commands"] if c["node"] == "orin")
    shaped = [c["line"] for c in plan["commands"] if c["node"] == "xavier" and c["what"] == "shape the links"]
    assert shaped == [] and not any(c["node"] == "xavier" for c in plan["commands"])
    assert (out / "runs").is_dir() and json.loads(next(out.rglob("plan.json")).read_text())["live"]
    # node code reaches a provisioned node one way: its venv's wheel, never a bundle on PYTHONPATH
    for node, line in sent:
        assert "PYTHONPATH" not in line and "hil-nodes-" not in line, (node, line[:300])
    manifest = json.loads(next(out.rglob("manifest.json")).read_text())
    assert {c["via"] for c in manifest["node_code"].values()} == {"venv"}
    assert {c["version"] for c in manifest["node_code"].values()} == {node_wheel().version.split("+")[1]}


def test_a_venv_with_another_checkouts_node_code_is_refused_before_anything_runs(lab: Path) -> None:
    path = lab.parent / "state" / "provisioned" / "orin.json"
    original = path.read_text()
    record = json.loads(original)
    record["installed_wheel"] = "0.1.0+0123456789abcdef"  # as if orin was provisioned from another checkout
    path.write_text(json.dumps(record))
    try:
        result = run_cli("power", "show", "-i", str(lab), "--nodes", "orin")
        assert result.returncode == 2, result.stdout + result.stderr
        assert "orin: its venv has hil-testbed-nodes 0.1.0+0123456789abcdef" in result.stderr
        assert "testbed provision" in result.stderr
    finally:
        path.write_text(original)
