"""A decoder layer on the wire (CoCoServe's replicate and migrate, nodes/workers/engines/module_transfer.py):
bit-exact weights and KV through encode/decode, and between two real MPI ranks under mpiexec, with
the bytes on the wire the layer's weights, its KV, a header and the padding asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from nodes.inference.checkpoint import load_part
from nodes.inference.config import LlamaConfig
from nodes.workers.engines import module_transfer
from tests.test_mpi_link import LOOPBACK_TCP, MPIEXEC, REPO

TINY = str(REPO / "examples" / "models" / "tiny")


def kv_of(sequence: int, length: int, config: LlamaConfig, dtype: torch.dtype) -> module_transfer.LayerKV:
    generator = torch.Generator().manual_seed(sequence)
    shape = (config.num_key_value_heads, length, config.head_dim)
    return module_transfer.LayerKV(sequence, torch.randn(shape, generator=generator).to(dtype),
                                   torch.randn(shape, generator=generator).to(dtype))  # fmt: skip


def test_a_layer_and_its_kv_survive_encode_and_decode_bit_for_bit() -> None:
    config = LlamaConfig.load(TINY)
    part = load_part(TINY, [2], embedding=False, head=False)
    module = part.layers["2"]
    kv = [kv_of(7, 5, config, part.dtype), kv_of(9, 3, config, part.dtype)]
    message = module_transfer.encode(2, module, kv, pad_bytes=1000)
    back = module_transfer.decode(message, config, torch.device("cpu"))
    assert back.layer == 2 and back.pad_bytes == 1000 and [k.sequence for k in back.kv] == [7, 9]
    for (name, tensor), (other, copy) in zip(module.state_dict().items(), back.module.state_dict().items(),
                                            strict=True):  # fmt: skip
        assert name == other and copy.dtype == tensor.dtype and torch.equal(copy, tensor)
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in zip(kv, back.kv, strict=True))
    weights = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    kv_bytes = sum(2 * k.keys.numel() * k.keys.element_size() for k in kv)
    assert (back.weight_bytes, back.kv_bytes) == (weights, kv_bytes)
    assert len(message) - weights - kv_bytes - 1000 < 4096  # the rest is the header


RANKS = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from mpi4py import MPI
    from nodes.inference.checkpoint import load_part
    from nodes.inference.config import LlamaConfig
    from nodes.workers.engines import module_transfer
    from tests.test_module_transfer import kv_of

    tiny = sys.argv[2]
    comm = MPI.COMM_WORLD
    config = LlamaConfig.load(tiny)
    part = load_part(tiny, [2, 3], embedding=False, head=False)
    if comm.Get_rank() == 0:  # the source GPU: migrate layer 2 with two sequences' KV, replicate layer 3
        sent = [module_transfer.send_layer(comm, 1, 2, part.layers["2"], [kv_of(1, 40, config, part.dtype),
                                                                          kv_of(2, 24, config, part.dtype)]),
                module_transfer.send_layer(comm, 1, 3, part.layers["3"], pad_bytes=1 << 20)]
        comm.send(sent, dest=1, tag=99)
    else:
        got = [module_transfer.receive_layer(comm, config, torch.device("cpu"), source=0) for _ in range(2)]
        sent = comm.recv(source=0, tag=99)
        same = all(torch.equal(a, b) for message, _ in got for a, b in zip(
            part.layers[str(message.layer)].state_dict().values(), message.module.state_dict().values()))
        kv_same = all(torch.equal(item.keys, kv_of(item.sequence, item.keys.shape[1], config, part.dtype).keys)
                      for item in got[0][0].kv)
        print(json.dumps({"layers": [m.layer for m, _ in got], "sizes": [s for _, s in got], "sent": sent,
                          "weights": [m.weight_bytes for m, _ in got], "kv": [m.kv_bytes for m, _ in got],
                          "pad": [m.pad_bytes for m, _ in got], "same": same, "kv_same": kv_same}))
    """
)


def test_two_ranks_migrate_and_replicate_a_layer_over_mpi(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    done = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, str(script), str(REPO), TINY],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, **LOOPBACK_TCP))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["layers"] == [2, 3] and result["same"] and result["kv_same"]
    assert result["sizes"] == result["sent"]
    config = LlamaConfig.load(TINY)
    part = load_part(TINY, [2], embedding=False, head=False)
    layer_bytes = sum(t.numel() * t.element_size() for t in part.layers["2"].state_dict().values())
    per_token = 2 * config.num_key_value_heads * config.head_dim * part.dtype.itemsize
    assert result["weights"] == [layer_bytes, layer_bytes]  # memory moved: one layer's weights each
    assert result["kv"] == [per_token * (40 + 24), 0] and result["pad"] == [0, 1 << 20]
    assert result["sizes"][1] - layer_bytes - (1 << 20) < 4096
