"""The bottom layer: errors, units, user-file messages and JSON-ready values.

Imports nothing of ours but ``nodes.contracts`` (stdlib-only formats and durable writes).
"""
