"""What a method is to the testbed: one object, registered by name (see ``__init__``), that says how
the device and the server behave for it, checks its own settings, and tells the report what to show.

The engine composes behaviours that a method names, instead of testing method names:

- ``prefill``: ``whole`` (the device sends the prompt's states at once), ``device_chunks`` (the device
  sizes chunks from the server's state, HAT Eq. 3) or ``server_chunks`` (the server prefills in chunks
  of ``chunk_tokens``, Sarathi's budget);
- ``decode``: ``token`` (one token per round trip), ``speculative`` (the device drafts with the adapter,
  the server verifies, HAT Sec. 3.4) or ``speculative_parallel`` (and drafts ahead while it waits, Eq. 6);
- ``token_ids_only``: the device sends token ids and the server runs the whole model (no split);
- ``server_state_in_replies``: the server's replies carry its state (mu, g), which the device sizes with;
- ``streams``: the device is a client (prompt ids up, tokens streamed down through its token buffer)
  and the server is a serving engine that generates on its own under a KV budget and a scheduler;
- ``dispatches``: the device runs the whole model behind its own endpoint and dispatches each request
  between it and the server's endpoint (OpenAI-compatible HTTP over the data plane; DiSCo);
- ``serves_contexts``: the device runs the on-device LLM service, started by the run plan, and its
  apps replay a context-switching trace against it (LLMS); the server idles;
- ``gpu_ranks``: the server's stage ranks are its GPUs: the streaming engine runs on the first, with
  every decoder layer, and the others hold the layer copies it places there (CoCoServe);
- ``batching``: ``continuous`` (the engine's scheduler admits and preempts every iteration) or
  ``static`` (a fixed batch runs to its end before the next starts, memory unchecked: Transformers'
  ``generate``, whose out-of-memory fails requests);
- ``autoscales``: the engine's controller replicates and migrates layers and scales down under load
  (CoCoServe Algorithms 1 and 2).

Standard library only, Python 3.8: the controller imports the registry to validate campaigns.
"""

import json
import os
from typing import Iterator, NamedTuple, Optional, Tuple

from nodes.contracts.draft import default_adapter_dir

Problem = Tuple[str, str, str]  # (settings field, what is wrong, how to fix it)

PREFILL = ("whole", "device_chunks", "server_chunks")
DECODE = ("token", "speculative", "speculative_parallel")


class MethodCheck(NamedTuple):
    """What a method's settings are checked against: the model's depth and the run's partition."""

    model: str  # as the campaign writes it (for hints)
    model_dir: str  # resolved
    layers: int
    device_layers: int
    stages: int
    adapter: Optional[str] = None  # the run's draft.adapter, resolved; None: the default


class Method(object):
    """A method's behaviours, checks and report hints. Subclass it (or instantiate it) in one module
    under ``nodes/contracts/methods/`` and add that module to the registry."""

    name = ""
    summary = ""
    prefill = "whole"
    decode = "token"
    token_ids_only = False
    server_state_in_replies = False
    streams = False
    dispatches = False
    serves_contexts = False
    gpu_ranks = False
    batching = "continuous"
    autoscales = False
    report_notes: Tuple[str, ...] = ()  # what the report shows for it, in words

    def __init__(self, **traits: object) -> None:
        for key, value in traits.items():
            if not hasattr(type(self), key):
                raise TypeError("a method has no trait %r" % key)
            setattr(self, key, value)
        if self.prefill not in PREFILL or self.decode not in DECODE or self.batching not in ("continuous", "static"):
            raise ValueError("method %s: prefill must be one of %s, decode one of %s" % (self.name, PREFILL, DECODE))

    def __repr__(self) -> str:
        return "<method %s: prefill %s, decode %s>" % (self.name, self.prefill, self.decode)

    def describe(self) -> dict:
        """The method as a run's manifest records it (the report reads its notes from there)."""
        return {"name": self.name, "summary": self.summary, "prefill": self.prefill, "decode": self.decode,
                "token_ids_only": self.token_ids_only, "server_state_in_replies": self.server_state_in_replies,
                "streams": self.streams, "dispatches": self.dispatches, "serves_contexts": self.serves_contexts,
                "gpu_ranks": self.gpu_ranks, "batching": self.batching, "autoscales": self.autoscales,
                "report_notes": list(self.report_notes)}

    @property
    def drafts(self) -> bool:
        """It decodes speculatively, with the draft adapter (HAT Sec. 3.4)."""
        return self.decode != "token"

    def uses(self, feature: str) -> bool:
        """HAT's vocabulary: ``sd`` speculative decoding, ``pc`` prompt chunking, ``pd`` parallel drafting."""
        return {
            "sd": self.drafts,
            "pc": self.prefill == "device_chunks",
            "pd": self.decode == "speculative_parallel",
        }.get(feature, False)

    def server_layers(self, layers: int, device_layers: int) -> int:
        """The decoder layers the server runs: all of them without a split, else the ones after the
        device's ``m`` (the device runs layers 0..m-1 and the head)."""
        return layers if self.token_ids_only else layers - device_layers

    def problems(self, check: MethodCheck) -> Iterator[Problem]:
        """The run's settings that do not work with this method (the partition, and the draft adapter
        of a drafting method)."""
        m, stages = check.device_layers, check.stages
        if self.gpu_ranks:  # the stages are the server's GPUs; the engine runs every layer on the first
            return
        if (self.streams or self.dispatches or self.serves_contexts) and stages != 1:
            yield ("partition.stages", "%s serves the whole model from one engine rank, not %d stages"
                   % (self.name, stages), "set partition.stages: 1 (serving.tensor_parallel models several GPUs)")
            return
        server_layers = self.server_layers(check.layers, m)
        if not self.token_ids_only and server_layers < 1:
            yield ("partition.device_layers", "%d device layers leave the server none of %d" % (m, check.layers),
                   "use at most %d" % (check.layers - 1))
        elif stages > server_layers:
            yield "partition.stages", "%d stages for %d server layers" % (stages, server_layers), \
                "use at most %d" % server_layers
        if self.drafts:
            for problem in self.adapter_problems(check):
                yield problem

    def adapter_problems(self, check: MethodCheck) -> Iterator[Problem]:
        """A drafting method needs an adapter trained on the output of the run's m device layers."""
        field = "draft.adapter" if check.adapter else "method"
        directory = check.adapter or default_adapter_dir(check.model_dir)
        config = os.path.join(directory, "adapter_config.json")
        m = check.device_layers
        train = "train one: python scripts/train_draft.py --model %s --device-layers %d" % (check.model, m)
        if not os.path.isfile(config):
            yield field, "%s drafts with an adapter, and %s has no adapter_config.json" % (self.name, directory), train
            return
        try:
            with open(config, encoding="utf-8") as handle:
                trained_for = int(json.load(handle)["device_layers"])
        except (ValueError, KeyError, TypeError):
            yield field, "%s: no device_layers" % config, train
            return
        if trained_for != m:
            yield ("partition.device_layers",
                   "the draft adapter in %s was trained on %d device layers, not %d" % (directory, trained_for, m),
                   train)
