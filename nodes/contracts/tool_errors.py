"""How every node tool (``python -m nodes.power``, ``nodes.telemetry.sampler``, ``nodes.workers``,
``nodes.installed``) fails, one scheme for all (standard library, Python 3.8): its answer on stdout is
JSON, ``{"error": "..."}`` when it failed, and its exit status says whose fault it was, as the
controller's own CLI does:

- ``OK`` (0): done;
- ``NODE_FAILED`` (1): the node, its hardware or a tool on it failed (the controller reports the node);
- ``BAD_INPUT`` (2): the command line or a file it was given is wrong (argparse exits 2 too).
"""

import json

OK = 0
NODE_FAILED = 1
BAD_INPUT = 2


class NodeToolError(Exception):
    """A failure a node tool reports as its JSON answer and ``NODE_FAILED``."""


def error_answer(error: BaseException) -> str:
    """The JSON line a tool prints when it failed: the error's type (unless it is ours) and message."""
    text = str(error) if isinstance(error, NodeToolError) else "%s: %s" % (type(error).__name__, error)
    return json.dumps({"error": text})
