"""Node-side telemetry parsers on the real output of tegrastats, nvpmodel, jetson_clocks and dumpsys
battery, the host's /proc/stat and RAPL powercap files, and the row files the samplers write.

Every line quoted here is verbatim from a device (sources in the comments, from the project's
research notes); expected values are read off the line by hand.
"""

import json
from pathlib import Path

import pandas as pd
import pytest

from nodes.android.battery import (
    CurrentConvention,
    charging_from_dumpsys,
    detect_convention,
    parse_dumpsys_battery,
    parse_sysfs_status,
)
from nodes.contracts.telemetry_rows import COLUMNS, RowWriter, TelemetryRow, read_header, read_rows
from nodes.jetson.nvpmodel import parse_clocks_show, parse_modes, parse_query
from nodes.jetson.tegrastats import board_total, parse_tegrastats, sample_rows
from nodes.telemetry.battery import BatterySource
from nodes.telemetry.host import HostSource, RaplDomain, read_cpu_times, utilisation_pct

# --- tegrastats -------------------------------------------------------------------------------

# JetPack 4, Jetson Nano (rbonghi/jetson_stats tests/tegrastats).
NANO_JP4 = "RAM 1180/3965MB (lfb 1x2MB) SWAP 149/1024MB (cached 7MB) IRAM 0/252kB(lfb 252kB) CPU [30%@1036,33%@1036,28%@1036,26%@1036] EMC_FREQ 10%@1600 GR3D_FREQ 0%@76 NVENC 716 NVDEC 716 APE 25 PLL@57C CPU@60.5C PMIC@100C GPU@59C AO@65C thermal@59.75C POM_5V_IN 4520/4680 POM_5V_GPU 0/0 POM_5V_CPU 1078/1205"
# JetPack 4, Jetson TX2 (jetson_stats' emulator line, its $RAND_GPU load set to 57).
TX2_JP4 = "RAM 4722/7844MB (lfb 1x512kB) CPU [55%@2035,14%@2034,27%@2034,55%@2035,47%@2035,45%@2035] SWAP 149/1024MB (cached 7MB) EMC_FREQ 2%@1866 GR3D_FREQ 57%@1300 APE 150 MTS fg 0% bg 0% BCPU@-45C MCPU@-45C GPU@-51C PLL@45C AO@47.5C Tboard@37C Tdiode@46.75C PMIC@100C thermal@46.4C VDD_IN 14025/14416 VDD_CPU 2209/2538 VDD_GPU 6854/6903 VDD_SOC 1371/1370 VDD_WIFI 19/19 NVENC 716 NVDEC 716 VDD_DDR 2702/2702"
# JetPack 4.2, AGX Xavier (martinkersner/gtop PR #7): rails GPU/CPU share names with temperatures.
XAVIER_JP4 = "RAM 14700/15692MB (lfb 3x2MB) SWAP 898/8192MB (cached 23MB) CPU [0%@1190,0%@1190,0%@1190,0%@1190,0%@1190,0%@1190,0%@1190,0%@1190] EMC_FREQ 0% GR3D_FREQ 0% AO@30C GPU@30.5C Tboard@31C Tdiode@32C AUX@30.5C CPU@31.5C thermal@30.8C PMIC@100C GPU 463/463 CPU 618/618 SOC 2936/2936 CV 0/0 VDDRQ 309/309 SYS5V 3306/3306"
# JetPack 5, AGX Xavier (a Rust test; the start of the line was cut off there).
XAVIER_JP5_TAIL = "[0%@1190,1%@1190,0%@1190,0%@1189,0%@1190,0%@1191,0%@1190,0%@1190] EMC_FREQ 0%@1331 GR3D_FREQ 0%@114 VIC_FREQ 115 APE 150 AUX@36C CPU@36.5C thermal@35.7C Tboard@37C AO@35C GPU@35C Tdiode@38.75C PMIC@50C GPU 467mW/467mW CPU 467mW/467mW SOC 1245mW/1245mW CV 0mW/0mW VDDRQ 311mW/311mW SYS5V 2768mW/2768mW"
# JetPack 4, Xavier NX at full load.
XAVIER_NX_JP4 = "RAM 1748/7772MB (lfb 377x4MB) SWAP 0/3886MB (cached 0MB) CPU [100%@1420,100%@1420,100%@1420,100%@1420,100%@1420,100%@1420] EMC_FREQ 0% GR3D_FREQ 99% AO@50.5C GPU@53C PMIC@100C AUX@51C CPU@53C thermal@52.35C VDD_IN 12221/13950 VDD_CPU_GPU_CV 8812/10241 VDD_SOC 1333/1412"
# JetPack 5.1, AGX Orin 64GB: two NC rails, GR3D2_FREQ, -256C for powered-off sensors.
ORIN_AGX_JP5 = "04-24-2023 00:01:24 RAM 1282/62795MB (lfb 15152x4MB) SWAP 0/31398MB (cached 0MB) CPU [0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729] EMC_FREQ 0%@2133 GR3D_FREQ 0%@0 GR3D2_FREQ 0%@0 VIC_FREQ 729 APE 174 CV0@-256C CPU@42.593C Tboard@32C SOC2@39.343C Tdiode@33.25C SOC0@39.375C CV1@-256C GPU@-256C tj@42.593C SOC1@40.468C CV2@-256C VDD_GPU_SOC 2399mW/2399mW VDD_CPU_CV 400mW/400mW VIN_SYS_5V0 4032mW/4032mW NC 0mW/0mW VDDQ_VDD2_1V8AO 301mW/301mW NC 0mW/0mW"
# AGX Orin under load (tegrastats --interval 100): multi-GPC GR3D_FREQ, average differs from current.
ORIN_AGX_LOADED = "11-21-2025 08:49:48 RAM 13983/62780MB (lfb 424x4MB) SWAP 126/31390MB (cached 0MB) CPU [90%@2201,100%@2201,100%@2201,100%@2201,100%@2201,100%@2201,100%@2201,100%@2201,100%@2201,100%@2201,100%@2201,100%@2201] EMC_FREQ 1%@2133 GR3D_FREQ 14%@[407,407] VIC_FREQ 115 NVDLA0_FREQ @1600 APE 174 CV0@73.625C CPU@77.281C Tboard@62C SOC2@70C Tdiode@62.25C SOC0@69.531C CV1@72.5C GPU@69.125C tj@77.281C SOC1@68.968C CV2@67.25C VDD_GPU_SOC 3150mW/2971mW VDD_CPU_CV 14312mW/12415mW VIN_SYS_5V0 4968mW/5048mW VDDQ_VDD2_1V8AO 1091mW/1091mW"
# AGX Orin read without root: no rails at all.
ORIN_AGX_NO_RAILS = "03-08-2024 07:49:04 RAM 1438/30622MB (lfb 6704x4MB) SWAP 0/15311MB (cached 0MB) CPU [2%@729,0%@729,4%@729,0%@729,2%@729,0%@729,0%@729,2%@729] EMC_FREQ 0% GR3D_FREQ 0% CV0@-256C CPU@44.437C Tboard@36C SOC2@42.562C Tdiode@35.75C SOC0@42.062C CV1@-256C GPU@-256C tj@44.437C SOC1@43.031C CV2@-256C"
# JetPack 5, Orin Nano with two cores off.
ORIN_NANO_JP5 = "01-24-2024 09:17:09 RAM 3503/7337MB (lfb 7x1MB) SWAP 430/3668MB (cached 1MB) CPU [11%@729,13%@729,9%@729,18%@729,off,off] EMC_FREQ 0%@2133 GR3D_FREQ 0%@305 GR3D2_FREQ 0%@0 VIC_FREQ 115 APE 174 CV0@42.718C CPU@44.093C SOC2@42.625C SOC0@43.281C CV1@42.25C GPU@41.343C tj@46.968C SOC1@46.968C CV2@42.875C VDD_IN 4915mW/4915mW VDD_CPU_GPU_CV 449mW/449mW VDD_SOC 1431mW/1431mW"
# JetPack 6 (R36), Orin Nano 8GB: lower-case temperatures, engines that are `off`.
ORIN_NANO_JP6 = "09-21-2025 15:38:17 RAM 3645/7620MB (lfb 63x4MB) SWAP 236/3810MB (cached 0MB) CPU [1%@729,1%@729,4%@729,1%@729,0%@729,0%@729] EMC_FREQ 0%@204 GR3D_FREQ 0%@[305] NVDEC off NVJPG off NVJPG1 off VIC off OFA off APE 200 cpu@44.125C soc2@43.375C soc0@42.125C gpu@44.531C tj@44.531C soc1@43.156C VDD_IN 2957mW/2957mW VDD_CPU_GPU_CV 486mW/486mW VDD_SOC 1012mW/1012mW"
# JetPack 6 (R36), Orin NX 16GB in a low-power mode, read without root.
ORIN_NX_JP6 = "11-23-2025 22:47:56 RAM 1729/15657MB (lfb 8x4MB) SWAP 0/7828MB (cached 0MB) CPU [1%@1420,2%@1420,4%@1420,3%@1420,off,off,off,off] GR3D_FREQ 0% cv0@43.562C cpu@46.125C soc2@43.781C soc0@44.656C cv1@43.312C gpu@43C tj@46.937C soc1@46.937C cv2@43.781C VDD_IN 6120mW/6120mW VDD_CPU_GPU_CV 436mW/436mW VDD_SOC 2464mW/2464mW"
# R36.4.4, AGX Orin 64GB (lesomnus/tegra-exporter): no VDDQ/NC rails any more; NVENC with a load.
ORIN_AGX_R36 = "05-09-2026 18:42:06 RAM 18207/62841MB (lfb 466x4MB) SWAP 86/31420MB (cached 0MB) CPU [14%@2188,5%@2112,8%@2035,14%@2201,46%@1267,47%@1267,2%@1267,10%@1267,4%@1036,5%@1036,6%@1036,10%@1036] EMC_FREQ 3%@2133 GR3D_FREQ 0%@[0,0] NVENC 79%@166 NVDEC off NVJPG off NVJPG1 off VIC 36%@115 OFA off NVDLA0 off NVDLA1 off PVA0_FREQ off APE 174 cpu@52.562C soc2@48.437C soc0@49.093C tj@52.562C soc1@49.656C VDD_GPU_SOC 2412mW/2412mW VDD_CPU_CV 1607mW/1607mW VIN_SYS_5V0 4707mW/4707mW"
# R38 (JetPack 7.0/7.1), AGX Thor: GR3D_FREQ without a load, 14 cores.
THOR_R38 = "05-17-2026 10:00:32 RAM 4208/125773MB (lfb 31x4MB) SWAP 0/2048MB (cached 0MB) CPU [1%@972,0%@972,0%@972,0%@972,1%@972,0%@972,1%@972,1%@972,0%@972,0%@972,3%@972,0%@972,0%@972,1%@972] EMC_FREQ 0%@665 GR3D_FREQ @[0,0,0] NVENC0_FREQ @0 NVENC1_FREQ @0 NVDEC0_FREQ @0 NVDEC1_FREQ @0 NVJPG0_FREQ @0 VIC off OFA_FREQ @0 PVA0_FREQ off APE 300 cpu@34.468C tj@34.5C soc012@33.781C soc345@34.5C VDD_GPU 0mW/0mW VDD_CPU_SOC_MSS 4165mW/4165mW VIN_SYS_5V0 4126mW/4126mW"
# R38, Thor dev kit read without root: the carrier's VIN rail (INA238), no SWAP.
THOR_R38_VIN = "01-20-2026 22:46:22 RAM 17842/125772MB (lfb 79x4MB) CPU [0%@972,0%@972,0%@1566,0%@1566,0%@972,0%@972,0%@972,0%@972,0%@972,0%@972,1%@972,0%@972,0%@972,0%@972] cpu@30.468C tj@31.218C soc012@30.218C soc345@31.218C VDD_GPU 0mW/0mW VDD_CPU_SOC_MSS 5535mW/5535mW VIN_SYS_5V0 5040mW/5040mW VIN 16802mW/16802mW"
# Thor's GPU rail was seen reading negative; THOR_R38 with its VDD_GPU replaced by that reading.
THOR_NEGATIVE_GPU = THOR_R38.replace("VDD_GPU 0mW/0mW", "VDD_GPU -392mW/-392mW")
# R39 (JetPack 7.2), Thor: rails cur/avg/max, temperatures cur/max; two consecutive samples (the
# second one abbreviated with "..." in its source).
THOR_R39 = "07-23-2026 15:29:26 RAM 9101/125811MB (lfb 19x4MB) SWAP 0/2048MB (cached 0MB) CPU [39%@2160,20%@2160,16%@1944,15%@1944,17%@972,15%@972,19%@2214,22%@2214,13%@2430,20%@2430,26%@972,19%@972,15%@1836,22%@1836] EMC_FREQ 7%@3200 GR3D_FREQ @[314,314,314] NVENC0_FREQ @1556 NVENC1_FREQ @1556 NVDEC0_FREQ @1556 NVDEC1_FREQ @1556 NVJPG0_FREQ @1556 VIC 59%@423 OFA_FREQ @1556 PVA0_FREQ off APE 300 cpu@34.843C/34.843C tj@35.906C/35.906C soc012@34.437C/34.437C gpu@35.906C/35.906C soc345@34.406C/34.406C VDD_GPU 4925mW/4925mW/4925mW VDD_CPU_SOC_MSS 8710mW/8710mW/8710mW VIN_SYS_5V0 6767mW/6767mW/6767mW"
THOR_R39_NEXT = "07-23-2026 15:29:27 ... cpu@34.312C/34.843C tj@35.906C/35.906C soc012@34.093C/34.437C gpu@35.906C/35.906C soc345@34.437C/34.437C VDD_GPU 4925mW/4925mW/4925mW VDD_CPU_SOC_MSS 7953mW/8332mW/8710mW VIN_SYS_5V0 6667mW/6717mW/6767mW"
# R39.2, AGX Orin (jetson_stats' fixture).
ORIN_AGX_R39 = "07-25-2026 09:08:28 RAM 20642/62817MB (lfb 1x2MB) CPU [23%@2201,10%@2201,4%@2201,14%@2201,30%@2201,18%@2201,10%@2201,10%@2201,33%@2201,7%@2201,5%@2201,27%@2201] EMC_FREQ 3%@3199 GR3D_FREQ 12%@[1300,1300] NVENC0 off NVDEC0 off NVJPG0 off NVJPG1 off VIC off OFA off NVDLA0 off NVDLA1 off PVA0_FREQ off APE 174 cpu@52.968C/52.968C soc2@48.406C/48.406C soc0@49.531C/49.531C gpu@47.625C/47.625C VDD_GPU_SOC 5139mW/5139mW/5139mW VDD_CPU_CV 3268mW/3268mW/3268mW VIN_SYS_5V0 5500mW/5500mW/5500mW"
# R39, Orin Nano: integer temperatures, GR3D_FREQ without a frequency.
ORIN_NANO_R39 = "09-01-2026 09:25:18 RAM 5739/7546MB (lfb 1x2MB) SWAP 2047/2048MB (cached 209MB) CPU [72%@1728,75%@1728,88%@1728,79%@1728,87%@1728,78%@1728] GR3D_FREQ 33% cpu@50C/50C soc2@47.937C/47.937C soc0@48.437C/48.437C gpu@48.75C/48.75C tj@50C/50C soc1@48.5C/48.5C VDD_IN 9761mW/9761mW/9761mW VDD_CPU_GPU_CV 4238mW/4238mW/4238mW VDD_SOC 1825mW/1825mW/1825mW"

# line, rails (instantaneous mW, NC dropped), board power, board sensor, generation
BOARDS = {
    "nano-jp4": (NANO_JP4, {"POM_5V_IN": 4520, "POM_5V_GPU": 0, "POM_5V_CPU": 1078}, 4520, "POM_5V_IN", "jp4"),
    "tx2-jp4": (
        TX2_JP4,
        {"VDD_IN": 14025, "VDD_CPU": 2209, "VDD_GPU": 6854, "VDD_SOC": 1371, "VDD_WIFI": 19, "VDD_DDR": 2702},
        14025,
        "VDD_IN",
        "jp4",
    ),
    "agx-xavier-jp4": (
        XAVIER_JP4,
        {"GPU": 463, "CPU": 618, "SOC": 2936, "CV": 0, "VDDRQ": 309, "SYS5V": 3306},
        463 + 618 + 2936 + 0 + 309 + 3306,
        "sum(GPU+CPU+SOC+CV+VDDRQ+SYS5V)",
        "jp4",
    ),
    "agx-xavier-jp5": (
        XAVIER_JP5_TAIL,
        {"GPU": 467, "CPU": 467, "SOC": 1245, "CV": 0, "VDDRQ": 311, "SYS5V": 2768},
        467 + 467 + 1245 + 0 + 311 + 2768,
        "sum(GPU+CPU+SOC+CV+VDDRQ+SYS5V)",
        "jp5",
    ),
    "xavier-nx-jp4": (
        XAVIER_NX_JP4,
        {"VDD_IN": 12221, "VDD_CPU_GPU_CV": 8812, "VDD_SOC": 1333},
        12221,
        "VDD_IN",
        "jp4",
    ),
    "agx-orin-jp5": (
        ORIN_AGX_JP5,
        {"VDD_GPU_SOC": 2399, "VDD_CPU_CV": 400, "VIN_SYS_5V0": 4032, "VDDQ_VDD2_1V8AO": 301},
        2399 + 400 + 4032 + 301,
        "sum(VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0+VDDQ_VDD2_1V8AO)",
        "jp5",
    ),
    "agx-orin-loaded": (
        ORIN_AGX_LOADED,
        {"VDD_GPU_SOC": 3150, "VDD_CPU_CV": 14312, "VIN_SYS_5V0": 4968, "VDDQ_VDD2_1V8AO": 1091},
        3150 + 14312 + 4968 + 1091,
        "sum(VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0+VDDQ_VDD2_1V8AO)",
        "jp5",
    ),
    "orin-nano-jp5": (
        ORIN_NANO_JP5,
        {"VDD_IN": 4915, "VDD_CPU_GPU_CV": 449, "VDD_SOC": 1431},
        4915,
        "VDD_IN",
        "jp5",
    ),
    "orin-nano-jp6": (
        ORIN_NANO_JP6,
        {"VDD_IN": 2957, "VDD_CPU_GPU_CV": 486, "VDD_SOC": 1012},
        2957,
        "VDD_IN",
        "jp5",
    ),
    "orin-nx-jp6": (ORIN_NX_JP6, {"VDD_IN": 6120, "VDD_CPU_GPU_CV": 436, "VDD_SOC": 2464}, 6120, "VDD_IN", "jp5"),
    "agx-orin-r36": (
        ORIN_AGX_R36,
        {"VDD_GPU_SOC": 2412, "VDD_CPU_CV": 1607, "VIN_SYS_5V0": 4707},
        2412 + 1607 + 4707,
        "sum(VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0)",
        "jp5",
    ),
    "thor-r38": (
        THOR_R38,
        {"VDD_GPU": 0, "VDD_CPU_SOC_MSS": 4165, "VIN_SYS_5V0": 4126},
        0 + 4165 + 4126,
        "sum(VDD_GPU+VDD_CPU_SOC_MSS+VIN_SYS_5V0)",
        "jp5",
    ),
    "thor-r38-vin": (
        THOR_R38_VIN,
        {"VDD_GPU": 0, "VDD_CPU_SOC_MSS": 5535, "VIN_SYS_5V0": 5040, "VIN": 16802},
        16802,
        "VIN",
        "jp5",
    ),
    "thor-negative-gpu": (
        THOR_NEGATIVE_GPU,
        {"VDD_GPU": -392, "VDD_CPU_SOC_MSS": 4165, "VIN_SYS_5V0": 4126},
        -392 + 4165 + 4126,
        "sum(VDD_GPU+VDD_CPU_SOC_MSS+VIN_SYS_5V0)",
        "jp5",
    ),
    "thor-r39": (
        THOR_R39,
        {"VDD_GPU": 4925, "VDD_CPU_SOC_MSS": 8710, "VIN_SYS_5V0": 6767},
        4925 + 8710 + 6767,
        "sum(VDD_GPU+VDD_CPU_SOC_MSS+VIN_SYS_5V0)",
        "jp7",
    ),
    # current values, not the running average (8332, 6717) nor the maximum (8710, 6767)
    "thor-r39-next": (
        THOR_R39_NEXT,
        {"VDD_GPU": 4925, "VDD_CPU_SOC_MSS": 7953, "VIN_SYS_5V0": 6667},
        4925 + 7953 + 6667,
        "sum(VDD_GPU+VDD_CPU_SOC_MSS+VIN_SYS_5V0)",
        "jp7",
    ),
    "agx-orin-r39": (
        ORIN_AGX_R39,
        {"VDD_GPU_SOC": 5139, "VDD_CPU_CV": 3268, "VIN_SYS_5V0": 5500},
        5139 + 3268 + 5500,
        "sum(VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0)",
        "jp7",
    ),
    "orin-nano-r39": (
        ORIN_NANO_R39,
        {"VDD_IN": 9761, "VDD_CPU_GPU_CV": 4238, "VDD_SOC": 1825},
        9761,
        "VDD_IN",
        "jp7",
    ),
}


@pytest.mark.parametrize("board", sorted(BOARDS))
def test_tegrastats_rails_and_board_total(board):
    line, rails, total, sensor, generation = BOARDS[board]
    sample = parse_tegrastats(line)
    assert sample.rails_mw == rails
    assert list(sample.rails_mw) == list(rails)  # in the order printed
    assert (sample.board_power_mw, sample.board_power_sensor) == (total, sensor)
    assert sample.generation == generation


def test_board_total_prefers_an_input_rail_and_sums_otherwise():
    assert board_total({"VDD_IN": 5079, "VDD_CPU_GPU_CV": 696, "VDD_SOC": 1104}) == (5079, "VDD_IN")
    assert board_total({"POM_5V_IN": 4520, "POM_5V_GPU": 0}) == (4520, "POM_5V_IN")
    assert board_total({"VDD_GPU": 0, "VIN": 16802}) == (16802, "VIN")
    assert board_total({"GPU": 463, "CPU": 618}) == (1081, "sum(GPU+CPU)")
    assert board_total({}) == (None, "")


def test_tegrastats_jp4_nano_every_field():
    sample = parse_tegrastats(NANO_JP4)
    assert sample.timestamp is None
    assert (sample.ram_used_mb, sample.ram_total_mb, sample.swap_used_mb) == (1180, 3965, 149)
    assert sample.cpus == ((30, 1036), (33, 1036), (28, 1036), (26, 1036))
    assert sample.engines_util == {"EMC": (10, 1600), "GR3D": (0, 76)}
    assert sample.engines_mhz == {"NVENC": 716, "NVDEC": 716, "APE": 25}
    assert sample.temperatures_c == {"PLL": 57.0, "CPU": 60.5, "PMIC": 100.0, "GPU": 59.0, "AO": 65.0, "thermal": 59.75}


def test_tegrastats_tx2_keeps_real_negative_temperatures():
    sample = parse_tegrastats(TX2_JP4)
    assert sample.temperatures_c["BCPU"] == -45.0
    assert sample.temperatures_c["GPU"] == -51.0
    assert sample.engines_util["GR3D"] == (57, 1300)
    assert sample.engines_mhz == {"APE": 150, "NVENC": 716, "NVDEC": 716}
    assert (sample.ram_used_mb, sample.swap_used_mb) == (4722, 149)
    assert len(sample.cpus) == 6


def test_tegrastats_agx_xavier_rails_are_not_temperatures():
    sample = parse_tegrastats(XAVIER_JP4)
    # GPU@30.5C and CPU@31.5C are temperatures; "GPU 463/463" and "CPU 618/618" are rails
    assert sample.temperatures_c == {
        "AO": 30.0,
        "GPU": 30.5,
        "Tboard": 31.0,
        "Tdiode": 32.0,
        "AUX": 30.5,
        "CPU": 31.5,
        "thermal": 30.8,
        "PMIC": 100.0,
    }
    assert sample.rails_mw["GPU"] == 463
    assert sample.rails_mw["CPU"] == 618
    assert sample.cpus == ((0, 1190),) * 8  # from "CPU [..]", not from the CPU rail
    assert sample.engines_util == {"EMC": (0, None), "GR3D": (0, None)}  # no frequency without root


def test_tegrastats_agx_orin_jp5_drops_off_sensors_and_nc_rails():
    sample = parse_tegrastats(ORIN_AGX_JP5)
    assert sample.timestamp == "04-24-2023 00:01:24"
    assert sample.temperatures_c == {
        "CPU": 42.593,
        "Tboard": 32.0,
        "SOC2": 39.343,
        "Tdiode": 33.25,
        "SOC0": 39.375,
        "tj": 42.593,
        "SOC1": 40.468,
    }
    assert "NC" not in sample.rails_mw
    assert sample.engines_util == {"EMC": (0, 2133), "GR3D": (0, 0), "GR3D2": (0, 0)}
    assert sample.engines_mhz == {"VIC": 729, "APE": 174}
    assert sample.cpus == ((0, 729),) * 12
    assert (sample.ram_used_mb, sample.ram_total_mb, sample.swap_used_mb) == (1282, 62795, 0)


def test_tegrastats_gpu_frequency_is_the_highest_gpc():
    assert parse_tegrastats(ORIN_AGX_LOADED).engines_util["GR3D"] == (14, 407)
    assert parse_tegrastats(ORIN_AGX_R39).engines_util["GR3D"] == (12, 1300)
    assert parse_tegrastats(ORIN_NANO_JP6).engines_util["GR3D"] == (0, 305)
    # Thor prints frequencies without a load
    assert parse_tegrastats(THOR_R38).engines_util["GR3D"] == (None, 0)
    assert parse_tegrastats(THOR_R39).engines_util["GR3D"] == (None, 314)
    # R39 Orin Nano without root: a load without a frequency
    assert parse_tegrastats(ORIN_NANO_R39).engines_util == {"GR3D": (33, None)}


def test_tegrastats_orin_loaded_cpus_and_engines():
    sample = parse_tegrastats(ORIN_AGX_LOADED)
    assert sample.cpus == ((90, 2201),) + ((100, 2201),) * 11
    assert sample.engines_mhz == {"VIC": 115, "NVDLA0": 1600, "APE": 174}
    assert sample.engines_util["EMC"] == (1, 2133)


def test_tegrastats_off_cores_are_none():
    nano = parse_tegrastats(ORIN_NANO_JP5)
    assert nano.cpus == ((11, 729), (13, 729), (9, 729), (18, 729), (None, None), (None, None))
    nx = parse_tegrastats(ORIN_NX_JP6)
    assert nx.cpus == ((1, 1420), (2, 1420), (4, 1420), (3, 1420)) + ((None, None),) * 4


def test_tegrastats_jp6_lower_case_temperatures_and_off_engines():
    sample = parse_tegrastats(ORIN_NANO_JP6)
    assert sample.temperatures_c == {
        "cpu": 44.125,
        "soc2": 43.375,
        "soc0": 42.125,
        "gpu": 44.531,
        "tj": 44.531,
        "soc1": 43.156,
    }
    assert sample.engines_mhz == {"APE": 200}  # NVDEC, NVJPG, NVJPG1, VIC and OFA are off
    assert sample.engines_util == {"EMC": (0, 204), "GR3D": (0, 305)}
    assert (sample.ram_used_mb, sample.ram_total_mb, sample.swap_used_mb) == (3645, 7620, 236)


def test_tegrastats_r36_engines_with_a_load():
    sample = parse_tegrastats(ORIN_AGX_R36)
    assert sample.engines_mhz == {"NVENC": 166, "VIC": 115, "APE": 174}
    assert sample.engines_util == {"EMC": (3, 2133), "GR3D": (0, 0)}
    assert sample.cpus[4] == (46, 1267)
    assert sample.cpus[11] == (10, 1036)


def test_tegrastats_thor_r38():
    sample = parse_tegrastats(THOR_R38)
    assert len(sample.cpus) == 14
    assert sample.engines_mhz == {
        "NVENC0": 0,
        "NVENC1": 0,
        "NVDEC0": 0,
        "NVDEC1": 0,
        "NVJPG0": 0,
        "OFA": 0,
        "APE": 300,
    }
    assert sample.temperatures_c == {"cpu": 34.468, "tj": 34.5, "soc012": 33.781, "soc345": 34.5}
    vin = parse_tegrastats(THOR_R38_VIN)
    assert vin.swap_used_mb is None
    assert vin.cpus[2] == (0, 1566)
    assert (vin.ram_used_mb, vin.ram_total_mb) == (17842, 125772)


def test_tegrastats_r39_current_temperature_not_maximum():
    first = parse_tegrastats(THOR_R39)
    assert first.temperatures_c == {"cpu": 34.843, "tj": 35.906, "soc012": 34.437, "gpu": 35.906, "soc345": 34.406}
    nxt = parse_tegrastats(THOR_R39_NEXT)
    assert nxt.temperatures_c == {"cpu": 34.312, "tj": 35.906, "soc012": 34.093, "gpu": 35.906, "soc345": 34.437}
    assert nxt.timestamp == "07-23-2026 15:29:27"
    assert parse_tegrastats(ORIN_NANO_R39).temperatures_c["cpu"] == 50.0
    assert first.engines_mhz["VIC"] == 423
    assert first.engines_util["EMC"] == (7, 3200)


def test_tegrastats_line_without_rails():
    sample = parse_tegrastats(ORIN_AGX_NO_RAILS)
    assert sample.rails_mw == {}
    assert (sample.board_power_mw, sample.board_power_sensor) == (None, "")
    assert sample.ram_used_mb == 1438
    assert "GPU" not in sample.temperatures_c  # GPU@-256C: powered off
    assert sample.temperatures_c["CPU"] == 44.437
    rows = sample_rows(sample, 10.0, 1.0)
    assert not [r for r in rows if r.metric in ("power_mw", "board_power_mw")]


@pytest.mark.parametrize(
    "line",
    [
        "",
        "NV Power Mode: MAXN",
        "Error: Run this script(/usr/bin/jetson_clocks) as a root user",
        "NVPM WARN: fan mode is not set!",
    ],
)
def test_not_a_tegrastats_line(line):
    with pytest.raises(ValueError, match="not a tegrastats line"):
        parse_tegrastats(line)


UNIT_OF_SUFFIX = {"_mw": "mW", "_c": "C", "_pct": "%", "_mhz": "MHz", "_mb": "MB"}


def test_sample_rows_modeled_power_measured_rest():
    sample = parse_tegrastats(ORIN_NANO_JP5)
    rows = sample_rows(sample, 1700000000.5, 0.5, kind="modeled")
    by_key = {(r.metric, r.sensor): r for r in rows}
    assert len(by_key) == len(rows)  # one row per metric and sensor
    assert all(r.ts_s == 1700000000.5 and r.period_s == 0.5 for r in rows)
    power = [r for r in rows if r.metric in ("power_mw", "board_power_mw")]
    assert {(r.metric, r.sensor, r.value) for r in power} == {
        ("power_mw", "VDD_IN", 4915.0),
        ("power_mw", "VDD_CPU_GPU_CV", 449.0),
        ("power_mw", "VDD_SOC", 1431.0),
        ("board_power_mw", "VDD_IN", 4915.0),
    }
    assert {r.kind for r in power} == {"modeled"}
    assert {r.kind for r in rows if r not in power} == {"measured"}
    assert by_key[("cpu_util_pct", "cpu0")].value == 11.0
    assert by_key[("cpu_freq_mhz", "cpu3")].value == 729.0
    assert ("cpu_util_pct", "cpu4") not in by_key  # off
    assert by_key[("cpu_util_pct", "cpu")].value == pytest.approx((11 + 13 + 9 + 18) / 4)
    assert by_key[("cpu_online", "cpu")].value == 4.0
    assert by_key[("gpu_freq_mhz", "gpu")].value == 305.0
    assert by_key[("gpu_util_pct", "gpu2")].value == 0.0
    assert by_key[("emc_freq_mhz", "emc")].value == 2133.0
    assert by_key[("engine_freq_mhz", "vic")].value == 115.0
    assert by_key[("temp_c", "tj")].value == 46.968
    assert by_key[("ram_used_mb", "ram")].value == 3503.0
    assert by_key[("swap_used_mb", "swap")].value == 430.0
    for row in rows:
        assert row.metric == "cpu_online" or any(
            row.metric.endswith(suffix) and row.unit == unit for suffix, unit in UNIT_OF_SUFFIX.items()
        ), row


def test_sample_rows_default_kind_is_measured():
    rows = sample_rows(parse_tegrastats(XAVIER_JP4), 5.0, 1.0)
    assert {r.kind for r in rows} == {"measured"}
    board = [r for r in rows if r.metric == "board_power_mw"]
    assert [(r.value, r.unit, r.sensor) for r in board] == [(7632.0, "mW", "sum(GPU+CPU+SOC+CV+VDDRQ+SYS5V)")]
    # Thor: a GPU frequency row, and no GPU load row (none printed)
    thor = {(r.metric, r.sensor) for r in sample_rows(parse_tegrastats(THOR_R38), 5.0, 1.0)}
    assert ("gpu_freq_mhz", "gpu") in thor
    assert ("gpu_util_pct", "gpu") not in thor


# --- nvpmodel and jetson_clocks ---------------------------------------------------------------

# Nano JP4, `sudo nvpmodel -q`.
QUERY_NANO = "NVPM WARN: fan mode is not set!\nNV Power Mode: MAXN\n0\n"
# Two warnings: AGX Orin's first WARN line (from `nvpmodel -m`) before AGX Xavier's `-q` output.
QUERY_TWO_WARNINGS = (
    "NVPM WARN: Golden image context is already created\n"
    "NVPM WARN: fan mode is not set to cool\n"
    "NV Power Mode: MODE_30W_2CORE\n"
    "2\n"
)
# Xavier NX JP4, `nvpmodel -q --verbose`.
QUERY_VERBOSE = """NVPM VERB: Config file: /etc/nvpmodel.conf
NVPM VERB: parsing done for /etc/nvpmodel.conf
NV Fan Mode:quiet
NVPM VERB: Current mode: NV Power Mode: MODE_15W_6CORE
2
NVPM VERB: PARAM CPU_ONLINE: ARG CORE_0: PATH /sys/devices/system/cpu/cpu0/online: REAL_VAL: 1 CONF_VAL: 1
NVPM VERB: PARAM CPU_ONLINE: ARG CORE_1: PATH /sys/devices/system/cpu/cpu1/online: REAL_VAL: 1 CONF_VAL: 1
"""
# AGX Orin, `nvpmodel -m 1` declined at the reboot prompt.
QUERY_ERROR = """NVPM WARN: Golden image context is already created
NVPM WARN: Reboot required for changing to this power mode: 1
NVPM WARN: DO YOU WANT TO REBOOT NOW? enter YES/yes to confirm:
NVPM ERROR: optMask is 1, no request for power mode
"""


def test_nvpmodel_query_one_warning():
    query = parse_query(QUERY_NANO)
    assert (query.mode_id, query.mode_name, query.warnings) == (0, "MAXN", ["fan mode is not set!"])


def test_nvpmodel_query_two_warnings():
    query = parse_query(QUERY_TWO_WARNINGS)
    assert (query.mode_id, query.mode_name) == (2, "MODE_30W_2CORE")
    assert query.warnings == ["Golden image context is already created", "fan mode is not set to cool"]


def test_nvpmodel_query_verbose():
    query = parse_query(QUERY_VERBOSE)
    assert (query.mode_id, query.mode_name, query.warnings) == (2, "MODE_15W_6CORE", [])
    orin_nx = "NVPM VERB: Current mode: NV Power Mode: 40W\n4\nNVPM VERB: PARAM CPU_ONLINE: ARG CORE_0: PATH /sys/devices/system/cpu/cpu0/online: REAL_VAL: 1 CONF_VAL: 1\n"
    assert parse_query(orin_nx)[:2] == (4, "40W")
    assert parse_query("NV Power Mode: 25W\n1\n")[:2] == (1, "25W")


def test_nvpmodel_query_error_and_missing_id():
    with pytest.raises(ValueError, match="optMask is 1"):
        parse_query(QUERY_ERROR)
    with pytest.raises(ValueError):
        parse_query("NV Power Mode: MAXN\n")
    with pytest.raises(ValueError):
        parse_query("")


# Xavier NX R35.1, `nvpmodel -p --verbose | grep POWER_MODEL`.
MODES_XAVIER_NX = """NVPM VERB: POWER_MODEL: ID=0 NAME=MODE_15W_2CORE
NVPM VERB: POWER_MODEL: ID=1 NAME=MODE_15W_4CORE
NVPM VERB: POWER_MODEL: ID=2 NAME=MODE_15W_6CORE
NVPM VERB: POWER_MODEL: ID=3 NAME=MODE_10W_2CORE
NVPM VERB: POWER_MODEL: ID=4 NAME=MODE_10W_4CORE
NVPM VERB: POWER_MODEL: ID=5 NAME=MODE_10W_DESKTOP
NVPM VERB: POWER_MODEL: ID=6 NAME=MODE_20W_2CORE
NVPM VERB: POWER_MODEL: ID=7 NAME=MODE_20W_4CORE
NVPM VERB: POWER_MODEL: ID=8 NAME=MODE_20W_6CORE
"""
# AGX Orin 64GB, `nvpmodel -p --verbose` (jetson_stats' show_verbose_orin; later blocks shortened).
MODES_ORIN_VERBOSE = """NVPM VERB: Config file: /etc/nvpmodel.conf
NVPM VERB: parsing done for /etc/nvpmodel.conf
succeed to parse file /etc/nvpmodel.conf.
NVPM VERB: PM_CONFIG: DEFAULT=MODE_30W(2)
NVPM VERB: PARAM TYPE=FILE NAME=CPU_ONLINE
NVPM VERB: CORE_0 /sys/devices/system/cpu/cpu0/online
NVPM VERB: PARAM TYPE=CLOCK NAME=GPU
NVPM VERB: FREQ_TABLE /sys/devices/17000000.ga10b/devfreq_dev/available_frequencies
NVPM VERB: MAX_FREQ /sys/devices/17000000.ga10b/devfreq_dev/max_freq
NVPM VERB:\x20
NVPM VERB: POWER_MODEL: ID=0 NAME=MAXN
NVPM VERB: CPU_ONLINE CORE_0 1
NVPM VERB: TPC_POWER_GATING TPC_PG_MASK 0
NVPM VERB: CPU_A78_0 MAX_FREQ 2147483647
NVPM VERB: GPU MAX_FREQ 2147483647
NVPM VERB: EMC MAX_FREQ 0
NVPM VERB:\x20
NVPM VERB: POWER_MODEL: ID=1 NAME=MODE_15W
NVPM VERB: POWER_MODEL: ID=2 NAME=MODE_30W
NVPM VERB: POWER_MODEL: ID=3 NAME=MODE_50W
"""
# /etc/nvpmodel.conf: NVIDIA's header (TX2, 2017) and sections, plus a mode block someone
# commented out (it must not count).
NVPMODEL_CONF = """# FORMAT:
# < PARAM TYPE=PARAM_TYPE NAME=PARAM_NAME >
# ARG1_NAME ARG1_PATH_VAL
# ...
# PARAM_TYPE can be FILE, or CLOCK.
#
# < POWER_MODEL ID=id_num NAME=mode_name >
# PARAM1_NAME ARG11_NAME ARG11_VAL
# ...
# ARG_VAL is an integer for PARAM_TYPE of CLOCK, and -1 is taken
# as INT_MAX. ARG_VAL is a string for PARAM_TYPE of FILE.
# This file must contain at least one POWER_MODEL section.
#
# < PM_CONFIG DEFAULT=default_mode >
# This is a mandatory section to specify one of the defined power
# model as the default.

< PARAM TYPE=FILE NAME=CPU_ONLINE >
CORE_0 /sys/devices/system/cpu/cpu0/online
< PARAM TYPE=CLOCK NAME=EMC >
MAX_FREQ /sys/kernel/nvpmodel_emc_cap/emc_iso_cap

# MAXN is the NONE power model to release all constraints
< POWER_MODEL ID=0 NAME=MAXN >
CPU_ONLINE CORE_1 1
CPU_A57 MAX_FREQ -1
GPU MIN_FREQ 0
EMC MAX_FREQ 0

# < POWER_MODEL ID=9 NAME=MODE_TEST >
# CPU_ONLINE CORE_1 0
#< PM_CONFIG DEFAULT=9 >

# mandatory section to configure the default mode
< PM_CONFIG DEFAULT=3 >
"""


def test_nvpmodel_modes_from_listing():
    modes, default = parse_modes(MODES_XAVIER_NX)
    assert modes == [
        (0, "MODE_15W_2CORE"),
        (1, "MODE_15W_4CORE"),
        (2, "MODE_15W_6CORE"),
        (3, "MODE_10W_2CORE"),
        (4, "MODE_10W_4CORE"),
        (5, "MODE_10W_DESKTOP"),
        (6, "MODE_20W_2CORE"),
        (7, "MODE_20W_4CORE"),
        (8, "MODE_20W_6CORE"),
    ]
    assert default is None  # grep kept only the POWER_MODEL lines


def test_nvpmodel_modes_from_verbose_listing_with_default():
    modes, default = parse_modes(MODES_ORIN_VERBOSE)
    assert modes == [(0, "MAXN"), (1, "MODE_15W"), (2, "MODE_30W"), (3, "MODE_50W")]
    assert default == 2
    assert parse_modes("NVPM VERB: PM_CONFIG: DEFAULT=MAXP_CORE_ARM(3)\nNVPM VERB: POWER_MODEL: ID=0 NAME=MAXN\n") == (
        [(0, "MAXN")],
        3,
    )


def test_nvpmodel_modes_from_conf_ignore_comments():
    modes, default = parse_modes(NVPMODEL_CONF)
    assert modes == [(0, "MAXN")]
    assert default == 3


# AGX Orin JP5, `jetson_clocks --show` in MODE_30W.
CLOCKS_BEFORE = """SOC family:tegra234  Machine:NVIDIA Jetson AGX Orin Developer Kit
Online CPUs: 0-7
cpu0:  Online=1 Governor=schedutil MinFreq=729600 MaxFreq=1728000 CurrentFreq=1420800 IdleStates: WFI=1 c7=1\x20
cpu8:  Online=0 Governor=schedutil MinFreq=729600 MaxFreq=2201600 CurrentFreq=729600 IdleStates: WFI=1 c7=1\x20
GPU MinFreq=306000000 MaxFreq=612000000 CurrentFreq=306000000
Active GPU TPCs: 4
EMC MinFreq=204000000 MaxFreq=3199000000 CurrentFreq=3199000000 FreqOverride=0
DLA0_CORE:   Online=1 MinFreq=0 MaxFreq=1369600000 CurrentFreq=1369600000
DLA0_FALCON: Online=1 MinFreq=0 MaxFreq=729600000 CurrentFreq=729600000
PVA0_VPS0: Online=1 MinFreq=0 MaxFreq=512000000 CurrentFreq=512000000
PVA0_AXI:  Online=1 MinFreq=0 MaxFreq=358400000 CurrentFreq=358400000
FAN Dynamic Speed Control=nvfancontrol hwmon0_pwm1=48
NV Power Mode: MODE_30W
"""
# After `sudo jetson_clocks`: the online CPU's and the GPU's minimum at their maximum, idle states
# off, EMC FreqOverride=1 (the lines the research shows changing; the offline cpu8 stays as it was).
CLOCKS_AFTER = (
    CLOCKS_BEFORE.replace(
        "cpu0:  Online=1 Governor=schedutil MinFreq=729600 MaxFreq=1728000 CurrentFreq=1420800 IdleStates: WFI=1 c7=1 ",
        "cpu0:  Online=1 Governor=schedutil MinFreq=1728000 MaxFreq=1728000 CurrentFreq=1728000 IdleStates: WFI=0 c7=0 ",
    )
    .replace(
        "GPU MinFreq=306000000 MaxFreq=612000000 CurrentFreq=306000000",
        "GPU MinFreq=612000000 MaxFreq=612000000 CurrentFreq=612000000",
    )
    .replace("FreqOverride=0", "FreqOverride=1")
)


def test_jetson_clocks_show_before_and_after_pinning():
    assert CLOCKS_AFTER != CLOCKS_BEFORE
    before = parse_clocks_show(CLOCKS_BEFORE)
    assert before.locked is False
    assert set(before.cpu) == {"cpu0", "cpu8"}
    assert before.cpu["cpu0"]["MinFreq"] == "729600"
    assert before.cpu["cpu8"]["Online"] == "0"
    assert before.gpu == {"MinFreq": "306000000", "MaxFreq": "612000000", "CurrentFreq": "306000000"}
    assert before.emc["FreqOverride"] == "0"
    assert before.power_mode == "MODE_30W"
    after = parse_clocks_show(CLOCKS_AFTER)
    assert after.locked is True  # cpu8 is offline: its unpinned range does not count
    assert after.emc["FreqOverride"] == "1"
    # only the GPU pinned, or only the CPUs: not locked
    gpu_only = CLOCKS_BEFORE.replace(
        "GPU MinFreq=306000000 MaxFreq=612000000", "GPU MinFreq=612000000 MaxFreq=612000000"
    )
    assert parse_clocks_show(gpu_only).locked is False
    cpu_only = CLOCKS_AFTER.replace("GPU MinFreq=612000000", "GPU MinFreq=306000000")
    assert parse_clocks_show(cpu_only).locked is False


def test_jetson_clocks_show_refuses_non_root_output():
    with pytest.raises(ValueError):
        parse_clocks_show("Error: Run this script(/usr/bin/jetson_clocks) as a root user\n")


# --- dumpsys battery ---------------------------------------------------------------------------

# Older layout (no Dock powered / Charging state lines), plugged in and full.
DUMPSYS_OLD = """Current Battery Service state:
  AC powered: false
  USB powered: true
  Wireless powered: false
  Max charging current: 500000
  Max charging voltage: 5000000
  Charge counter: 3270000
  status: 5
  health: 2
  present: true
  level: 100
  scale: 100
  voltage: 4352
  temperature: 274
  technology: Li-ion

"""
# Newer layout, HONOR ALT-NX1, discharging.
DUMPSYS_NEW = """Current Battery Service state:
  AC powered: false
  USB powered: false
  Wireless powered: false
  Dock powered: false
  Max charging current: 0
  Max charging voltage: 0
  Charge counter: 2848000
  status: 3
  health: 2
  present: true
  level: 54
  scale: 100
  voltage: 3906
  temperature: 220
  technology: Li-ion
  Charging state: 0
  Charging policy: 0
"""
# Pixel 8 Pro: broadcast bookkeeping lines with one leading space, "Capacity level" after "level".
DUMPSYS_PIXEL8 = """Current Battery Service state:
  AC powered: false
  USB powered: true
  Wireless powered: false
  Dock powered: false
  Max charging current: 500000
 Time when the latest updated value of the Max charging current was sent via battery changed broadcast: +14h58m53s789ms
  Max charging voltage: 5000000
  Charge counter: 1082000
  status: 2
  health: 2
  present: true
  level: 22
  scale: 100
  voltage: 3764
 Time when the latest updated value of the voltage was sent via battery changed broadcast: +14h59m21s407ms
 The last voltage value sent via the battery changed broadcast: 3775
  temperature: 280
  technology: Li-ion
  Charging state: 4
  Charging policy: 2
  Capacity level: 2
"""
# Samsung One UI (the source page lost the indentation; its "..." standard lines filled in from the
# values it lists).
DUMPSYS_SAMSUNG = """Current Battery Service state:
mBootCompleted: true
AC powered: false
USB powered: true
status: 2
voltage: 4063
temperature: 326
technology: Li-ion
batterySWSelfDischarging: false
batteryMiscEvent: 0
batteryCurrentEvent: 0
mSecPlugTypeSummary: 2
LED Charging: true
LED Low Battery: true
current now: 321
charge counter: 0
"""
# HONOR's output after `dumpsys battery unplug` (AOSP prints this line first when values are forced).
DUMPSYS_STOPPED = DUMPSYS_NEW.replace(
    "Current Battery Service state:\n",
    "Current Battery Service state:\n  (UPDATES STOPPED -- use 'reset' to restart)\n",
)


def test_dumpsys_battery_new_layout_fields_and_types():
    fields = parse_dumpsys_battery(DUMPSYS_NEW)
    expected = {
        "AC powered": False,
        "USB powered": False,
        "Wireless powered": False,
        "Dock powered": False,
        "Max charging current": 0,
        "Max charging voltage": 0,
        "Charge counter": 2848000,
        "status": 3,
        "health": 2,
        "present": True,
        "level": 54,
        "scale": 100,
        "voltage": 3906,
        "temperature": 220,
        "technology": "Li-ion",
        "Charging state": 0,
        "Charging policy": 0,
        "updates_stopped": False,
    }
    for key, value in expected.items():
        assert fields[key] == value, key
        assert type(fields[key]) is type(value), key
    assert charging_from_dumpsys(fields) is False


def test_dumpsys_battery_old_layout():
    fields = parse_dumpsys_battery(DUMPSYS_OLD)
    assert "Dock powered" not in fields
    assert (fields["status"], fields["level"], fields["voltage"], fields["temperature"]) == (5, 100, 4352, 274)
    assert fields["USB powered"] is True
    assert charging_from_dumpsys(fields) is True


def test_dumpsys_battery_pixel8_level_and_broadcast_lines():
    fields = parse_dumpsys_battery(DUMPSYS_PIXEL8)
    assert fields["level"] == 22
    assert fields["Capacity level"] == 2
    assert fields["voltage"] == 3764  # not the 3775 of "The last voltage value sent ..."
    assert fields["Max charging current"] == 500000
    assert not [k for k in fields if k.startswith(("Time when", "The last"))]
    assert fields["updates_stopped"] is False
    assert charging_from_dumpsys(fields) is True


def test_dumpsys_battery_samsung_vendor_lines():
    fields = parse_dumpsys_battery(DUMPSYS_SAMSUNG)
    assert fields["current now"] == 321
    assert fields["charge counter"] == 0
    assert fields["LED Charging"] is True
    assert fields["status"] == 2
    assert fields["temperature"] == 326
    assert charging_from_dumpsys(fields) is True


def test_dumpsys_battery_updates_stopped():
    fields = parse_dumpsys_battery(DUMPSYS_STOPPED)
    assert fields["updates_stopped"] is True
    assert fields["level"] == 54


def test_charging_from_status_alone_and_dock():
    assert charging_from_dumpsys({"AC powered": False, "USB powered": False, "status": 2}) is True
    assert charging_from_dumpsys({"AC powered": False, "USB powered": False, "status": 3}) is False
    assert charging_from_dumpsys({"Dock powered": True, "status": 4}) is True
    assert charging_from_dumpsys({"Wireless powered": True, "status": 3}) is True


STANDINS = Path(__file__).resolve().parent / "standins"
SERIAL = "28011FDH2000AB"


def battery_source(tmp_path, monkeypatch, status_word, plugged_into):
    """A BatterySource on the adb stand-in's phone, whose battery files say ``status_word`` and
    which is plugged into ``plugged_into`` (``usb``, ``dock``...)."""
    phone = tmp_path / "phones" / SERIAL
    battery = phone / "sys" / "class" / "power_supply" / "battery"
    battery.mkdir(parents=True)
    for name, value in {
        "status": status_word,
        "capacity": "54",
        "voltage_now": "3906000",
        "temp": "220",
        "current_now": "326171",
        "charge_counter": "2848000",
    }.items():
        (battery / name).write_text(value + "\n")
    (phone / "standin").mkdir()
    (phone / "standin" / f"{plugged_into}_powered").write_text("true\n")
    monkeypatch.setenv("ADB_STANDIN_ROOT", str(tmp_path / "phones"))
    monkeypatch.setenv("ADB_STANDIN_DEVICES", f"{SERIAL}:device")
    return BatterySource(SERIAL, 0.05, adb=str(STANDINS / "adb"), max_samples=1)


def test_battery_source_reports_usb_charging(tmp_path, monkeypatch):
    source = battery_source(tmp_path, monkeypatch, "Charging", "usb")
    try:
        assert source.dumpsys["level"] == 54
        assert source.dumpsys["status"] == 2
        charging = [p for p in source.problems if p[2].startswith("the phone is charging")]
        assert len(charging) == 1
        assert "(USB powered)" in charging[0][2]
    finally:
        source.close()


def test_battery_source_says_why_it_charges_without_a_power_flag(tmp_path, monkeypatch):
    """Charging on a dock (status 2; AC, USB and wireless false): the problem must still name
    the reason, not an empty "()"."""
    source = battery_source(tmp_path, monkeypatch, "Charging", "dock")
    try:
        assert source.dumpsys["Dock powered"] is True
        charging = [p for p in source.problems if p[2].startswith("the phone is charging")]
        assert len(charging) == 1
        assert "()" not in charging[0][2], charging[0][2]
        assert "(Dock powered)" in charging[0][2]
    finally:
        source.close()


def test_dumpsys_battery_refuses_other_output():
    with pytest.raises(ValueError):
        parse_dumpsys_battery("Can't find service: battery\n")


def test_current_convention_microamps_negative_discharge():
    convention = detect_convention(-326171, charging=False)
    assert convention is not None
    assert (convention.unit, convention.discharge_sign) == ("uA", -1)
    assert convention.discharge_ma(-326171) == pytest.approx(326.171)
    assert convention.discharge_ma(500000) == pytest.approx(-500.0)  # charging: negative


def test_current_convention_milliamps_positive_discharge():
    convention = detect_convention(850, charging=False)
    assert convention is not None
    assert (convention.unit, convention.discharge_sign) == ("mA", 1)
    assert convention.discharge_ma(850) == 850.0


def test_current_convention_other_vendors():
    huawei = detect_convention(-400, charging=False)  # mA, negative while discharging
    assert huawei is not None
    assert (huawei.unit, huawei.discharge_sign, huawei.discharge_ma(-400)) == ("mA", -1, 400.0)
    mi_a1 = detect_convention(250000, charging=False)  # µA, positive while discharging
    assert mi_a1 is not None
    assert (mi_a1.unit, mi_a1.discharge_sign) == ("uA", 1)
    assert mi_a1.discharge_ma(250000) == pytest.approx(250.0)
    assert detect_convention(10000, charging=False).unit == "uA"
    assert detect_convention(-9999, charging=False).unit == "mA"


def test_current_convention_unknown_when_zero_or_charging():
    assert detect_convention(0, charging=False) is None
    assert detect_convention(-326171, charging=True) is None
    assert detect_convention(850, charging=True) is None


def test_current_convention_is_recordable():
    convention = CurrentConvention("uA", -1, "current_now=-326171 while discharging")
    assert json.loads(json.dumps(convention._asdict())) == {
        "unit": "uA",
        "discharge_sign": -1,
        "evidence": "current_now=-326171 while discharging",
    }


@pytest.mark.parametrize(
    ("word", "charging"),
    [("Charging\n", True), ("Full", True), ("Discharging\n", False), ("Not charging", False), ("Unknown", False)],
)
def test_sysfs_status(word, charging):
    assert parse_sysfs_status(word) is charging


# --- host: /proc/stat and RAPL ------------------------------------------------------------------

# proc_stat(5)'s example: user nice system idle iowait irq softirq steal guest guest_nice.
PROC_STAT = "cpu 10132153 290696 3084719 46828483 16683 0 25195 0 175628 0\ncpu0 1393280 32966 572056 13343292 6130 0 17875 0 23933 0\n"
# 1 s later: user +300 (of which guest +200), system +100, idle +550, iowait +50.
PROC_STAT_LATER = "cpu 10132453 290696 3084819 46829033 16733 0 25195 0 175828 0\ncpu0 1393580 32966 572156 13343842 6180 0 17875 0 24133 0\n"


def test_read_cpu_times(tmp_path):
    path = tmp_path / "stat"
    path.write_text(PROC_STAT)
    busy = 10132153 + 290696 + 3084719 + 0 + 25195 + 0  # user nice system irq softirq steal
    idle = 46828483 + 16683  # idle iowait
    assert read_cpu_times(str(path)) == (busy, busy + idle)


def test_utilisation_between_two_samples(tmp_path):
    path = tmp_path / "stat"
    path.write_text(PROC_STAT)
    before = read_cpu_times(str(path))
    path.write_text(PROC_STAT_LATER)
    after = read_cpu_times(str(path))
    # busy +400 (user 300 incl. guest, system 100) of +1000 (with idle 550 and iowait 50)
    assert utilisation_pct(before, after) == pytest.approx(40.0)
    assert utilisation_pct(after, after) is None


def test_read_cpu_times_refuses_other_files(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       16310264 kB\n")
    with pytest.raises(ValueError):
        read_cpu_times(str(path))


RANGE_UJ = 262143328850  # max_energy_range_uj of an Intel package-0


def make_powercap(root, domains):
    """A powercap tree as /sys/class/powercap lays it out: the control type and flat zone links."""
    (root / "intel-rapl").mkdir(parents=True)
    (root / "intel-rapl" / "enabled").write_text("1\n")
    for directory, name, energy_uj in domains:
        zone = root / directory
        zone.mkdir()
        (zone / "name").write_text(name + "\n")
        (zone / "max_energy_range_uj").write_text(f"{RANGE_UJ}\n")
        (zone / "energy_uj").write_text(f"{energy_uj}\n")
    return root


def test_rapl_counter_wraps_between_samples(tmp_path):
    powercap = make_powercap(tmp_path / "powercap", [("intel-rapl:0", "package-0", RANGE_UJ - 328850)])
    domain = RaplDomain(str(powercap / "intel-rapl:0"))
    assert domain.name == "rapl:package-0"
    first = domain.sample(100.0, 1.0)
    assert [(r.metric, r.value, r.unit) for r in first] == [("energy_uj", 0.0, "uJ")]
    (powercap / "intel-rapl:0" / "energy_uj").write_text("671650\n")  # wrapped
    second = {r.metric: r for r in domain.sample(102.0, 1.0)}
    energy_uj = 328850 + 671650  # up to the wrap, then from zero
    assert second["energy_uj"].value == pytest.approx(energy_uj, abs=100)
    assert second["power_mw"].value == pytest.approx(energy_uj / 2.0 / 1000.0, rel=1e-6)
    assert (second["power_mw"].unit, second["power_mw"].sensor) == ("mW", "rapl:package-0")
    (powercap / "intel-rapl:0" / "energy_uj").write_text("1671650\n")
    third = {r.metric: r for r in domain.sample(103.0, 1.0)}
    assert third["energy_uj"].value == pytest.approx(energy_uj + 1000000, abs=100)
    assert third["power_mw"].value == pytest.approx(1000.0)


def test_host_source_samples_cpu_and_rapl(tmp_path):
    stat_path = tmp_path / "stat"
    stat_path.write_text(PROC_STAT)
    powercap = make_powercap(
        tmp_path / "powercap",
        [("intel-rapl:0", "package-0", RANGE_UJ - 1000), ("intel-rapl:0:0", "core", 5000000)],
    )
    source = HostSource(0.5, proc_stat=str(stat_path), powercap=str(powercap))
    assert source.problems == []
    assert source.header == {"rapl_domains": ["rapl:package-0", "rapl:core"]}
    source.sample(1000.0)
    stat_path.write_text(PROC_STAT_LATER)
    (powercap / "intel-rapl:0" / "energy_uj").write_text("499000\n")
    (powercap / "intel-rapl:0:0" / "energy_uj").write_text("5250000\n")
    rows = {(r.metric, r.sensor): r for r in source.sample(1000.5)}
    assert rows[("cpu_util_pct", "cpu")].value == pytest.approx(40.0)
    assert rows[("cpu_util_pct", "cpu")].period_s == 0.5
    assert rows[("energy_uj", "rapl:package-0")].value == pytest.approx(500000, abs=100)
    assert rows[("power_mw", "rapl:package-0")].value == pytest.approx(500000 / 0.5 / 1000, rel=1e-3)
    assert rows[("energy_uj", "rapl:core")].value == 250000.0
    assert rows[("power_mw", "rapl:core")].value == pytest.approx(500.0)
    assert rows[("ram_used_mb", "ram")].unit == "MB"


def test_host_source_unreadable_rapl_is_a_problem(tmp_path):
    stat_path = tmp_path / "stat"
    stat_path.write_text(PROC_STAT)
    powercap = make_powercap(tmp_path / "powercap", [("intel-rapl:0", "package-0", 1)])
    energy = powercap / "intel-rapl:0" / "energy_uj"
    energy.unlink()
    energy.mkdir()  # open() fails as it does for a non-root user (chmod 000 would not stop root)
    source = HostSource(0.05, proc_stat=str(stat_path), powercap=str(powercap))
    assert source.domains == []
    assert len(source.problems) == 1
    metric, sensor, problem = source.problems[0]
    assert (metric, sensor) == ("energy_uj", "rapl:package-0")
    assert "root" in problem
    statuses = source.probe(interval_s=0.05, batches=2)
    rapl = [s for s in statuses if s.sensor == "rapl:package-0"]
    assert len(rapl) == 1
    assert rapl[0].value is None
    assert "root" in rapl[0].problem
    assert not rapl[0].ok


def test_host_source_without_powercap(tmp_path):
    stat_path = tmp_path / "stat"
    stat_path.write_text(PROC_STAT)
    source = HostSource(0.05, proc_stat=str(stat_path), powercap=str(tmp_path / "no-powercap"))
    assert source.domains == []
    assert len(source.problems) == 1
    metric, sensor, problem = source.problems[0]
    assert (metric, sensor) == ("energy_uj", "rapl")
    assert "no RAPL" in problem


# --- telemetry rows ------------------------------------------------------------------------------

ROWS = [
    TelemetryRow(1700000000.25, "power_mw", 4915.0, "mW", "VDD_IN", "measured", 0.5),
    TelemetryRow(1700000000.25, "temp_c", 46.968, "C", "tj", "measured", 0.5),
    TelemetryRow(1700000000.75, "board_power_mw", 7132.0, "mW", "sum(VDD_GPU_SOC+VDD_CPU_CV)", "modeled", 0.5),
]


def test_row_writer_header_resume_and_readers(tmp_path):
    path = tmp_path / "jetson.csv"
    header = {"source": "jetson", "node": "orin1", "interval_s": 0.5}
    writer = RowWriter(str(path), header)
    assert writer.write(ROWS[:2]) == 2
    writer.close()
    resumed = RowWriter(str(path), {"source": "jetson", "node": "orin1", "interval_s": 0.5, "restart": 1})
    resumed.write(ROWS[2:])
    resumed.comment("stopped\nby the controller")
    resumed.close()

    lines = path.read_text().splitlines()
    assert lines[0] == "# " + json.dumps(header, sort_keys=True)
    assert lines[1] == ",".join(COLUMNS)
    assert lines.count(",".join(COLUMNS)) == 1  # the second writer wrote no second column header
    assert [line for line in lines if line.startswith("# resumed ")] == [
        '# resumed {"interval_s": 0.5, "node": "orin1", "restart": 1, "source": "jetson"}'
    ]
    assert lines[-1] == "# stopped by the controller"
    assert read_header(str(path)) == header
    assert read_rows(str(path)) == ROWS

    frame = pd.read_csv(path, comment="#")
    assert list(frame.columns) == list(COLUMNS)
    assert len(frame) == 3
    assert list(frame["metric"]) == ["power_mw", "temp_c", "board_power_mw"]
    assert list(frame["value"]) == [4915.0, 46.968, 7132.0]
    assert list(frame["sensor"]) == ["VDD_IN", "tj", "sum(VDD_GPU_SOC+VDD_CPU_CV)"]
    assert list(frame["kind"]) == ["measured", "measured", "modeled"]
    assert list(frame["ts_s"]) == [1700000000.25, 1700000000.25, 1700000000.75]


def test_read_rows_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "nvml.csv"
    writer = RowWriter(str(path), {"source": "nvml"})
    writer.write(ROWS[:2])
    writer.close()
    with open(path, "a") as f:
        f.write("1700000001.000000,power_mw,49")  # the sampler was killed mid-line
    assert read_rows(str(path)) == ROWS[:2]


def test_read_header_without_header(tmp_path):
    path = tmp_path / "bare.csv"
    writer = RowWriter(str(path))
    writer.write(ROWS[:1])
    writer.close()
    assert read_header(str(path)) == {}
    assert Path(path).read_text().splitlines()[0] == ",".join(COLUMNS)
    assert read_rows(str(path)) == ROWS[:1]


# -- jtop (jetson-stats) --------------------------------------------------------------------------

# The shape of jtop 4.x's ``jetson.power`` on an Orin NX (rails keyed by their sysfs labels; ``tot``
# is the VDD_IN rail plus its name); values chosen so that ``avg`` differs from ``power``.
JTOP_POWER = [
    {
        "rail": {
            "VDD_CPU_GPU_CV": {"volt": 5000, "curr": 120, "warn": 32760, "crit": 32760, "power": 600, "avg": 580, "online": True},
            "VDD_SOC": {"volt": 5000, "curr": 300, "warn": 32760, "crit": 32760, "power": 1500, "avg": 1400, "online": True},
        },
        "tot": {"volt": 5000, "curr": 900, "warn": 32760, "crit": 32760, "power": 4500, "avg": 4000, "online": True, "name": "VDD_IN"},
    },
    {
        "rail": {
            "VDD_CPU_GPU_CV": {"volt": 5000, "curr": 400, "power": 2000, "avg": 1290, "online": True},
            "VDD_SOC": {"volt": 5000, "curr": 300, "power": 1500, "avg": 1450, "online": True},
        },
        "tot": {"power": 6100, "avg": 5050, "online": True, "name": "VDD_IN"},
    },
]


class FakeJtop:
    """jtop's client interface as the source uses it: jtop(interval=...), start(), ok() (True
    once per new reading, False when the service goes away), power, close()."""

    def __init__(self, interval: float) -> None:
        self.interval, self.readings, self.power, self.closed = interval, list(JTOP_POWER), None, False

    def start(self) -> None:
        pass

    def ok(self) -> bool:
        if not self.readings:
            return False
        self.power = self.readings.pop(0)
        return True

    def close(self) -> None:
        self.closed = True


def test_jtop_rows_use_instantaneous_power_never_jtops_avg() -> None:
    from nodes.telemetry.jtop import JtopSource, power_rows

    rows = power_rows(JTOP_POWER[0], 10.0, 0.5)
    values = {(r.metric, r.sensor): r.value for r in rows}
    assert values == {("power_mw", "VDD_CPU_GPU_CV"): 600.0, ("power_mw", "VDD_SOC"): 1500.0,
                      ("board_power_mw", "VDD_IN"): 4500.0}  # fmt: skip
    no_total_name = power_rows({"rail": JTOP_POWER[0]["rail"], "tot": {"power": 2100, "avg": 1980}}, 0.0, 0.5)
    assert [r.sensor for r in no_total_name if r.metric == "board_power_mw"] == ["sum(VDD_CPU_GPU_CV+VDD_SOC)"]

    source = JtopSource(0.5, jtop_class=FakeJtop, now=iter([1.0, 1.5]).__next__)
    batches = list(source.batches(0.5, lambda: False))  # ends when the service stops answering
    source.close()
    assert [[(r.ts_s, r.value) for r in b if r.metric == "board_power_mw"] for b in batches] == [[(1.0, 4500.0)], [(1.5, 6100.0)]]
    assert source.client.closed and source.client.interval == 0.5


def test_a_missing_jtop_says_what_to_install(monkeypatch) -> None:
    import builtins

    from nodes.telemetry.jtop import JtopSource

    real_import = builtins.__import__

    def no_jtop(name, *args, **kwargs):
        if name == "jtop":
            raise ImportError("No module named 'jtop'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_jtop)
    with pytest.raises(RuntimeError, match="jetson-stats"):
        JtopSource(0.5)
