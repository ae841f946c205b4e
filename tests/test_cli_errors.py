"""The one error policy, through the real command line: a mistake in a user file is exit status 2
with ``FILE:LINE: field: problem; hint`` (the hint pointing at an example of that kind of file); a node
that fails is exit status 1 with the node named; never a traceback."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import REPO, run_cli

TINY = REPO / "examples" / "models" / "tiny"


def test_a_misspelt_campaign_key_points_at_a_campaign_example(tmp_path: Path) -> None:
    campaign = tmp_path / "typo.yaml"
    campaign.write_text(f"name: typo\ninventory: {REPO / 'inventory.yaml'}\nbase:\n  model: {TINY}\n"
                        "  partiton: {device_layers: 2}\n")  # fmt: skip
    result = run_cli("run", str(campaign), "--dry-run")
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{campaign}:5: base.partiton: unknown key 'partiton'" in result.stderr
    assert "examples/campaigns/demo.yaml shows every key" in result.stderr
    assert "inventories" not in result.stderr and "Traceback" not in result.stderr


def test_a_misspelt_inventory_key_points_at_an_inventory_example(tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("nodes:\n  - name: box\n    kind: server\n    model: x\n    adress: 127.0.0.1\n")
    result = run_cli("inventory", "show", "-i", str(inventory))
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{inventory}:5: nodes[0].adress: unknown key 'adress'" in result.stderr
    assert "examples/inventories/lab.yaml shows every key" in result.stderr


def test_a_node_that_cannot_be_reached_for_telemetry_is_exit_1_naming_it(tmp_path: Path) -> None:
    # port 9 (discard) on loopback: nothing listens, the connection is refused at once
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("defaults:\n  ssh: {port: 9, user: nobody, connect_timeout: 2s}\nnodes:\n"
                         "  - {name: lonely, kind: server, model: x, address: 127.0.0.1, roles: [server]}\n")  # fmt: skip
    result = run_cli("telemetry", "record", "-i", str(inventory), "--out", str(tmp_path / "t"), "--seconds", "1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "lonely" in result.stderr and "Traceback" not in result.stderr
