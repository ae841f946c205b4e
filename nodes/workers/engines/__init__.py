"""The serving engines on the server's ranks: Andes' streaming engine under a KV budget and a scheduler
(``serving_engine``), CoCoServe's engine over GPU ranks that hold layer copies (``scaling_engine``,
``layer_ranks``, ``module_transfer``), and the OpenAI-compatible endpoint in front of the engine for
DiSCo (``engine_endpoint``)."""
