"""DiSCo's device-side dispatch: which endpoint (the device's own model, the server's API, or both in
a race) produces a request's first token under a budget on the constrained endpoint's input tokens.

- ``policy``: Algorithm 1 (which endpoint is the constrained one), Algorithm 2 (the device-constrained
  wait map with tail protection) and Algorithm 3 (the server-constrained length threshold), as pure
  functions of profiled distributions, so that they are checked exactly and timed without a model.

Standard library and numpy only, Python 3.8.
"""
