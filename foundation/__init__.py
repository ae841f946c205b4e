"""The bottom layer of the controller: errors (``errors``), quantities with units (``units``), user
files with line numbers and their pydantic field types (``user_files``, ``user_fields``),
JSON-ready values (``jsonable``) and waiting for a child through Ctrl-C (``child_process``).

Imports nothing of ours but ``nodes.contracts`` (stdlib-only formats and durable writes).
"""
