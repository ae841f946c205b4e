"""What the stand-in tools print for each Jetson board: the identity files, the CPU and GPU clock
ranges, and the power rails and sensors that tegrastats reports, as captured on real boards on
JetPack 5 (L4T R35) and quoted in public tegrastats parsers' tests.

Rail names are those of the INA3221 monitors on each module: AGX Orin reports VDD_GPU_SOC,
VDD_CPU_CV, VIN_SYS_5V0 and VDDQ_VDD2_1V8AO; Orin NX reports VDD_IN (the module's input, i.e. the
total), VDD_CPU_GPU_CV and VDD_SOC; AGX Xavier reports GPU, CPU, SOC, CV, VDDRQ and SYS5V.
``share`` is the fraction of the modeled module power that each rail reports; a rail marked
``total`` reports all of it (the rails then do not add up, as on the real board).
"""

from typing import NamedTuple, Tuple


class Rail(NamedTuple):
    name: str
    share: float
    total: bool = False


class Board(NamedTuple):
    model: str  # the inventory's model name
    device_tree_model: str  # /proc/device-tree/model
    nv_tegra_release: str  # first line of /etc/nv_tegra_release
    soc: str  # SOC family, as jetson_clocks --show prints it
    machine: str
    cpu_cores: int
    cpu_min_khz: int
    cpu_max_khz: int
    gpu_min_hz: int
    gpu_max_hz: int
    emc_max_hz: int
    ram_total_mb: int
    swap_total_mb: int
    rails: Tuple[Rail, ...]
    temperatures: Tuple[Tuple[str, float], ...]  # sensor name, idle temperature in C (-256: powered off)
    engines: str  # what tegrastats prints between the CPU list and the temperatures (GPU idle)


_R35 = (
    "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, DATE: Tue Aug  1 19:57:35 UTC 2023"
)

BOARDS = {
    "agx-orin": Board(
        model="agx-orin",
        device_tree_model="Jetson AGX Orin",  # as on R35.2 (R36 says "NVIDIA Jetson AGX Orin Developer Kit")
        nv_tegra_release=_R35,
        soc="tegra234",
        machine="Jetson AGX Orin",
        cpu_cores=12,
        cpu_min_khz=115200,
        cpu_max_khz=2201600,
        gpu_min_hz=306000000,
        gpu_max_hz=1300500000,
        emc_max_hz=3199000000,
        ram_total_mb=62795,
        swap_total_mb=31398,
        rails=(
            Rail("VDD_GPU_SOC", 0.45),
            Rail("VDD_CPU_CV", 0.25),
            Rail("VIN_SYS_5V0", 0.25),
            Rail("NC", 0.0),
            Rail("VDDQ_VDD2_1V8AO", 0.05),
            Rail("NC", 0.0),
        ),
        temperatures=(
            ("CV0", -256),
            ("CPU", 42.6),
            ("Tboard", 32.0),
            ("SOC2", 39.3),
            ("Tdiode", 33.3),
            ("SOC0", 39.4),
            ("CV1", -256),
            ("GPU", -256),
            ("tj", 42.6),
            ("SOC1", 40.5),
            ("CV2", -256),
        ),
        engines="EMC_FREQ 0%@2133 GR3D_FREQ 0%@0 GR3D2_FREQ 0%@0 VIC_FREQ 729 APE 174",
    ),
    "agx-xavier": Board(
        model="agx-xavier",
        device_tree_model="Jetson-AGX",
        nv_tegra_release=_R35,
        soc="tegra194",
        machine="Jetson-AGX",
        cpu_cores=8,
        cpu_min_khz=115200,
        cpu_max_khz=2265600,
        gpu_min_hz=114750000,
        gpu_max_hz=1377000000,
        emc_max_hz=2133000000,
        ram_total_mb=31920,
        swap_total_mb=15960,
        rails=(
            Rail("GPU", 0.35),
            Rail("CPU", 0.25),
            Rail("SOC", 0.2),
            Rail("CV", 0.05),
            Rail("VDDRQ", 0.05),
            Rail("SYS5V", 0.1),
        ),
        temperatures=(
            ("AUX", 36.0),
            ("CPU", 36.5),
            ("thermal", 35.7),
            ("Tboard", 37.0),
            ("AO", 35.0),
            ("GPU", 35.0),
            ("Tdiode", 38.75),
            ("PMIC", 50.0),
        ),
        engines="EMC_FREQ 0%@1331 GR3D_FREQ 0%@114 VIC_FREQ 115 APE 150",
    ),
    "orin-nx": Board(
        model="orin-nx",
        device_tree_model="NVIDIA Jetson Orin NX Engineering Reference Developer Kit",
        nv_tegra_release=_R35,
        soc="tegra234",
        machine="NVIDIA Jetson Orin NX Engineering Reference Developer Kit",
        cpu_cores=8,
        cpu_min_khz=115200,
        cpu_max_khz=1984000,
        gpu_min_hz=306000000,
        gpu_max_hz=918000000,
        emc_max_hz=3199000000,
        ram_total_mb=15388,
        swap_total_mb=7694,
        rails=(Rail("VDD_IN", 1.0, total=True), Rail("VDD_CPU_GPU_CV", 0.45), Rail("VDD_SOC", 0.3)),
        temperatures=(
            ("CV0", 45.8),
            ("CPU", 47.9),
            ("SOC2", 46.1),
            ("SOC0", 47.0),
            ("CV1", 46.4),
            ("GPU", 45.9),
            ("tj", 48.9),
            ("SOC1", 48.9),
            ("CV2", 45.75),
        ),
        engines="EMC_FREQ 0%@2133 GR3D_FREQ 0%@611 VIC_FREQ 729 APE 174",
    ),
}  # type: Dict[str, Board]


def board_for(model: str) -> Board:
    """The board an inventory model stands for (orin-nano and xavier-nx borrow their siblings')."""
    aliases = {"orin-nano": "orin-nx", "xavier-nx": "agx-xavier"}
    return BOARDS[aliases.get(model, model)]
