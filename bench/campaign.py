"""Campaign throughput on the emulated testbed: each campaign run in one invocation with warm runs
(worker pools and node configuration kept between runs) and with every run cold (``warm_runs:
false``: new ranks, configured and restored on its own), optionally also with the checkout of an
earlier commit (``--baseline``: the code before warm runs), and then, optionally, a warm campaign
killed with SIGKILL at random moments and resumed each time.

Per run, the serving time is the span of the request timelines (from the workers' start barrier to
the last request done, over every device; requests.parquet) and the run's wall time is its manifest's
start to end. Reported per campaign and way: the serving share (sum of serving over sum of run wall
times, and over the campaign's wall time), the median run wall time and phase times, and the total
campaign time; then the cold/warm (and baseline/warm) ratios of total times, and warm against the
others per request: the same tokens, and the differences of TTFT and mean time between tokens.

    python bench/campaign.py                        # demo + hat (Table 5, one repetition), warm and cold
    python bench/campaign.py --campaigns demo --kills 20
    python bench/campaign.py --baseline 4e6efb0      # also the commit before warm runs, every run cold

Writes bench/results/campaign.json, one entry per command line (another selection keeps the last
one's figures). Needs root (network namespaces); brings the repository's
inventory.yaml up if it is not (and down again after).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pandas as pd

from bench._common import RESULTS, machine, write

REPO = Path(__file__).resolve().parent.parent
INVENTORY = REPO / "inventory.yaml"
CAMPAIGNS = {
    "demo": (REPO / "examples" / "campaigns" / "demo.yaml", {}),
    # HAT's Table 5 matrix with one repetition (14 runs): enough for the shares and ratios
    "hat": (REPO / "examples" / "campaigns" / "hat-table5.yaml", {"repetitions": 1}),
}


def campaign_copy(name: str, directory: Path, *, warm: bool | None) -> Path:
    """The example campaign with ``warm_runs`` set (and the bench's changes), its paths absolute;
    ``warm`` None: without the key, for a checkout from before warm runs."""
    from ruamel.yaml import YAML

    source, changes = CAMPAIGNS[name]
    yaml = YAML()
    data = yaml.load(source.read_text())
    data["inventory"] = str(INVENTORY)
    data["base"]["model"] = str((source.parent / data["base"]["model"]).resolve())
    link = data["base"].get("link") or {}
    if "trace" in link:
        link["trace"] = str((source.parent / link["trace"]).resolve())
    data.update(changes)
    if warm is not None:
        data["warm_runs"] = warm
    path = directory / f"{name}-{'baseline' if warm is None else 'warm' if warm else 'cold'}.yaml"
    with path.open("w") as f:
        yaml.dump(data, f)
    return path


def testbed(*args: str, log: Path, checkout: Path = REPO) -> subprocess.Popen:
    """``testbed ARGS`` as a subprocess, from ``checkout`` (another commit's worktree for a baseline)."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "testbed", *args], cwd=checkout, stdout=out,
                                stderr=subprocess.STDOUT, env=env)  # fmt: skip


def baseline_checkout(commit: str, directory: Path) -> Path:
    """A worktree of ``commit`` (e.g. the one before warm runs), to run the same campaign the old way."""
    path = directory / f"baseline-{commit[:12]}"
    if not path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), commit], check=True,
                       capture_output=True)  # fmt: skip
    return path


def run_serving(run_dir: Path) -> dict[str, Any]:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    requests = pd.read_parquet(run_dir / "requests.parquet")
    done = requests[requests.completed] if "done_s" in requests else requests.iloc[:0]
    start = requests.clock_origin_unix_s.min() if "clock_origin_unix_s" in requests else 0.0
    end = (done.clock_origin_unix_s + done.done_s).max() if len(done) else start
    wall = manifest["ended_unix_s"] - manifest["started_unix_s"]
    return {
        "run_id": manifest["run_id"], "label": ", ".join(f"{k}={v}" for k, v in manifest["overrides"].items()),
        "status": manifest["status"], "wall_s": wall, "serving_s": float(end - start) if len(done) else 0.0,
        "phases_s": manifest["phases_s"], "workers": {k: v for k, v in manifest.get("workers", {}).items()
                                                      if k != "ranks"},
    }  # fmt: skip


def campaign_figures(out: Path, wall_s: float) -> dict[str, Any]:
    runs = [run_serving(d) for d in sorted((out / "runs").iterdir()) if (d / "manifest.json").is_file()
            and "." not in d.name]  # fmt: skip
    serving, walls = sum(r["serving_s"] for r in runs), sum(r["wall_s"] for r in runs)
    phases = sorted({p for r in runs for p in r["phases_s"]})
    return {
        "runs": len(runs),
        "done": sum(r["status"] == "done" for r in runs),
        "campaign_wall_s": round(wall_s, 2),
        "serving_share_of_run_wall": round(serving / walls, 4) if walls else None,
        "serving_share_of_campaign_wall": round(serving / wall_s, 4),
        "median_run_wall_s": round(statistics.median(r["wall_s"] for r in runs), 3),
        "median_run_serving_s": round(statistics.median(r["serving_s"] for r in runs), 3),
        "median_phases_s": {p: round(statistics.median(r["phases_s"].get(p, 0.0) for r in runs), 3) for p in phases},
        "starts": {s: sum(r["workers"].get("start") == s for r in runs) for s in ("warm", "cold")},
        "per_run": runs,
    }


def request_table(out: Path) -> pd.DataFrame:
    frames = []
    for run_dir in sorted((out / "runs").iterdir()):
        if "." in run_dir.name or not (run_dir / "requests.parquet").is_file():
            continue
        frame = pd.read_parquet(run_dir / "requests.parquet")
        frame["run_id"] = run_dir.name
        frames.append(frame)
    table = pd.concat(frames, ignore_index=True)
    tokens = table.output_tokens.clip(lower=2)
    table["tbt_s"] = (table.last_token_s - table.first_token_s) / (tokens - 1)
    return table.set_index(["run_id", "node", "request_id"])


def compare(warm_out: Path, cold_out: Path) -> dict[str, Any]:
    """Warm against cold, request by request (the same run ids, schedules and seeds)."""
    warm, cold = request_table(warm_out), request_table(cold_out)
    both = warm.add_suffix("_warm").join(cold.add_suffix("_cold"), how="inner")
    same_tokens = sum(list(a) == list(b) for a, b in zip(both.token_ids_warm, both.token_ids_cold, strict=True))
    out: dict[str, Any] = {"requests_warm": len(warm), "requests_cold": len(cold), "matched": len(both),
                           "same_tokens": same_tokens}  # fmt: skip
    for metric in ("ttft_s", "tbt_s"):
        diff = both[f"{metric}_warm"] - both[f"{metric}_cold"]
        out[metric] = {
            "median_warm": round(float(both[f"{metric}_warm"].median()), 4),
            "median_cold": round(float(both[f"{metric}_cold"].median()), 4),
            "median_difference": round(float(diff.median()), 4),
            "median_abs_difference": round(float(diff.abs().median()), 4),
            "median_relative_difference": round(float((diff / both[f"{metric}_cold"]).median()), 4),
        }
    return out


def run_both_ways(name: str, directory: Path, ways: list[str], baseline: str | None) -> dict[str, Any]:
    result: dict[str, Any] = {}
    outs = {}
    for way in [*ways, *(["baseline"] if baseline else [])]:
        warm = None if way == "baseline" else way == "warm"
        campaign = campaign_copy(name, directory, warm=warm)
        checkout = baseline_checkout(baseline, directory) if way == "baseline" and baseline else REPO
        out = directory / f"{name}-{way}"
        started = time.monotonic()
        log = directory / f"{name}-{way}.log"
        done = testbed("run", str(campaign), "--out", str(out), log=log, checkout=checkout).wait()
        wall = time.monotonic() - started
        print(f"{name} {way}: exit status {done} in {wall:.1f} s", file=sys.stderr)
        result[way] = campaign_figures(out, wall)
        outs[way] = out
    for other in ("cold", "baseline"):
        if "warm" in outs and other in outs:
            ratio = result[other]["campaign_wall_s"] / result["warm"]["campaign_wall_s"]
            result[f"{other}_over_warm_total_time"] = round(ratio, 3)
            result[f"warm_vs_{other}"] = compare(outs["warm"], outs[other])
    if baseline:
        result["baseline_commit"] = baseline
    return result


# --------------------------------------------------------------------------------------------
# SIGKILLs of a warm campaign, each followed by --resume


def our_processes() -> list[str]:
    """Command lines of testbed processes of the benchmark's lab on this host (the emulated nodes are
    processes here; those of another lab, e.g. a test suite's, name its own state directory)."""
    from testbed.emulation.plan import state_dir_of
    from testbed.inventory import load_inventory

    state = str(state_dir_of(load_inventory(INVENTORY)))
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        line = b" ".join(words).decode(errors="replace")
        ours = state + "/" in line
        if ours and any(m in line for m in ("nodes.workers", "nodes.telemetry", "link_trace_player",
                                            "hydra_pmi_proxy", "mpiexec")):  # fmt: skip
            found.append(line[:200])
    return found


def node_leftovers() -> dict[str, Any]:
    """What is shaped (our qdiscs, journals) or in a changed power mode on the lab's nodes."""
    from testbed.emulation.resolved import load_lab
    from testbed.energy.power_modes import show_power
    from testbed.links.apply import show_nodes

    lab = load_lab(INVENTORY)
    shaped = {o.node: (o.value.journal is not None or any(
        (s.root_qdisc or {}).get("handle") == "1f7b:" for s in o.value.states.values()))
        for o in show_nodes(lab).outcomes if o.value}  # fmt: skip
    power = {name: {"mode": r.mode_name, "journal": r.journal} for name, r in show_power(lab).values().items()}
    return {"shaped": sorted(n for n, v in shaped.items() if v), "power": power}


def ledger_counts(out: Path) -> dict[str, int]:
    """Runs per state in a campaign's ledger (read while the controller may be writing it)."""
    import sqlite3

    if not (out / "ledger.sqlite").is_file():
        return {}
    with sqlite3.connect(f"file:{out / 'ledger.sqlite'}?mode=ro", uri=True, timeout=5) as db:
        return dict(db.execute("SELECT state, COUNT(*) FROM runs GROUP BY state").fetchall())


def campaign_outcome(out: Path) -> dict[str, Any]:
    """Runs done, attempts, and request rows duplicated or incomplete in one killed-and-resumed campaign."""
    import sqlite3

    with sqlite3.connect(out / "ledger.sqlite") as db:
        rows = db.execute("SELECT run_id, state, attempts FROM runs ORDER BY position").fetchall()
    duplicates, missing = 0, 0
    for run_id, _state, _attempts in rows:
        requests = pd.read_parquet(out / "runs" / run_id / "requests.parquet")
        duplicates += int(requests.duplicated(["node", "request_id"]).sum())
        missing += int((~requests.completed).sum())
    return {
        "runs": len(rows), "runs_done": sum(r[1] == "done" for r in rows),
        "attempts": {r[0]: r[2] for r in rows}, "interrupted_attempts": len(list((out / "runs").glob("*.interrupted"))),
        "duplicate_request_rows": duplicates, "incomplete_requests": missing,
    }  # fmt: skip


def kills(name: str, directory: Path, count: int, seed: int) -> dict[str, Any]:
    """SIGKILL the controller ``count`` times at random moments, each time followed by ``--resume``.

    Moments are drawn over a whole warm campaign (1-60 s after each start), so that kills land in a cold
    start, inside a warm pool's runs and between runs; a kill is "in a warm pool" when this controller had
    already finished a run (its pool served the next one). When a campaign finishes before ``count`` kills,
    a fresh copy of it takes the remaining ones.
    """
    rng = random.Random(seed)
    campaign = campaign_copy(name, directory, warm=True)
    log = directory / f"{name}-kills.log"
    before = node_leftovers()
    moments: list[dict[str, Any]] = []
    outs: list[Path] = []
    started = time.monotonic()
    while sum(m["killed"] for m in moments) < count:
        if outs and not {"todo", "running"} & set(ledger_counts(outs[-1])):
            # every run done: a resume finishes what a kill at the very end left (a pool, held modes)
            testbed("run", str(campaign), "--out", str(outs[-1]), "--resume", log=log).wait()
        if not outs or not {"todo", "running"} & set(ledger_counts(outs[-1])):
            outs.append(directory / f"{name}-kills-{len(outs) + 1}")
        out = outs[-1]
        resume = (out / "ledger.sqlite").is_file()
        done_before = ledger_counts(out).get("done", 0)
        controller = testbed("run", str(campaign), "--out", str(out), *(["--resume"] if resume else []), log=log)
        moment = rng.uniform(1.0, 60.0)
        try:
            controller.wait(timeout=moment)
            moments.append({"campaign": len(outs), "after_s": round(moment, 2), "killed": False,
                            "exit": controller.returncode})  # fmt: skip
            if controller.returncode != 0:
                break
        except subprocess.TimeoutExpired:
            counts = ledger_counts(out)
            controller.send_signal(signal.SIGKILL)
            controller.wait()
            moments.append({
                "campaign": len(outs), "after_s": round(moment, 2), "killed": True,
                "in_warm_pool": counts.get("done", 0) > done_before, "during_a_run": bool(counts.get("running")),
            })  # fmt: skip
    finals = [testbed("run", str(campaign), "--out", str(out), "--resume", log=log).wait() for out in outs]
    wall = time.monotonic() - started
    outcomes = [campaign_outcome(out) for out in outs]
    killed = [m for m in moments if m["killed"]]
    return {
        "kills": len(killed), "kills_in_warm_pool": sum(m["in_warm_pool"] for m in killed),
        "kills_during_a_run": sum(m["during_a_run"] for m in killed), "moments": moments,
        "final_exits": finals, "wall_s": round(wall, 1), "campaigns": outcomes,
        "runs": sum(o["runs"] for o in outcomes), "runs_done": sum(o["runs_done"] for o in outcomes),
        "duplicate_request_rows": sum(o["duplicate_request_rows"] for o in outcomes),
        "incomplete_requests": sum(o["incomplete_requests"] for o in outcomes),
        "nodes_before": before, "nodes_after": node_leftovers(), "processes_left": our_processes(),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--campaigns", default="demo,hat", help="comma-separated: demo, hat (default: both)")
    parser.add_argument("--kills", type=int, default=0, help="SIGKILLs of a warm demo campaign, each resumed")
    parser.add_argument("--seed", type=int, default=1, help="seed of the kill moments")
    parser.add_argument("--ways", default="warm,cold", help="comma-separated: warm, cold (default: both)")
    parser.add_argument("--work", type=Path, help="where the campaigns go (default: a new directory, kept)")
    parser.add_argument(
        "--baseline",
        metavar="COMMIT",
        help="also run each campaign with this commit's checkout (e.g. the one before warm runs)",
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root: the emulated testbed builds network namespaces")
    from testbed.emulation.lifecycle import down, status, up
    from testbed.inventory import load_inventory

    lab = load_inventory(INVENTORY)
    was_up = status(lab).running
    if not was_up and not up(lab, say=lambda _: None).ok:
        raise SystemExit("could not bring the emulated testbed up")
    results: dict[str, Any] = {}
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-campaign-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"campaigns in {work}", file=sys.stderr)
    try:
        for name in [c for c in args.campaigns.split(",") if c]:
            results[name] = run_both_ways(name, work, [w for w in args.ways.split(",") if w], args.baseline)
        if args.kills:
            results["kills"] = kills("demo", work, args.kills, args.seed)
    finally:
        if not was_up:
            down(load_inventory(INVENTORY), say=lambda _: None)
    # one entry per command line: a run of another selection does not erase the figures of the last one
    invocation = " ".join(["python", "bench/campaign.py", *sys.argv[1:]])
    previous = RESULTS / "campaign.json"
    runs = json.loads(previous.read_text()).get("invocations", {}) if previous.is_file() else {}
    path = write("campaign", {"invocations": {**runs, invocation: {"machine": machine(), **results}}})
    figures = ("campaign_wall_s", "serving_share_of_run_wall", "serving_share_of_campaign_wall")
    summary = {name: {k: r.get(k) for k in ("cold_over_warm_total_time", "baseline_over_warm_total_time")} | {
        way: {k: r[way][k] for k in figures} for way in ("warm", "cold", "baseline") if way in r}
        for name, r in results.items() if name != "kills"}  # fmt: skip
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
