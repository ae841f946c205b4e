"""The bottom layer of the controller: errors (``errors``), quantities with units (``units``), user
files with line numbers and their pydantic field types (``user_files``, ``user_fields``), and
JSON-ready values (``jsonable``).

Imports nothing of ours but ``nodes.contracts`` (stdlib-only formats and durable writes).
"""
