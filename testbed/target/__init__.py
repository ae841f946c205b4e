"""Target emulation: each node's compute profile (``compute_profiles``), measuring one on a node
(``profiling``), and what a run on the emulated testbed stands for: the target model, each node's paced
rates and the dilation (``emulation``)."""
