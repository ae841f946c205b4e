"""NVIDIA Jetson boards: the formats of their tools (tegrastats lines, nvpmodel's answers). The source
that reads tegrastats is :mod:`nodes.telemetry.tegrastats`, the power driver :mod:`nodes.power.jetson`."""

from nodes.jetson.tegrastats import TegrastatsSample, parse_tegrastats

__all__ = ["TegrastatsSample", "parse_tegrastats"]
