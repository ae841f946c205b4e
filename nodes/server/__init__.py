"""The GPU server: NVML telemetry and power control per GPU, and the host's CPUs and RAPL domains
(the only energy a server without GPUs has)."""
