"""CoCoServe's module-level scaling decisions, as pure functions over a placement of decoder layers on
a server's GPUs (no model, no MPI: the server engine applies what they decide):

- ``placement``: which GPUs hold each layer (its primary and its replicas), each GPU's memory;
- ``speedup_model``: Eq. 1-3 (computation, communication, speedup of a placement) and Eq. 4 (the
  homogeneous closed form with gamma), and gamma fitted from measured times;
- ``scale_up``: Algorithm 1 (replicas added by continuity while the predicted speedup rises);
- ``scale_down``: Algorithm 2 (migrate, evict replicas, then reduce the batch and offload), one
  action at a time for a controller that re-evaluates after each.

Standard library only, Python 3.8.
"""
