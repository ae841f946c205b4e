"""The node side of the emulated testbed: CPU quotas of a node's cgroup, the modeled power of its
power modes, and the stand-in Jetson tools (``nvpmodel``, ``jetson_clocks``, ``tegrastats``) that
print what the real tools print on the board the node stands for.

Runs inside an emulated node (Python 3.8 compatible, standard library only).
"""
