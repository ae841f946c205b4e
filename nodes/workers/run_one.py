"""One run on one rank, the same in a single-run launch and in a warm pool: build the rank's worker
(a server stage or a device) from the run config, meet the other ranks at the start barrier, take
the clock origin there, serve or replay, and meet them again at the end."""

import os
import time
from typing import Any, Dict

from .run_config import RunConfig


def run_one(config: RunConfig, comm: Any, rank: int, parts: Any) -> Dict[str, Any]:
    """Run ``config`` on this rank; what the rank did to set up (seconds, parts loaded or reused).
    ``parts``: the rank's :class:`~nodes.workers.pool.PartCache`."""
    import torch

    spec = config.ranks[rank]
    torch.manual_seed(config.seed)
    torch.set_num_threads(spec.threads or 1)
    os.makedirs(config.rank_dir(rank), exist_ok=True)
    started = time.monotonic()
    if spec.role == "stage":
        from .server_stage import ServerStage

        worker = ServerStage(config, comm, rank, parts)
    else:
        from .device import DeviceWorker

        worker = DeviceWorker(config, comm, rank, parts)
    parts.settle()
    setup_s = time.monotonic() - started
    comm.Barrier()
    worker.start(time.monotonic())
    if spec.role == "stage":
        worker.serve()
    else:
        worker.run()
    comm.Barrier()
    return dict({"rank": rank, "role": spec.role, "node": spec.node, "setup_s": round(setup_s, 6)},
                **parts.take_report())
