"""One run on one rank, the same in a single-run launch and in a warm pool: build the rank's worker
(a server stage or a device) from the run config, meet the other ranks at the start barrier, take
the clock origin there, serve or replay, and meet them again at the end."""

import os
import threading
import time
from typing import Any, Dict, Optional

from nodes.contracts.run_config import RunConfig
from nodes.contracts.tool_errors import NODE_FAILED

from . import mpi_link


def _overrun(config: RunConfig, rank: int) -> None:
    """The run outlived its deadline: end this process (mpiexec then ends every rank of the launch),
    saying why on stderr and where the controller looks for an aborting rank's reason."""
    message = "rank %d: run %s still going %.0f s after its start: ended" % (rank, config.run_id, config.deadline_s)
    mpi_link.say_why(rank, message, os.path.dirname(config.out_dir))
    os._exit(NODE_FAILED)


MEMORY_FIELDS = {"Rss": "rss_kb", "Pss": "pss_kb", "Pss_Anon": "pss_anon_kb", "Pss_File": "pss_file_kb",
                 "Shared_Clean": "shared_clean_kb"}  # fmt: skip


def memory_kb() -> Optional[Dict[str, int]]:
    """This process's memory (measured, from ``/proc/self/smaps_rollup``, Linux 4.14+): resident, and
    proportional (pages shared with other processes, a checkpoint's mapped weights among them, count
    their share only); None where the kernel has no such file."""
    try:
        with open("/proc/self/smaps_rollup", encoding="ascii") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        key, _, rest = line.partition(":")
        if key in MEMORY_FIELDS and rest.strip().endswith("kB"):
            out[MEMORY_FIELDS[key]] = int(rest.split()[0])
    return out or None


def run_one(config: RunConfig, comm: Any, rank: int, parts: Any) -> Dict[str, Any]:
    """Run ``config`` on this rank; what the rank did to set up (seconds, parts loaded or reused).
    ``parts``: the rank's :class:`~nodes.workers.part_cache.PartCache`."""
    import torch

    spec = config.ranks[rank]
    torch.manual_seed(config.seed)
    torch.set_num_threads(spec.threads or 1)
    mpi_link.set_time_dilation(config.target.dilation if config.target is not None else 1.0)
    os.makedirs(config.rank_dir(rank), exist_ok=True)
    started = time.monotonic()
    streams = config.method_spec.streams  # a serving engine and its clients, not a split pipeline
    if config.method_spec.dispatches:  # endpoints over HTTP, and the devices' dispatchers
        from .clients.dispatch_worker import DispatchClient, DispatchServer

        worker = (DispatchServer if spec.role == "stage" else DispatchClient)(config, comm, rank, parts)
    elif config.method_spec.serves_contexts:  # the device's LLM service and its apps; the server idles
        from .clients.context_apps import ContextApps, IdleServer

        worker = (IdleServer if spec.role == "stage" else ContextApps)(config, comm, rank, parts)
    elif spec.role == "stage" and config.method_spec.gpu_ranks:  # the instance on the first GPU, copies on the rest
        from .engines.scaling_engine import GpuRank, ScalingEngine

        worker = (ScalingEngine if spec.index == 0 else GpuRank)(config, comm, rank, parts)
    elif spec.role == "stage" and streams:
        from .engines.serving_engine import ServingEngine

        worker = ServingEngine(config, comm, rank, parts)
    elif spec.role == "stage":
        from .split.server_stage import ServerStage

        worker = ServerStage(config, comm, rank, parts)
    elif streams:
        from .clients.serving_client import ServingClient

        worker = ServingClient(config, comm, rank, parts)
    else:
        from .split.device import DeviceWorker

        worker = DeviceWorker(config, comm, rank, parts)
    parts.settle()
    setup_s = time.monotonic() - started
    mpi_link.barrier(comm)
    watchdog = None
    if config.deadline_s is not None:
        watchdog = threading.Timer(config.deadline_s, _overrun, (config, rank))
        watchdog.daemon = True
        watchdog.start()
    worker.start(time.monotonic())
    if spec.role == "stage":
        worker.serve()
    else:
        worker.run()
    memory = memory_kb()  # before the end barrier: every rank of the run still holds its parts
    mpi_link.barrier(comm)
    if watchdog is not None:
        watchdog.cancel()
    report = {"rank": rank, "role": spec.role, "node": spec.node, "setup_s": round(setup_s, 6), "memory": memory}
    return dict(report, **parts.take_report())
