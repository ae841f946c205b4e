"""``python -m nodes.workers RUN_CONFIG``: the program ``mpiexec`` starts on every rank.

The rank's entry in the run config says what it is: a server pipeline stage or a device. All ranks
meet at a start barrier; each takes its clock origin there.
"""

import argparse
import os
import sys
import time
import traceback

from nodes.contracts.tool_errors import BAD_INPUT, NODE_FAILED, OK


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nodes.workers", description=__doc__)
    parser.add_argument("run_config", help="path of the run config JSON (as seen on this node)")
    args = parser.parse_args(argv)

    import torch
    from mpi4py import MPI

    from .run_config import RunConfigError, load

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    try:
        config = load(args.run_config)
    except RunConfigError as exc:  # a bad run config is bad input: said once, no traceback
        sys.stderr.write("rank %d: %s\n" % (rank, exc))
        return BAD_INPUT
    if comm.Get_size() != len(config.ranks):
        sys.stderr.write("run config lists %d ranks, mpiexec started %d\n" % (len(config.ranks), comm.Get_size()))
        return BAD_INPUT
    spec = config.ranks[rank]
    torch.manual_seed(config.seed)
    torch.set_num_threads(spec.threads or 1)
    os.makedirs(config.rank_dir(rank), exist_ok=True)
    try:
        if spec.role == "stage":
            from .server_stage import ServerStage

            worker = ServerStage(config, comm, rank)
        else:
            from .device import DeviceWorker

            worker = DeviceWorker(config, comm, rank)
        comm.Barrier()
        worker.start(time.monotonic())
        if spec.role == "stage":
            worker.serve()
        else:
            worker.run()
        comm.Barrier()
    except Exception:  # one rank's failure must end the run, not hang the others
        sys.stderr.write("rank %d (%s %s) failed:\n%s" % (rank, spec.role, spec.node, traceback.format_exc()))
        sys.stderr.flush()
        comm.Abort(NODE_FAILED)
    return OK


if __name__ == "__main__":
    sys.exit(main())
