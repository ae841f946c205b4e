"""What runs on the nodes for a run: a split run's spec, ranks and run config (``split_spec``), its MPI
launch (``mpi_launch``), staging, launching and collecting it (``split_run``), the warm worker pool that
serves a campaign's runs (``pool``), and the on-device LLM service daemons (``context_service``)."""
