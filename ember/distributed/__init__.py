"""Tensor parallelism: the process group and its collectives (parallel_state.py), and how
heads, rows and the vocabulary are split among the ranks (sharding.py). The layers
(layers/linear.py, layers/embedding.py) own their shards and call the collectives."""
