"""A compact Llama-family inference engine in plain torch.

- ``config``: the model's hyper-parameters, read from a Hugging Face ``config.json``.
- ``rope``: rotary position embeddings with the usual scaling options.
- ``kv_cache``: one sequence's keys and values, with append and truncate (rollback).
- ``model``: the layers, and a model part that holds any subset of them (a partition's share).
- ``checkpoint``: loading and saving Hugging Face format checkpoints (safetensors).
- ``tokenizer``: ``tokenizer.json`` through the ``tokenizers`` library.
- ``partition``: the U-shaped split between a device and the server's pipeline stages.
- ``generate``: greedy generation in one process, the reference every split method must match.

torch is imported here, so this package is for workers, not for the controller.
"""
