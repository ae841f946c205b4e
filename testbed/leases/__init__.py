"""Leases on a lab's machines, so that two controllers never drive one machine at once: the lease file
on each machine and its protocol (:mod:`.lease_file`), and the controller's side that takes every lease
a campaign needs or none, renews them while it runs and gives them back (:mod:`.keeper`)."""
