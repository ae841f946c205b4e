"""The serving engine's policy: which requests run each continuous-batching iteration.

- ``qoe_shadow``: the server's shadow of each client's token buffer and Andes' QoE (Eq. 1) of it,
  predicted over a lookahead if the request is served or left waiting (Eq. 2's gain);
- ``knapsack``: Andes' Algorithm 1 (greedy packing by Eq. 5 priority) and Algorithm 2 (the exact DP);
- ``schedulers``: ``fcfs``, ``rr``, ``andes`` and ``andes-dp``, each a pure decision over a snapshot of
  the requests, so that they are tested and benchmarked without a model.

Standard library and numpy only, Python 3.8.
"""
