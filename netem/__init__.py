"""Link shaping as pure plans: link profiles (``profile``), the topology they shape (``topology``),
tc plans compiled from both (``plan``), tc state read back and compared (``tc_state``), and
bandwidth traces (``trace``). Imports nothing of ``testbed``; applying, verifying and undoing plans
on nodes is ``testbed.links``."""
