"""GPU telemetry (NvmlSource) and GPU power control (NvmlPower) against a stand-in for
nvidia-ml-py's ``pynvml`` (tests/standins/pynvml.py: the real module's names, error classes and
units, with simulated GPUs), since this machine has no NVIDIA GPU."""

import importlib.util
from pathlib import Path

import pytest

from nodes.power.common import PowerError, PowerModeInfo
from nodes.power.server import NvmlPower
from nodes.server.nvml import averaged_power, text
from nodes.telemetry.nvml import NvmlSource

STANDIN = Path(__file__).resolve().parent / "standins" / "pynvml.py"
GIB = 1024**3


def load_fake_pynvml():
    """A fresh copy of the stand-in (its own GPUs and settings), not put on sys.path."""
    spec = importlib.util.spec_from_file_location("pynvml", STANDIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def nvml():
    return load_fake_pynvml()


def a6000(nvml, **settings):
    defaults = {"power_limit_mw": 300000, "default_limit_mw": 300000, "limit_constraints_mw": (100000, 300000)}
    return nvml.FakeGpu("NVIDIA RTX A6000", **{**defaults, **settings})


def v100(nvml, **settings):
    defaults = {"power_limit_mw": 300000, "default_limit_mw": 300000, "limit_constraints_mw": (150000, 300000)}
    return nvml.FakeGpu("Tesla V100-SXM2-16GB", **{**defaults, **settings})


def by_key(rows):
    keyed = {(r.metric, r.sensor): r for r in rows}
    assert len(keyed) == len(rows)
    return keyed


# --- the stand-in behaves like pynvml ------------------------------------------------------------


def test_standin_error_classes_like_pynvml(nvml):
    error = nvml.NVMLError(nvml.NVML_ERROR_NOT_SUPPORTED)
    assert type(error) is nvml.NVMLError_NotSupported
    assert isinstance(error, nvml.NVMLError)
    assert (error.value, str(error)) == (3, "Not Supported")
    denied = nvml.NVMLError_NoPermission()
    assert (denied.value, str(denied)) == (4, "Insufficient Permissions")
    assert nvml.nvmlExceptionClass(12) is nvml.NVMLError_LibraryNotFound
    with pytest.raises(nvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()


def test_standin_copies_are_independent():
    first, second = load_fake_pynvml(), load_fake_pynvml()
    first.GPUS.append(first.FakeGpu("NVIDIA RTX A6000"))
    assert second.GPUS == []


# --- NvmlSource ------------------------------------------------------------------------------------


def test_energy_is_the_counter_difference_since_the_first_sample(nvml):
    nvml.GPUS = [a6000(nvml, energy_mj=5000000), v100(nvml, energy_mj=123456789)]
    source = NvmlSource(0.5, nvml=nvml)
    first = by_key(source.sample(100.0))
    assert first[("energy_mj", "gpu0")].value == 0.0
    assert first[("energy_mj", "gpu1")].value == 0.0
    nvml.GPUS[0].energy_mj = 5000750
    nvml.GPUS[1].energy_mj = 123456789 + 40
    second = by_key(source.sample(100.5))
    assert second[("energy_mj", "gpu0")].value == 750.0
    assert second[("energy_mj", "gpu1")].value == 40.0
    nvml.GPUS[0].energy_mj = 5002000
    third = by_key(source.sample(101.0))
    assert third[("energy_mj", "gpu0")].value == 2000.0  # since the first sample, not the last
    assert (third[("energy_mj", "gpu0")].unit, third[("energy_mj", "gpu0")].kind) == ("mJ", "measured")
    source.close()


def test_gpu_readings_in_named_units(nvml):
    nvml.GPUS = [
        a6000(
            nvml,
            power_mw=231500,
            util_gpu=87,
            util_memory=41,
            memory_used_bytes=3 * GIB,
            sm_clock_mhz=1800,
            temperature_c=71,
            clocks_event_reasons=nvml.nvmlClocksEventReasonSwPowerCap,
        )
    ]
    source = NvmlSource(0.5, nvml=nvml)
    assert source.header == {"gpus": [{"sensor": "gpu0", "name": "NVIDIA RTX A6000"}], "driver": "550.54.15"}
    rows = by_key(source.sample(7.0))
    expected = {
        ("power_mw", "gpu0"): (231500.0, "mW"),
        ("gpu_util_pct", "gpu0"): (87.0, "%"),
        ("mem_util_pct", "gpu0"): (41.0, "%"),
        ("mem_used_mb", "gpu0"): (3072.0, "MB"),
        ("sm_clock_mhz", "gpu0"): (1800.0, "MHz"),
        ("temp_c", "gpu0"): (71.0, "C"),
        ("clock_event_reasons", "gpu0"): (4.0, "bitmask"),
        ("energy_mj", "gpu0"): (0.0, "mJ"),
    }
    assert {key: (row.value, row.unit) for key, row in rows.items()} == expected
    assert {row.ts_s for row in rows.values()} == {7.0}
    assert source.problems == []
    source.close()


def test_power_period_one_second_on_ampere_sample_interval_on_volta(nvml):
    nvml.GPUS = [a6000(nvml), v100(nvml)]
    source = NvmlSource(0.25, nvml=nvml)
    rows = by_key(source.sample(1.0))
    assert rows[("power_mw", "gpu0")].period_s == 1.0  # Ampere: NVML's 1 s average
    assert rows[("power_mw", "gpu1")].period_s == 0.25  # Volta: instantaneous
    assert rows[("temp_c", "gpu0")].period_s == 0.25
    source.close()


@pytest.mark.parametrize(
    ("name", "averaged"),
    [
        ("NVIDIA RTX A6000", True),  # GA102
        ("NVIDIA A10", True),  # GA102
        ("NVIDIA GeForce RTX 3090", True),
        ("NVIDIA H100 80GB HBM3", True),
        ("NVIDIA L40S", True),
        ("NVIDIA GeForce RTX 4090", True),
        ("NVIDIA RTX 2000 Ada Generation", True),  # AD107 (Ada), not an RTX 20 series Turing
        ("Tesla V100-SXM2-16GB", False),
        ("NVIDIA A100-SXM4-80GB", False),  # GA100
        ("NVIDIA A30", False),  # GA100 as well
        ("Tesla T4", False),
        ("Tesla P100-PCIE-16GB", False),
        ("Quadro RTX 8000", False),
        ("NVIDIA GeForce RTX 2080 Ti", False),
        ("NVIDIA GeForce GTX 1660 SUPER", False),  # Turing (TU116)
        ("NVIDIA TITAN V", False),
    ],
)
def test_averaged_power_by_architecture(name, averaged):
    """NVML: "On Ampere (except GA100) or newer GPUs, the API returns power averaged over 1 sec
    interval. On GA100 and older architectures, instantaneous power is returned." """
    assert averaged_power(name) is averaged


def test_pre_volta_energy_not_supported_reported_once_power_still_works(nvml):
    nvml.GPUS = [nvml.FakeGpu("Tesla P100-PCIE-16GB", energy_mj=None, power_mw=41000)]
    source = NvmlSource(0.02, nvml=nvml)
    statuses = {(s.metric, s.sensor): s for s in source.probe(interval_s=0.02, batches=3)}
    energy = statuses[("energy_mj", "gpu0")]
    assert energy.value is None
    assert not energy.ok
    assert "Not Supported" in energy.problem
    assert "3" in energy.problem  # NVML's error code
    assert statuses[("power_mw", "gpu0")].value == 41000.0
    assert statuses[("power_mw", "gpu0")].ok
    assert [p for p in source.problems if p[0] == "energy_mj"] == [
        ("energy_mj", "gpu0", "Not Supported (NVML error 3)")
    ]
    assert nvml.reads["nvmlDeviceGetTotalEnergyConsumption"] == 1  # not asked again after NotSupported
    assert nvml.reads["nvmlDeviceGetPowerUsage"] == 3
    source.close()


def test_no_gpu_is_a_problem(nvml):
    source = NvmlSource(0.5, nvml=nvml)
    assert source.problems == [("power_mw", "gpu", "NVML sees no GPU")]
    assert source.sample(1.0) == []
    source.close()


def test_older_pynvml_throttle_reasons_and_bytes_names(nvml):
    """nvidia-ml-py before 11.515 returns bytes and has no ...ClocksEventReasons."""
    del nvml.nvmlDeviceGetCurrentClocksEventReasons
    nvml.NAMES_AS_BYTES = True
    nvml.GPUS = [v100(nvml, clocks_event_reasons=nvml.nvmlClocksThrottleReasonGpuIdle)]
    source = NvmlSource(0.1, nvml=nvml)
    assert source.header["gpus"] == [{"sensor": "gpu0", "name": "Tesla V100-SXM2-16GB"}]
    assert source.header["driver"] == "550.54.15"
    rows = by_key(source.sample(1.0))
    assert rows[("clock_event_reasons", "gpu0")].value == 1.0
    assert rows[("power_mw", "gpu0")].period_s == 0.1  # the name was decoded before it was judged
    source.close()


def test_text_decodes_bytes():
    assert text(b"Tesla V100-SXM2-16GB") == "Tesla V100-SXM2-16GB"
    assert text("NVIDIA RTX A6000") == "NVIDIA RTX A6000"
    assert text(b"\xff\xfeGPU") == "\ufffd\ufffdGPU"


def test_close_shuts_nvml_down(nvml):
    nvml.GPUS = [a6000(nvml)]
    source = NvmlSource(0.5, nvml=nvml)
    source.close()
    with pytest.raises(nvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()


# --- NvmlPower -------------------------------------------------------------------------------------


def test_modes_and_state(nvml):
    nvml.GPUS = [a6000(nvml), a6000(nvml)]
    power = NvmlPower(nvml=nvml)
    assert power.modes() == [
        PowerModeInfo("default", "default", "300 W"),
        PowerModeInfo("<watts>W", "power limit", "100-300 W per GPU"),
    ]
    state = power.state()
    assert (state.mode_id, state.mode_name, state.warnings) == ("default", "default", [])
    assert [g["power_limit_w"] for g in state.details["gpus"]] == [300.0, 300.0]
    assert state.details["gpus"][0]["name"] == "NVIDIA RTX A6000"


def test_set_mode_watts_sets_every_gpu_and_reads_back(nvml):
    nvml.GPUS = [a6000(nvml), a6000(nvml)]
    power = NvmlPower(nvml=nvml)
    state = power.set_mode("250W")
    assert [gpu.power_limit_mw for gpu in nvml.GPUS] == [250000, 250000]
    assert nvml.calls == [
        ("nvmlDeviceSetPowerManagementLimit", 0, 250000),
        ("nvmlDeviceSetPowerManagementLimit", 1, 250000),
    ]
    assert (state.mode_id, state.mode_name) == ("250W", "250W")
    assert [g["power_limit_w"] for g in state.details["gpus"]] == [250.0, 250.0]
    assert power.state().mode_id == "250W"
    back = power.set_mode("default")
    assert [gpu.power_limit_mw for gpu in nvml.GPUS] == [300000, 300000]
    assert back.mode_id == "default"


def test_mixed_limits_are_reported_as_mixed(nvml):
    nvml.GPUS = [a6000(nvml), a6000(nvml, power_limit_mw=200000)]
    assert NvmlPower(nvml=nvml).state().mode_id == "mixed"


def test_limit_outside_constraints_sets_nothing(nvml):
    nvml.GPUS = [a6000(nvml), a6000(nvml, limit_constraints_mw=(100000, 200000), power_limit_mw=200000)]
    power = NvmlPower(nvml=nvml)
    with pytest.raises(PowerError, match=r"gpu1 accepts power limits of 100-200 W, not 250W"):
        power.set_mode("250W")  # gpu0 would accept it; it must not be changed either
    with pytest.raises(PowerError, match=r"100-300 W"):
        power.set_mode("350W")
    with pytest.raises(PowerError):
        power.set_mode("50W")
    assert nvml.calls == []
    assert [gpu.power_limit_mw for gpu in nvml.GPUS] == [300000, 200000]


def test_mode_that_is_not_a_limit(nvml):
    nvml.GPUS = [a6000(nvml)]
    with pytest.raises(PowerError, match="'default' or a limit in watts"):
        NvmlPower(nvml=nvml).set_mode("MAXN")
    assert nvml.calls == []


def test_no_permission_is_a_power_error_naming_nvml_error(nvml):
    nvml.GPUS = [a6000(nvml)]
    nvml.ROOT = False
    power = NvmlPower(nvml=nvml)
    with pytest.raises(PowerError, match=r"Insufficient Permissions \(NVML error 4\)"):
        power.set_mode("250W")
    with pytest.raises(PowerError, match="Insufficient Permissions"):
        power.lock_clocks()
    assert nvml.GPUS[0].power_limit_mw == 300000
    assert nvml.GPUS[0].locked_clocks_mhz is None
    assert power.state().mode_id == "default"  # reading needs no root


def test_lock_clocks_at_the_maximum(nvml):
    nvml.GPUS = [a6000(nvml, max_sm_clock_mhz=2100), v100(nvml, max_sm_clock_mhz=1530)]
    state = NvmlPower(nvml=nvml).lock_clocks()
    assert [gpu.locked_clocks_mhz for gpu in nvml.GPUS] == [(2100, 2100), (1530, 1530)]
    assert state.clocks_locked is True


def test_snapshot_and_restore(nvml):
    nvml.GPUS = [a6000(nvml, power_limit_mw=280000), v100(nvml, power_limit_mw=250000)]
    power = NvmlPower(nvml=nvml)
    snapshot = power.snapshot()
    assert snapshot == {"power_limits_mw": [280000, 250000]}
    power.set_mode("200W")
    power.lock_clocks()
    assert [gpu.power_limit_mw for gpu in nvml.GPUS] == [200000, 200000]
    state = power.restore(snapshot)
    assert [gpu.power_limit_mw for gpu in nvml.GPUS] == [280000, 250000]
    assert [gpu.locked_clocks_mhz for gpu in nvml.GPUS] == [None, None]
    assert state.mode_id == "mixed"
    assert [g["power_limit_w"] for g in state.details["gpus"]] == [280.0, 250.0]


def test_restore_refuses_a_snapshot_of_other_gpus(nvml):
    nvml.GPUS = [a6000(nvml), a6000(nvml)]
    power = NvmlPower(nvml=nvml)
    with pytest.raises(PowerError, match="power limits of 1 GPUs; this node has 2"):
        power.restore({"power_limits_mw": [250000]})
    assert nvml.calls == []


def test_no_gpu_warns_and_refuses(nvml):
    power = NvmlPower(nvml=nvml)
    state = power.state()
    assert (state.mode_id, state.warnings) == (None, ["NVML sees no GPU"])
    assert power.modes() == []
    with pytest.raises(PowerError, match="NVML sees no GPU"):
        power.set_mode("250W")
    with pytest.raises(PowerError):
        power.lock_clocks()
    with pytest.raises(PowerError):
        power.snapshot()


def test_nvml_that_fails_to_initialise_warns_and_refuses(nvml):
    nvml.GPUS = [a6000(nvml)]
    nvml.INIT_ERROR = nvml.NVML_ERROR_LIBRARY_NOT_FOUND  # no driver, or a Jetson before JetPack 7
    power = NvmlPower(nvml=nvml)
    state = power.state()
    assert state.mode_id is None
    assert state.warnings == ["NVML Shared Library Not Found"]
    with pytest.raises(PowerError, match="NVML Shared Library Not Found"):
        power.set_mode("250W")
    with pytest.raises(PowerError, match="NVML Shared Library Not Found"):
        power.restore({"power_limits_mw": [300000]})
    assert nvml.calls == []
