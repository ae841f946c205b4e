"""Formats that cross between controller and nodes, defined once (standard library only, Python 3.8).

Both sides import these modules; nothing else in ``nodes/`` is imported by the controller for them.
"""
