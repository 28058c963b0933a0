"""Tensor parallelism: each layer split over N ranks, Megatron-style.

    sharding.py       which weight each rank holds (the one table of splits), and the checks
                      that refuse a split that cannot work
    vocab_parallel.py the LM head's greedy argmax reduced across ranks without gathering the
                      logits, and the gather the full sampler needs
    numpy_ranks.py    the numpy twin: N ranks in one process, each a reference model over its
                      shards, partial sums all-reduced as a sum in rank order
    workers.py        cuda: one process per rank, each with its GPU, shards, runner and NCCL
                      communicator (gpu/nccl.py); the engine process sends every rank each step
"""
