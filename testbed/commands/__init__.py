"""How a command reaches a node: its context (transport, Python, folders, sudo, node code: ``node_context``)
and a plan's lines, each naming its node, phase and when it is sent (``planned``)."""
