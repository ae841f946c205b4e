"""``manifest.json``: everything needed to know what a run was and to run it again.

Resolved settings, seeds and schedules' digests; the inventory without secrets; the controller's
git commit and a hash of uncommitted changes; package versions; each node's facts (kernel, L4T,
GPU driver) and provisioned software (torch, MPI library and ABI); power modes read back; tc read
back and link measurements; clock offsets; telemetry sensors; and what was modeled rather than
measured (stand-in tools, emulated boards, shaping this kernel cannot do).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from foundation.errors import TestbedError
from foundation.provenance import git_provenance
from nodes.contracts.durable import write_json_atomic
from nodes.contracts.methods import method_named
from testbed import __version__
from testbed.campaign.spec import Campaign, PlannedRun
from testbed.inventory import Inventory, kind_of

PACKAGES = ("hil-testbed", "pandas", "pyarrow", "numpy", "pydantic", "paramiko", "fabric", "tokenizers", "rich")
SECRET_FIELDS = ("password_env", "identity_file")


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def inventory_snapshot(lab: Inventory) -> dict[str, Any]:
    """The inventory as resolved, without anything that names a secret."""

    def scrub(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: ("<withheld>" if k in SECRET_FIELDS and v else scrub(v)) for k, v in value.items()}
        if isinstance(value, list):
            return [scrub(v) for v in value]
        return value

    return {"path": str(lab.path), "spec": scrub(lab.spec.model_dump(mode="json", by_alias=True)),
            "reached": {node.name: _reached(lab, node) for node in lab.nodes}}


def _reached(lab: Inventory, node: Any) -> dict[str, Any]:
    """How the controller reached ``node`` (the inventory over the SSH config) and what it runs there."""
    out: dict[str, Any] = dataclasses.asdict(lab.settings_of(node))
    if node.adb is not None:
        out["via"] = f"adb {node.adb.serial} on {node.adb.usb_host}"
    elif node.transport == "ssh" and node.address is not None:
        try:
            out["ssh"] = lab.ssh_target(node).describe()
        except TestbedError as exc:  # an SSH config that changed since the run began
            out["ssh"] = f"unresolved: {exc}"
    return out


def modeled_statements(lab: Inventory, names: list[str], state: Any) -> list[str]:
    """What in this run is modeled or stood in for, in words."""
    out = []
    for name in names:
        node = lab.node(name)
        if node.emulated is not None:
            what = kind_of(node).stand_ins
            out.append(f"{name}: emulated {node.kind} ({node.model}): {what}; its power readings are modeled")
    for name, telemetry in (state.telemetry.get("probes") or {}).items():
        for sensor in telemetry.get("sensors", []):
            # a serialised SensorStatus carries its value and problem, not its ``ok`` property
            if sensor.get("kind") == "modeled" and sensor.get("value") is not None and not sensor.get("problem"):
                out.append(f"{name}: {sensor.get('sensor')} {sensor.get('metric')} is modeled")
                break
    target = _target(state)
    if target is not None:
        model = target["model"]
        out.append(f"step times are modeled: each paced step lasts what the compute profile predicts for "
                   f"{model['name']} on the node's hardware (x{target['dilation']:g} dilation); tokens are the "
                   "real checkpoint's")  # fmt: skip
        if target.get("pad_payloads"):
            out.append(f"bytes on the data plane are modeled: hidden states padded to {model['name']}'s "
                       f"{model['hidden']} x {model['dtype']}")  # fmt: skip
    if lab.spec.emulation.instance is not None and lab.spec.emulation.instance.mode == "local":
        out.append("local mode: nodes are processes on one host; no isolation, no shaping, no CPU quotas")
    return out


def _target(state: Any) -> dict[str, Any] | None:
    """The run's target (model, dilation, each node's profile and mode), when it emulates one."""
    plan = getattr(state, "plan", None)
    return plan.split.sections.target if plan is not None else None


def model_config(directory: Path) -> dict[str, Any] | None:
    """The checkpoint's config.json (its shape: layers, widths, vocabulary), so that analysis (FLOPs,
    cost) does not depend on the checkpoint still being where the run found it."""
    try:
        return json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def _context_service(state: Any, directory: Path) -> dict[str, Any] | None:
    """Each device's LLM service: its memory method and scale (modeled or not), the T_re and T_IO it
    fitted at start (``install_profile.json``) and its counters at the end (from the rank's files)."""
    plan = state.plan
    if plan is None or not plan.services:
        return None
    out = {}
    for service in plan.services:
        entry: dict[str, Any] = {"memory": service.memory, "scale": service.scale.to_json(), "argv": list(service.argv)}
        for rank_dir in sorted((directory / "workers" / "ranks").glob(f"device-*-{service.node}")):
            for name in ("install_profile", "context_service_stats"):
                path = rank_dir / f"{name}.json"
                if path.is_file():
                    entry[name] = json.loads(path.read_text())
        out[service.node] = entry
    return out


def build_manifest(
    campaign: Campaign,
    run: PlannedRun,
    attempt: int,
    outcome: Any,
    state: Any,
    facts: dict[str, Any],
    started_unix_s: float,
    directory: Path | None = None,  # the attempt's directory (the ranks' files an LLM service left)
) -> dict[str, Any]:
    lab = campaign.inventory
    names = sorted({*state.records, *state.power_set, *state.shaped_nodes} or set(facts))
    records = {
        name: {k: r.get(k) for k in ("wheel", "installed", "venv", "weights") if k in r}
        for name, r in state.records.items() if r
    }  # fmt: skip
    clocks = {
        name: {"start": n["clock_start"], "end": n["clock_end"], "drift_ppm": n["drift_ppm"],
               "start_unix_s": n.get("clock_start_unix_s"), "end_unix_s": n.get("clock_end_unix_s")}
        for name, n in (state.telemetry.get("nodes") or {}).items()
    }
    return {
        "run_id": run.run_id,
        "attempt": attempt,
        "status": outcome.state,
        "reason": outcome.reason,
        "failed_node": outcome.failed_node,
        "requests": {"scheduled": outcome.requests_scheduled, "completed": outcome.requests_completed},
        "campaign": {
            "name": campaign.spec.name,
            "file": str(campaign.path),
            "digest": campaign.digest(),
            "seed": campaign.spec.seed,
            "run_timeout_s": campaign.spec.run_timeout_s,
        },
        "position": run.position,
        "repetition": run.repetition,
        "seed": run.seed,
        "overrides": dict(run.overrides),
        "settings": run.settings.model_dump(mode="json"),
        "method": method_named(run.settings.method).describe(),
        "model_directory": str(campaign.resolve(run.settings.model)),
        "model_config": model_config(campaign.resolve(run.settings.model)),
        "started_unix_s": started_unix_s,
        "ended_unix_s": time.time(),
        "phases_s": state.phases_s,
        "controller": {
            "testbed_version": __version__,
            "git": git_provenance(),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "host": os.uname().nodename,
            "packages": package_versions(),
        },
        "inventory": inventory_snapshot(lab),
        "node_facts": {name: facts.get(name) for name in names},
        "provisioned": records,
        "node_code": {  # how our code reached each node, and the digest of what ran there
            name: {"via": c.code_via, "version": c.code_version, "python": c.python}
            for name, c in (state.plan.contexts.items() if getattr(state, "plan", None) else ())
        },
        "schedules": {
            device: {"requests": len(rows), "sha256": _digest(rows), "file": f"schedules/{device}.jsonl"}
            for device, rows in state.schedules.items()
        },
        "power": {"set": state.power_set, "unchanged": state.power_unchanged, "read_back": state.power_read_back},
        "workers": state.workers,  # the warm pool that served the run, and whether it started warm or cold
        "links": state.links,
        "clock_offsets": clocks,
        "telemetry": state.telemetry,
        "restore": state.restore,
        "target": _target(state),  # what the run emulated: model, dilation, each node's profile in its mode
        "fidelity": state.fidelity,  # per node: paced steps, overruns and their share
        # LLMS: each device's daemon, its scale, the T_re and T_IO it fitted, its counters
        "context_service": _context_service(state, directory) if directory is not None else None,
        "modeled": modeled_statements(lab, names, state),
    }


def _digest(rows: list[dict]) -> str:
    from workloads.schedule import schedule_digest

    return schedule_digest(rows)


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` atomically and synced."""
    write_json_atomic(path, manifest, sort_keys=True, default=_default)


def _default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)
