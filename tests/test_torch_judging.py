"""What the deep preflight says of the torch a rank node imports (testbed.checks.deep_check.judge_torch),
from what its probe prints on real nodes: a Jetson with PyPI's CPU-only aarch64 wheel, a GPU server
whose torch sees no GPU, an old torch, none at all; an emulated board's CPU torch is right for it."""

from __future__ import annotations

from testbed.checks.deep_check import judge_torch
from testbed.inventory import NodeSpec
from testbed.transport.facts import NodeFacts

JETSON = NodeSpec.model_validate({"name": "xavier-01", "kind": "jetson", "model": "agx-xavier", "roles": ["device"],
                                  "address": "10.0.0.11"})  # fmt: skip
SERVER = NodeSpec.model_validate({"name": "gpu", "kind": "server", "model": "a6000-server", "roles": ["server"],
                                  "address": "10.0.0.2", "gpus": 8})  # fmt: skip


def facts(node: NodeSpec, **changes: object) -> NodeFacts:
    return NodeFacts(**{"node": node.name, "kind": node.kind, "user": "nvidia", "l4t_release": "35.4.1",
                        **changes})  # type: ignore[arg-type]  # fmt: skip


def test_pypis_cpu_only_wheel_on_a_jetson_is_named_with_jetpacks_wheel_as_the_fix():
    probe = {"python": "/usr/bin/python3", "version": "2.1.0", "cuda": None, "available": False}
    (problem,) = judge_torch(JETSON, facts(JETSON), probe)
    assert "torch 2.1.0 in /usr/bin/python3 is a CPU-only build on a node with a GPU" in problem
    assert "NVIDIA's torch wheel for its JetPack (L4T 35.4.1)" in problem
    # the same torch on an emulated board (its GPU a stand-in) is what the emulation runs
    assert judge_torch(JETSON, facts(JETSON, emulated=True), probe) == []


def test_a_server_torch_without_cuda_or_without_a_gpu_in_sight_is_a_problem():
    cpu = {"python": "/home/lab/hil-testbed/venv/bin/python", "version": "2.13.0+cpu", "cuda": None, "available": False}
    (problem,) = judge_torch(SERVER, facts(SERVER, l4t_release=None), cpu)
    assert "CPU-only build" in problem and "download.pytorch.org/whl/cu" in problem
    blind = {**cpu, "version": "2.13.0+cu128", "cuda": "12.8"}
    (problem,) = judge_torch(SERVER, facts(SERVER, l4t_release=None), blind)
    assert "(CUDA 12.8)" in problem and "sees no GPU" in problem and "usermod -aG video nvidia" in problem
    assert judge_torch(SERVER, facts(SERVER, l4t_release=None), {**blind, "available": True}) == []


def test_an_old_or_missing_torch_is_named_with_the_python_that_lacks_it():
    (old,) = judge_torch(SERVER, facts(SERVER), {"python": "/usr/bin/python3", "version": "1.13.1", "cuda": "11.7",
                                                 "available": True})  # fmt: skip
    assert "torch 1.13.1 in /usr/bin/python3 is older than the 2.1 the workers need" in old
    assert "testbed provision" in old
    (none,) = judge_torch(JETSON, facts(JETSON), {"python": "/usr/bin/python3.8",
                                                  "error": "ModuleNotFoundError: No module named 'torch'"})  # fmt: skip
    assert none.startswith("torch does not import with /usr/bin/python3.8 (ModuleNotFoundError")
