"""Checks before a campaign: the inventory against its nodes (``inventory_check``), and this machine's
fitness for the emulated testbed (``doctor``)."""
