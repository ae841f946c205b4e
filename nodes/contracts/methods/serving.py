"""Centralized serving with streaming (Andes Sec. 5, vLLM's engine): every device is a client that
sends a request's prompt ids with its QoE expectation and receives each token as the server produces
it, through a token buffer that shows them at the request's expected speed. The server is one engine
rank running the whole model: continuous batching under a KV budget, preemption by swap or recompute,
and the scheduler the run's ``serving.scheduler`` names (``nodes.serving.schedulers``)."""

from .base import Method

METHODS = (
    Method(
        name="serving",
        summary="centralized serving: clients stream tokens through a buffer; the engine schedules under a KV budget",
        token_ids_only=True,
        streams=True,
        report_notes=("QoE (Andes Eq. 1) per request, preemptions, and the buffered display timeline",),
    ),
)
