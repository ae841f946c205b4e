"""LLMS (LLM as a system service on mobile devices): every device runs the on-device LLM service
(``nodes.context_service``) that the run plan starts before the workers and stops at restore; the
device rank replays the run's context-switching trace through app processes of its own, each a client
of the service holding its share of the contexts. The server takes no part (its rank idles).

The service's memory method is a setting (``context_service.memory``): LLMS itself, the paper's
baselines, or LLMS without one of its techniques (Fig. 13)."""

from .base import Method

# LLMS and its baselines and ablations as settings of one context memory (context_memory.baseline_settings)
CONTEXT_MEMORY_METHODS = ("llms", "lmk", "swapping", "vllm-s", "vllm-sq", "llms-no-lifecycle", "llms-lru",
                          "llms-no-compression", "llms-no-pipeline")  # fmt: skip
# the uncompressed ones hold float16 caches (the paper quantizes only in VLLM-SQ and LLMS)
FLOAT16_CONTEXT_MEMORY = ("lmk", "swapping", "vllm-s")

METHODS = (
    Method(
        name="llms",
        summary="LLMS: an on-device LLM service whose apps switch between contexts (chunked, compressed, swapped KV)",
        token_ids_only=True,
        serves_contexts=True,
        report_notes=("mean context-switching latency against active contexts, per pattern and memory method "
                      "(LLMS Fig. 9), and what each switch read, recomputed and wrote",),
    ),
)
