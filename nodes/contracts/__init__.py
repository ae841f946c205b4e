"""What crosses between controller and nodes, defined once (standard library only, Python 3.8); both
sides import these modules:

- ``rank_dirs``: the run's output layout on a node (``<role>-<index>-<node>`` per rank);
- ``records``: the ranks' append-only result files (requests.jsonl, tokens.csv, iterations.csv);
- ``telemetry_rows``: the sampler's row format and its CSV files;
- ``tool_answers`` and ``tool_errors``: what node tools answer (JSON) and how they fail (exit status);
- ``schedules``: request ids; ``draft``: the draft adapter's default place;
- ``speculative_metrics``: the acceptance length, for the workers and the analysis alike;
- ``durable``: atomic writes and synced appends;
- ``pool_orders``: the files by which the controller orders runs from a warm worker pool;
- ``run_config`` (the run the controller builds and the ranks read) with ``scheduler_settings``,
  ``methods/`` (the method registry, one module per method) and ``catalogues`` (the names campaign files
  are checked against and the node registries hold).
"""
