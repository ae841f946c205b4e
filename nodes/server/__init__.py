"""The GPU server: NVML's bindings and names. Its sources are :mod:`nodes.telemetry.nvml` and
:mod:`nodes.telemetry.host` (the host's CPUs and RAPL domains), its power driver :mod:`nodes.power.server`."""
