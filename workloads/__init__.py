"""Workloads: arrival processes, prompt sources, request schedules and traces."""
