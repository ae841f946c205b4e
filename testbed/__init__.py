"""Controller side of the hardware-in-the-loop testbed: inventory, transports, fan-out, CLI.

The controller never imports torch; node-side code lives in ``nodes/`` and is reached over a
transport.
"""

__version__ = "0.1.0"
