"""DiSCo (device-server cooperative streaming): every device runs the whole model behind its own
endpoint and dispatches each request between it and the server's endpoint by the run's policy
(``dispatch.policy``: DiSCo-S / DiSCo-D, Algorithms 1-3, their Stoch baselines, or one endpoint only),
racing both where the policy says and cancelling the loser, and migrating the stream by token ids
when Eq. 4 pays (``dispatch.migration``). The server node serves an OpenAI-compatible endpoint whose
times replay a service's trace (``dispatch.service``); HTTP runs over the shaped data plane."""

from .base import Method

METHODS = (
    Method(
        name="disco",
        summary="DiSCo: the device races its own endpoint and the server's by a cost-aware policy, with migration",
        token_ids_only=True,
        dispatches=True,
        report_notes=("TTFT mean and P99 against the budget, the realised budget, cost and migrations (DiSCo Sec. 5)",),
    ),
)
