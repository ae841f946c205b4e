"""Node side: code that runs on Jetsons, phones' USB hosts and the GPU server.

Must stay importable on Python 3.8 (JetPack 5) and must never import ``testbed`` (the controller):
what crosses between the two is files and commands over a transport.
"""
