"""Where a checkpoint's draft adapter (HAT Sec. 3.4) lives unless a run names another: ``<model>/draft``
(``adapter.safetensors`` and ``adapter_config.json``). One definition for the controller (campaign
checks, run configs) and the nodes (workers, the training script)."""

import os


def default_adapter_dir(model_dir: str) -> str:
    return os.path.join(model_dir.rstrip("/"), "draft")
