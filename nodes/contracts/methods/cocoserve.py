"""CoCoServe (module-level scaling of LLM serving) and its two baselines, as streaming methods whose
server stages are GPUs: the engine on the first GPU runs every decoder layer, under each GPU's memory
budget (weights + KV, ``scaling.gpu_memory_bytes``), and the other GPUs' ranks hold the layer copies
it places there (``nodes.workers.engines.scaling_engine``).

- ``cocoserve``: continuous batching with the scaling controller: replicas added by Algorithm 1 when
  GPUs are idle, Algorithm 2's migrate / evict / reduce-and-offload when requests miss their SLO;
- ``continuous-batching``: the same engine without scaling (every layer stays on the first GPU);
- ``static-batching``: a fixed batch (``serving.max_batch``) run to its end before the next, memory
  unchecked at admission: a batch that outgrows the GPU fails its newest requests (out of memory),
  as Transformers' ``generate`` does (the paper's HF baseline)."""

from .base import Method

GPU_NOTES = ("throughput, E2E latency, SLO attainment and out-of-memory rate against load; GPU memory used; "
             "the scaling controller's actions and each module operation's time and bytes (CoCoServe Sec. 6)",)

METHODS = (
    Method(
        name="cocoserve",
        summary="CoCoServe: continuous batching whose decoder layers are replicated and migrated across GPUs",
        token_ids_only=True, streams=True, gpu_ranks=True, autoscales=True, report_notes=GPU_NOTES,
    ),
    Method(
        name="continuous-batching",
        summary="continuous batching on one GPU under its memory budget, no module scaling (CoCoServe's baseline)",
        token_ids_only=True, streams=True, gpu_ranks=True, report_notes=GPU_NOTES,
    ),
    Method(
        name="static-batching",
        summary="static batching: a fixed batch run to its end, out-of-memory fails requests (the HF baseline)",
        token_ids_only=True, streams=True, gpu_ranks=True, batching="static", report_notes=GPU_NOTES,
    ),
)
