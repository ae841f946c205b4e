"""What the devices run against a server that is not a split stage: the streaming engine's client
(``serving_client``: Andes, CoCoServe), DiSCo's dispatcher and its endpoints (``dispatch_worker``), and
LLMS' apps that replay a context trace against the on-device service (``context_apps``)."""
