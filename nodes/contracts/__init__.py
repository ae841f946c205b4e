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
- ``paced_steps``: a paced step's row (``steps.csv``) and its overrun rule, for the fidelity monitor;
- ``target_model`` and ``compute_profile``: the model a campaign emulates and how long its steps take;
- ``kv_chunk_bytes``: an LLMS chunk's bytes; ``service_files``: where a run's context service lives;
- ``chat_template``: a chat model's template, for task prompts and the chat route alike;
- ``journal_values``: a journal's values checked again before they reach a command line;
- ``root_paths``: root's own files on a node; ``monsoon_csv``: a Monsoon power monitor's CSV;
- ``run_config`` (the run the controller builds and the ranks read) with ``scheduler_settings``,
  ``methods/`` (the method registry, one module per method) and ``catalogues`` (the names campaign files
  are checked against and the node registries hold).
"""
