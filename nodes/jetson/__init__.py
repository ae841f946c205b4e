"""NVIDIA Jetson boards: tegrastats telemetry, and power modes through nvpmodel and jetson_clocks."""

from nodes.jetson.tegrastats import TegrastatsSample, parse_tegrastats

__all__ = ["TegrastatsSample", "parse_tegrastats"]
