"""Telemetry on the node: the row format every source emits, an append-only writer that loses
nothing on a crash, and the sampler process that runs a source detached from the SSH session.

Sources live with their hardware family (``nodes.jetson``, ``nodes.server``, ``nodes.android``,
``nodes.emulated``); :mod:`nodes.telemetry.sources` picks one by name.
"""
