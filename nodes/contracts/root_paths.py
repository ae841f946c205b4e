"""Root's own files of the suite on a node: privileged tools write and read them only there, never
in a directory the SSH user can write (a root process following a user's path writes where the user
points it). ``/var/lib/hil-testbed`` (0755, root:root) is made when the delay handler is installed
(testbed/provisioning/delay_handler.py); an emulated node has one of its own."""

ROOT_STATE = "/var/lib/hil-testbed"
# What `jetson_clocks --store` saves and `--restore` puts back, when the power driver runs it with sudo.
JETSON_CLOCKS_FILE = ROOT_STATE + "/l4t_dfs.conf"
