"""Reproducing the five papers: each paper's experiments and headlines (one module a paper), the runner
that writes results with provenance, and the pages generated from them (``testbed reproduce``)."""

from __future__ import annotations

from bench.reproduce.registry import SCALES, Paper

KEYS = ("hat", "andes", "disco", "llms", "cocoserve")


def papers() -> dict[str, Paper]:
    """Every paper with a reproduction (a module of this package named by its key, with ``PAPER``), by key."""
    import importlib
    import importlib.util

    found = [k for k in KEYS if importlib.util.find_spec(f"bench.reproduce.{k}") is not None]
    return {k: importlib.import_module(f"bench.reproduce.{k}").PAPER for k in found}


__all__ = ["SCALES", "Paper", "papers"]
