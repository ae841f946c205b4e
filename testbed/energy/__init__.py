"""Power and what it costs: power modes set, read back and restored on each node (``power_modes``), the
telemetry recorded beside a run (``telemetry``), and a board's own logs read offline (``board_logs``)."""
