#!/usr/bin/env bash
# The node code's GPU side on a real NVIDIA GPU (run it through the device tool, or on a lab's server):
# the NVML telemetry source through the sampler CLI while a known load runs, the server power driver's
# read-only `show` (nothing is set), and bench/cocoserve_gpu.py's decode, copy and NVML sections.
# Usage: OUT=DIR bash scripts/gpu_node_check.sh   (about 3 minutes on an H100/H200)
set -u
OUT=${OUT:-/tmp/gpu_node_check}; mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,power.limit,power.default_limit --format=csv | tee "$OUT/nvidia_smi.csv"
echo "== probe"; $PY -m nodes.telemetry.sampler --source nvml --probe | tee "$OUT/nvml_probe.json"
echo "== sampler 12 s: idle 3 s, matmul load 6 s, idle 3 s"
$PY -m nodes.telemetry.sampler --source nvml --interval-ms 100 --max-seconds 12 --node gpu-server --out "$OUT/nvml_samples.csv" &
sampler=$!
sleep 3
$PY - <<'P'
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
end = time.time() + 6.0; n = 0
while time.time() < end:
    for _ in range(20):
        a @ b
    torch.cuda.synchronize(); n += 20
print("load: %d bf16 8192^3 products in 6 s" % n)
P
wait $sampler; echo "sampler rc=$?"; wc -l "$OUT/nvml_samples.csv"
echo "== power show (read only)"; $PY -m nodes.power --kind server --journal /tmp/power.journal show | tee "$OUT/power_show.json"
test ! -e /tmp/power.journal && echo "no journal written (nothing changed)"
echo "== cocoserve_gpu decode, copy, nvml"
timeout 300 $PY bench/cocoserve_gpu.py --skip profile,restart --out "$OUT" 2>&1 | tail -40
ls -la "$OUT"
