"""A warm worker pool: ranks that stay up across the runs of one worker shape and serve them in turn.

``python -m nodes.workers --pool DIR --runs DIR`` starts a pool rank (mpiexec starts every rank of
it, as for a single run). The controller asks for a run by storing (atomically) an order on the
launch node, ``DIR/order.json``: ``{"number": n, "run": "<run id>"}`` for its n-th order (n = 1, 2,
...), or ``{"number": n, "stop": "<why>"}`` to end the pool.
Rank 0 takes the order and passes it to every rank over MPI; each rank reads the run's config from
``<runs>/<run id>/run.json`` on its own node, as a single-run launch does, and builds the run's
worker afresh. Everything a run owns is new for it: KV caches, the schedule, the state monitor, link
and draft estimates, the random state (seeded from the run config), the result files and the clock
origin (a new start barrier). Only the loaded model parts and draft adapters outlive a run
(:class:`PartCache`), and only while the next run asks for the same ones.

When every rank has finished, rank 0 writes ``<runs>/<run id>/pool-run.json``: the pool's order
number and, per rank, its setup time and which parts it loaded or reused. A rank that fails ends the
whole pool with MPI_Abort, as in a single run. A pool that gets no order for ``--idle-timeout-s``
stops by itself, so a controller that died never leaves ranks running for long.
"""

import json
import os
import sys
import time
from typing import Any, Dict, Optional

from nodes.contracts.durable import write_json_atomic
from nodes.contracts.pool_orders import ORDER_FILE, RUN_RECORD
from nodes.contracts.tool_errors import BAD_INPUT, NODE_FAILED, OK

TAG_ORDER = 21  # rank 0 -> every other rank: the next order, as JSON bytes
ORDER_POLL_S = 0.02  # how often rank 0 looks for the next order, and the others for rank 0's message


def _wait_for_order(pool_dir: str, number: int, idle_timeout_s: float) -> Dict[str, Any]:
    """The ``number``-th order (earlier ones still in the file are passed over), or a stop after the idle timeout."""
    path = os.path.join(pool_dir, ORDER_FILE)
    deadline = time.monotonic() + idle_timeout_s
    while time.monotonic() < deadline:
        try:
            with open(path, encoding="utf-8") as handle:
                order = dict(json.load(handle))
        except FileNotFoundError:
            order = {}
        except ValueError:  # stored atomically, so only a foreign file reads badly
            return {"stop": "%s is not JSON" % path}
        if order.get("number") == number:
            return order
        time.sleep(ORDER_POLL_S)
    return {"stop": "no order for %.0f s" % idle_timeout_s}


def _share_order(comm: Any, order: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Rank 0's order, on every rank. The others wait by polling (a blocking MPI receive spins on a
    core, which an idle board must not do between runs)."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        payload = bytearray(json.dumps(order).encode())
        for other in range(1, size):
            comm.Send([payload, MPI.BYTE], dest=other, tag=TAG_ORDER)
        return dict(order or {})
    status = MPI.Status()
    while not comm.Iprobe(source=0, tag=TAG_ORDER, status=status):
        time.sleep(ORDER_POLL_S)
    buffer = bytearray(status.Get_count(MPI.BYTE))
    comm.Recv([buffer, MPI.BYTE], source=0, tag=TAG_ORDER)
    return dict(json.loads(buffer.decode()))


def serve_pool(comm: Any, pool_dir: str, runs_dir: str, idle_timeout_s: float) -> int:
    """Serve orders until a stop (or the idle timeout); the exit status of this rank."""
    from nodes.contracts.run_config import RunConfigError, load

    from . import mpi_link
    from .part_cache import PartCache
    from .run_one import run_one

    rank = comm.Get_rank()
    parts = PartCache()
    shape = None  # the (role, node) of every rank in the first run: one pool serves one shape
    number = 0
    while True:
        number += 1
        order = _wait_for_order(pool_dir, number, idle_timeout_s) if rank == 0 else None
        order = _share_order(comm, order)
        run_id = order.get("run")
        if not run_id:
            if rank == 0:
                sys.stderr.write("pool %s stops after %d runs: %s\n" % (pool_dir, number - 1, order.get("stop")))
            return OK
        run_dir = os.path.join(runs_dir, str(run_id))
        try:
            config = load(os.path.join(run_dir, "run.json"))
        except RunConfigError as exc:
            mpi_link.abort(comm, BAD_INPUT, "rank %d: %s" % (rank, exc), run_dir)
            return BAD_INPUT
        if comm.Get_size() != len(config.ranks):
            message = "run %s lists %d ranks, the pool has %d" % (run_id, len(config.ranks), comm.Get_size())
            mpi_link.abort(comm, BAD_INPUT, message, run_dir)
            return BAD_INPUT
        this_shape = [(r.role, r.node) for r in config.ranks]
        if shape is not None and this_shape != shape:
            message = "rank %d: run %s has ranks %s, the pool serves %s" % (rank, run_id, this_shape, shape)
            mpi_link.abort(comm, BAD_INPUT, message, run_dir)
            return BAD_INPUT
        shape = this_shape
        try:
            info = run_one(config, comm, rank, parts)
        except Exception:  # one rank's failure must end the pool, not hang the others
            import traceback

            spec = config.ranks[rank]
            message = "rank %d (%s %s) failed in run %s:\n%s" % (rank, spec.role, spec.node, run_id,
                                                                 traceback.format_exc())  # fmt: skip
            mpi_link.abort(comm, NODE_FAILED, message, run_dir)
            return NODE_FAILED
        gathered = comm.gather(info, root=0)
        if rank == 0:
            write_json_atomic(
                os.path.join(run_dir, RUN_RECORD),
                {"run_id": run_id, "order": number, "runs_before": number - 1, "ranks": gathered},
            )
