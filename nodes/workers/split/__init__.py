"""The split-inference ranks (U-shape, U-Sarathi, HAT): the device's worker (``device``), a server pipeline
stage (``server_stage``), the server's state the replies carry (``state_monitor``) and HAT's sizing of
chunks and parallel drafts from it (``hat_sizing``: Eq. 3, Eq. 6)."""
