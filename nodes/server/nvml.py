"""NVML through the ``nvidia-ml-py`` package (imported as ``pynvml``): loading it, its errors and names,
and which GPUs report averaged power. The source that samples it: :mod:`nodes.telemetry.nvml`; the power
driver: :mod:`nodes.power.server`."""

import re
from typing import Any, Optional

MB = 1024.0 * 1024.0


def load_pynvml() -> Any:
    try:
        import pynvml
    except ImportError:
        raise RuntimeError("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from None
    return pynvml


def text(value: Any) -> str:
    """NVML strings are bytes before nvidia-ml-py 11.515 and str after."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def nvml_error(nvml: Any, exc: Exception) -> str:
    return "%s (NVML error %s)" % (str(exc) or type(exc).__name__, getattr(exc, "value", "?"))


NVML_DEVICE_ARCH_AMPERE = 7  # nvmlDeviceGetArchitecture: 5 Volta, 6 Turing, 7 Ampere, 8 Ada, 9 Hopper, 10 Blackwell
_GA100 = re.compile(r"\bA(100|30)\b")  # the Ampere parts whose power reading is still instantaneous
_PRE_AMPERE = re.compile(
    r"\b(K\d+|M\d+|P\d+|V100|T4|TITAN (V|RTX|XP?)|GTX (9|10|16)\d\d|RTX 20[5-9]0|QUADRO (RTX|P|GV|M|K))"
)


def averaged_power(name: str, architecture: Optional[int] = None) -> bool:
    """Whether nvmlDeviceGetPowerUsage is a 1 s average: Ampere and newer, except GA100 (A100, A30),
    which like every older GPU reports an instantaneous value. ``architecture`` is NVML's
    (``nvmlDeviceGetArchitecture``); without it the product name decides."""
    upper = name.upper()
    if _GA100.search(upper):
        return False
    if architecture is not None:
        return architecture >= NVML_DEVICE_ARCH_AMPERE
    return not _PRE_AMPERE.search(upper)
