"""``python -m nodes.workers RUN_CONFIG``: the program ``mpiexec`` starts on every rank of a run.
``python -m nodes.workers --pool DIR --runs DIR``: a rank of a warm pool that serves run after run
(:mod:`nodes.workers.pool`).

The rank's entry in the run config says what it is: a server pipeline stage or a device. All ranks
meet at a start barrier; each takes its clock origin there.
"""

import argparse
import os
import sys
import traceback

from nodes.contracts.pool_orders import IDLE_TIMEOUT_S
from nodes.contracts.tool_errors import BAD_INPUT, NODE_FAILED, OK


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nodes.workers", description=__doc__)
    parser.add_argument("run_config", nargs="?", help="path of the run config JSON (as seen on this node)")
    parser.add_argument("--pool", metavar="DIR", help="serve as a warm pool: orders arrive in DIR/order.json")
    parser.add_argument("--runs", metavar="DIR", help="with --pool: where the runs' directories are on this node")
    parser.add_argument("--idle-timeout-s", type=float, default=IDLE_TIMEOUT_S,
                        help="with --pool: stop after this long without an order (default %(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    if bool(args.pool) == bool(args.run_config) or bool(args.pool) != bool(args.runs):
        parser.error("give RUN_CONFIG, or --pool DIR with --runs DIR")

    import torch  # noqa: F401  (imported before MPI, as every rank did before pools)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if args.pool:
        from .pool import serve_pool

        return serve_pool(comm, args.pool, args.runs, args.idle_timeout_s)
    from nodes.contracts.run_config import RunConfigError, load

    from .part_cache import PartCache
    from .run_one import run_one

    rank = comm.Get_rank()
    try:
        config = load(args.run_config)
    except RunConfigError as exc:  # a bad run config is bad input: said once, no traceback
        sys.stderr.write("rank %d: %s\n" % (rank, exc))
        return BAD_INPUT
    if comm.Get_size() != len(config.ranks):
        sys.stderr.write("run config lists %d ranks, mpiexec started %d\n" % (len(config.ranks), comm.Get_size()))
        return BAD_INPUT
    try:
        run_one(config, comm, rank, PartCache())
    except Exception:  # one rank's failure must end the run, not hang the others
        from . import mpi_link

        spec = config.ranks[rank]
        message = "rank %d (%s %s) failed:\n%s" % (rank, spec.role, spec.node, traceback.format_exc())
        mpi_link.abort(comm, NODE_FAILED, message, os.path.dirname(os.path.abspath(args.run_config)))
    return OK


if __name__ == "__main__":
    sys.exit(main())
