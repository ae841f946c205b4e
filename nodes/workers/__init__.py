"""MPI worker entry points for split inference: server pipeline stages and device clients.

``python -m nodes.workers RUN_CONFIG`` is what ``mpiexec`` starts on every rank; the rank's place
in the run config says whether it is a server stage or a device.
"""
