"""Request ids in a run's schedules: unique across the run's devices, ``device index * STRIDE + i``,
so a record names its device's request without a second key. Defined once for the schedules the
controller writes and the ids ``testbed workers run`` gives a shared schedule."""

REQUEST_ID_STRIDE = 1_000_000


def request_id(device_index: int, number: int) -> int:
    """The id of request ``number`` (0-based, or as a schedule gives it) of device ``device_index``."""
    if not 0 <= number < REQUEST_ID_STRIDE:
        raise ValueError("a device's request number must lie in [0, %d), not %d" % (REQUEST_ID_STRIDE, number))
    return device_index * REQUEST_ID_STRIDE + number
