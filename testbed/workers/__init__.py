"""What runs on the nodes for a run: the split run's config, staging and MPI launch (``split_run``), the warm
worker pool that serves a campaign's runs (``pool``), and the on-device LLM service daemons (``context_service``)."""
