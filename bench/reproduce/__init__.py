"""Reproducing the five papers: each paper's experiments and headlines (one module a paper), the runner
that writes results with provenance, and the pages generated from them (``testbed reproduce``)."""

from __future__ import annotations

from bench.reproduce.registry import SCALES, Paper


def papers() -> dict[str, Paper]:
    """Every paper with a reproduction, by key."""
    from bench.reproduce import hat

    return {p.key: p for p in (hat.PAPER,)}


__all__ = ["SCALES", "Paper", "papers"]
