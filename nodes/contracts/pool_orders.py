"""How the controller talks to a warm worker pool (``nodes.workers.pool``): the files on the pool's
launch node and how long an idle pool waits.

- ``<pool dir>/ORDER_FILE``: the controller's n-th order, stored atomically, ``{"number": n, "run":
  "<run id>"}`` or ``{"number": n, "stop": "<why>"}``;
- ``<run dir>/RUN_RECORD``: rank 0's record of a run the pool served (order number, runs before it,
  each rank's setup time and the parts it loaded or reused).
"""

ORDER_FILE = "order.json"
RUN_RECORD = "pool-run.json"
IDLE_TIMEOUT_S = 300.0  # a pool without an order for this long stops by itself
