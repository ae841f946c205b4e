"""Telemetry on the node: the row format every source emits, an append-only writer that loses
nothing on a crash, and the sampler process that runs a source detached from the SSH session.

One module per source (tegrastats, jtop, nvml, host, battery, modeled_power), each reading its hardware's
formats from the family's package (``nodes.jetson``, ``nodes.server``, ``nodes.android``,
``nodes.emulated``); :mod:`nodes.telemetry.sources` picks them by name.
"""
