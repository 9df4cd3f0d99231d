"""Running one model over several processes: the tensor-parallel group and its collectives
(parallel_state.py), how the layers cut each weight (sharding.py), and the shared-memory
broadcast of each step's plan to the workers (shm_broadcast.py)."""
