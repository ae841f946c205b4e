"""What `testbed provision` costs on the default four emulated nodes (a server, three Jetsons at
0.3-0.5 CPU): the first run (venvs, the node wheel, a wheelhouse for the kind extras, the tiny
model cut for m=2), runs that find nothing to do, and a run that repairs one damaged weight file.
Also the bytes each role receives against the whole checkpoint. Writes bench/results/provision.json
with medians. Needs root; the wheelhouse comes from PyPI on the first run of a machine, then from
~/.cache/hil-testbed/wheelhouse (the first-run figure says which).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emulated_lab, summary, write
from testbed.provisioning.provision import ProvisionOptions, load_record, provision
from testbed.provisioning.weights import default_cache_dir

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "models" / "tiny"


def inventory_text(state_dir: Path) -> str:
    text = (REPO / "inventory.yaml").read_text()
    text = text.replace("10.231.0.0/24", "10.206.0.0/24").replace("10.232.0.0/24", "10.207.0.0/24")
    return text.replace("name_prefix: tb", f"name_prefix: tbp\n  state_dir: {state_dir}")


def timed(lab, options: ProvisionOptions) -> tuple[float, dict[str, list[str]]]:
    started = time.monotonic()
    result, across = provision(lab, None, options)
    seconds = time.monotonic() - started
    if not result.ok or across or any(not v.ok for v in result.values().values()):
        raise SystemExit(f"provisioning failed: {[o.error for o in result.failed]} {across}")
    return seconds, {name: list(v.changes) for name, v in result.values().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="no-op and repair runs to take the median of")
    args = parser.parse_args()
    wheelhouse_cached = any((default_cache_dir().parent / "wheelhouse").glob("cp*/*.whl"))
    with emulated_lab(inventory_text) as lab, tempfile.TemporaryDirectory() as parts_cache:
        options = ProvisionOptions(model=TINY, partition=(2, 2), parts_cache=Path(parts_cache))
        first_s, first_changes = timed(lab, options)
        noop = [timed(lab, options) for _ in range(args.repeats)]
        assert all(not any(changes.values()) for _, changes in noop), "a second run changed something"
        repair = []
        for _ in range(args.repeats):
            (weights,) = Path(load_record(lab, "orin")["weights"][0]["directory"]).glob("*.safetensors")
            data = bytearray(weights.read_bytes())
            data[len(data) // 2] ^= 0xFF
            weights.write_bytes(bytes(data))
            seconds, changes = timed(lab, options)
            assert changes["orin"] and not any(changes[n] for n in changes if n != "orin"), changes
            repair.append(seconds)
        sizes = {
            n.name: sum(f["size"] for w in load_record(lab, n.name)["weights"] for f in w["files"]) for n in lab.nodes
        }
    full = sum(p.stat().st_size for p in TINY.iterdir() if p.is_file() and p.suffix in (".safetensors", ".json"))
    payload = {
        "nodes": 4,
        "wheelhouse_from_cache": wheelhouse_cached,
        "first_run_s": first_s,
        "first_run_changes": first_changes,
        "noop_run_s": summary([s for s, _ in noop]),
        "repair_one_file_s": summary(repair),
        "ratio_noop_over_first": summary([s for s, _ in noop])["median"] / first_s,
        "bytes_per_node": sizes,
        "checkpoint_dir_bytes": full,
    }
    path = write("provision", payload)
    print(f"first {first_s:.1f} s, no-op median {payload['noop_run_s']['median']:.1f} s, "
          f"repair median {payload['repair_one_file_s']['median']:.1f} s -> {path}")  # fmt: skip


if __name__ == "__main__":
    main()
