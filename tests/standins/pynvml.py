"""Stand-in for nvidia-ml-py's ``pynvml`` (13.615.71 names and semantics) on machines without an
NVIDIA GPU. Load it from this path with importlib (tests pass it as ``nvml=``); every load is a
fresh module, so each test configures its own simulated GPUs:

    nvml.GPUS = [nvml.FakeGpu("NVIDIA RTX A6000"), nvml.FakeGpu("Tesla V100-SXM2-16GB")]
    nvml.ROOT = False          # setters answer NVMLError_NoPermission, as for a non-root user
    nvml.INIT_ERROR = nvml.NVML_ERROR_LIBRARY_NOT_FOUND   # nvmlInit fails, as without a driver

What it copies from the real module: ``NVMLError(code)`` returns the subclass for the code (made from
the ``NVML_ERROR_*`` names as pynvml's ``_extractNVMLErrorsAsClasses`` does), each with ``.value``
and the library's error text as ``str()``; calls before ``nvmlInit`` raise Uninitialized; names are
``str`` (``NAMES_AS_BYTES`` gives the ``bytes`` of nvidia-ml-py before 11.515); energy in mJ since
the driver loaded (NotSupported before Volta), power and limits in mW, memory in bytes, clocks in
MHz; setters need root and refuse a limit outside the constraints with InvalidArgument.
"""

import string

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_UNKNOWN = 999

NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_TEMPERATURE_GPU = 0

nvmlClocksEventReasonGpuIdle = 0x0000000000000001
nvmlClocksEventReasonSwPowerCap = 0x0000000000000004
nvmlClocksEventReasonHwSlowdown = 0x0000000000000008
nvmlClocksEventReasonSwThermalSlowdown = 0x0000000000000020
nvmlClocksEventReasonNone = 0x0000000000000000
nvmlClocksThrottleReasonGpuIdle = nvmlClocksEventReasonGpuIdle
nvmlClocksThrottleReasonSwPowerCap = nvmlClocksEventReasonSwPowerCap

# What nvmlErrorString answers for the codes (the driver's texts).
_ERROR_TEXT = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
    NVML_ERROR_INSUFFICIENT_POWER: "Insufficient External Power",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_IRQ_ISSUE: "Interrupt Request Issue",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_CORRUPTED_INFOROM: "Corrupted infoROM",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    NVML_ERROR_OPERATING_SYSTEM: "The operating system has blocked the request.",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
    NVML_ERROR_IN_USE: "In use by another client",
    NVML_ERROR_MEMORY: "Insufficient Memory",
    NVML_ERROR_NO_DATA: "No data",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    _valClassMapping = {}  # noqa: RUF012 - the real module's class attribute

    def __new__(typ, value):
        """``NVMLError(code)`` returns an instance of the subclass for the code."""
        if typ == NVMLError:
            typ = NVMLError._valClassMapping.get(value, typ)
        obj = Exception.__new__(typ)
        obj.value = value
        return obj

    def __str__(self):
        return _ERROR_TEXT.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other):
        return self.value == other.value


def nvmlExceptionClass(nvmlErrorCode):
    if nvmlErrorCode not in NVMLError._valClassMapping:
        raise ValueError(f"nvmlErrorCode {nvmlErrorCode} is not valid")
    return NVMLError._valClassMapping[nvmlErrorCode]


def _extractNVMLErrorsAsClasses():
    """NVML_ERROR_NOT_SUPPORTED -> class NVMLError_NotSupported(NVMLError), as pynvml makes them."""
    this_module = globals()
    for err_name in [name for name in list(this_module) if name.startswith("NVML_ERROR_")]:
        class_name = "NVMLError_" + string.capwords(err_name.replace("NVML_ERROR_", ""), "_").replace("_", "")
        err_val = this_module[err_name]

        def gen_new(val):
            def new(typ, *args):
                return NVMLError.__new__(typ, val)

            return new

        new_error_class = type(class_name, (NVMLError,), {"__new__": gen_new(err_val)})
        new_error_class.__module__ = __name__
        this_module[class_name] = new_error_class
        NVMLError._valClassMapping[err_val] = new_error_class


_extractNVMLErrorsAsClasses()


class c_nvmlUtilization_t:
    def __init__(self, gpu, memory):
        self.gpu = gpu
        self.memory = memory


class c_nvmlMemory_t:
    def __init__(self, total, free, used):
        self.total = total
        self.free = free
        self.used = used


class c_nvmlDevice_t:
    """A handle: which simulated GPU it points to."""

    def __init__(self, index):
        self.index = index


class FakeGpu:
    """One simulated GPU's readings and settings. ``energy_mj=None`` makes the energy counter
    NotSupported (GPUs before Volta); tests change the attributes between samples."""

    def __init__(
        self,
        name,
        energy_mj=1000000,
        power_mw=100000,
        util_gpu=0,
        util_memory=0,
        memory_used_bytes=0,
        memory_total_bytes=48 * 1024**3,
        sm_clock_mhz=210,
        max_sm_clock_mhz=2100,
        temperature_c=40,
        clocks_event_reasons=nvmlClocksEventReasonGpuIdle,
        power_limit_mw=300000,
        default_limit_mw=300000,
        limit_constraints_mw=(100000, 300000),
    ):
        self.name = name
        self.energy_mj = energy_mj
        self.power_mw = power_mw
        self.util_gpu = util_gpu
        self.util_memory = util_memory
        self.memory_used_bytes = memory_used_bytes
        self.memory_total_bytes = memory_total_bytes
        self.sm_clock_mhz = sm_clock_mhz
        self.max_sm_clock_mhz = max_sm_clock_mhz
        self.temperature_c = temperature_c
        self.clocks_event_reasons = clocks_event_reasons
        self.power_limit_mw = power_limit_mw
        self.default_limit_mw = default_limit_mw
        self.limit_constraints_mw = limit_constraints_mw
        self.locked_clocks_mhz = None  # (min, max) after nvmlDeviceSetGpuLockedClocks


# Configuration, per loaded module.
GPUS = []
ROOT = True
INIT_ERROR = None  # an NVML_ERROR_* code that nvmlInit raises
NAMES_AS_BYTES = False
DRIVER_VERSION = "550.54.15"
# Bookkeeping the tests read.
calls = []  # (function name, gpu index, arguments...) of every call that changes a setting
reads = {}  # function name -> how many times it was called
_init_count = 0


def _count(function):
    reads[function] = reads.get(function, 0) + 1


def _initialised():
    if _init_count <= 0:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)


def _gpu(handle):
    _initialised()
    if not isinstance(handle, c_nvmlDevice_t) or not 0 <= handle.index < len(GPUS):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return GPUS[handle.index]


def _privileged():
    if not ROOT:
        raise NVMLError(NVML_ERROR_NO_PERMISSION)


def _text(value):
    return value.encode() if NAMES_AS_BYTES else value


def nvmlInit():
    global _init_count
    if INIT_ERROR is not None:
        raise NVMLError(INIT_ERROR)
    _init_count += 1


def nvmlInitWithFlags(flags):
    nvmlInit()


def nvmlShutdown():
    global _init_count
    _initialised()
    _init_count -= 1


def nvmlSystemGetDriverVersion():
    _initialised()
    return _text(DRIVER_VERSION)


def nvmlDeviceGetCount():
    _initialised()
    return len(GPUS)


def nvmlDeviceGetHandleByIndex(index):
    _initialised()
    if not 0 <= index < len(GPUS):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return c_nvmlDevice_t(index)


def nvmlDeviceGetName(handle):
    return _text(_gpu(handle).name)


def nvmlDeviceGetTotalEnergyConsumption(handle):
    """mJ since the driver was last reloaded; Volta and newer."""
    gpu = _gpu(handle)
    _count("nvmlDeviceGetTotalEnergyConsumption")
    if gpu.energy_mj is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return gpu.energy_mj


def nvmlDeviceGetPowerUsage(handle):
    _count("nvmlDeviceGetPowerUsage")
    return _gpu(handle).power_mw


def nvmlDeviceGetUtilizationRates(handle):
    gpu = _gpu(handle)
    return c_nvmlUtilization_t(gpu.util_gpu, gpu.util_memory)


def nvmlDeviceGetMemoryInfo(handle, version=None):
    gpu = _gpu(handle)
    return c_nvmlMemory_t(gpu.memory_total_bytes, gpu.memory_total_bytes - gpu.memory_used_bytes, gpu.memory_used_bytes)


def nvmlDeviceGetClockInfo(handle, type):
    gpu = _gpu(handle)
    if type != NVML_CLOCK_SM:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # this stand-in simulates the SM clock only
    return gpu.sm_clock_mhz


def nvmlDeviceGetMaxClockInfo(handle, type):
    gpu = _gpu(handle)
    if type != NVML_CLOCK_SM:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return gpu.max_sm_clock_mhz


def nvmlDeviceGetTemperature(handle, sensor):
    gpu = _gpu(handle)
    if sensor != NVML_TEMPERATURE_GPU:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return gpu.temperature_c


def nvmlDeviceGetCurrentClocksEventReasons(handle):
    return _gpu(handle).clocks_event_reasons


def nvmlDeviceGetCurrentClocksThrottleReasons(handle):
    """DEPRECATED in pynvml; the same bitmask."""
    return _gpu(handle).clocks_event_reasons


def nvmlDeviceGetPowerManagementLimit(handle):
    return _gpu(handle).power_limit_mw


def nvmlDeviceGetPowerManagementLimitConstraints(handle):
    low, high = _gpu(handle).limit_constraints_mw
    return [low, high]


def nvmlDeviceGetPowerManagementDefaultLimit(handle):
    return _gpu(handle).default_limit_mw


def nvmlDeviceGetEnforcedPowerLimit(handle):
    return _gpu(handle).power_limit_mw


def nvmlDeviceSetPowerManagementLimit(handle, limit):
    gpu = _gpu(handle)
    _privileged()
    low, high = gpu.limit_constraints_mw
    if not low <= limit <= high:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    calls.append(("nvmlDeviceSetPowerManagementLimit", handle.index, limit))
    gpu.power_limit_mw = limit


def nvmlDeviceSetGpuLockedClocks(handle, minGpuClockMHz, maxGpuClockMHz):
    gpu = _gpu(handle)
    _privileged()
    if minGpuClockMHz > maxGpuClockMHz:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    calls.append(("nvmlDeviceSetGpuLockedClocks", handle.index, minGpuClockMHz, maxGpuClockMHz))
    gpu.locked_clocks_mhz = (minGpuClockMHz, maxGpuClockMHz)


def nvmlDeviceResetGpuLockedClocks(handle):
    gpu = _gpu(handle)
    _privileged()
    calls.append(("nvmlDeviceResetGpuLockedClocks", handle.index))
    gpu.locked_clocks_mhz = None
