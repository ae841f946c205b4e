"""LLMS (LLM as a system service on mobile devices): the node-side context service.

One model, owned by a daemon on the device, serves apps' contexts; each context's KV cache lives in
chunks of 16 tokens across all layers, compressed by tolerance (LLMS Sec. 3.2), swapped and
recomputed in a pipeline (Sec. 3.3) and evicted by an LCTRU queue (Sec. 3.4). The planning pieces
(compression levels, the load plan, the eviction order) are pure and standard-library only.
"""
