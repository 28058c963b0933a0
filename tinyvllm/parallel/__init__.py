"""Tensor parallelism: each layer split over N ranks, Megatron-style.

    sharding.py       which weight each rank holds (the one table of splits), and the checks
                      that refuse a split that cannot work
    vocab_parallel.py the LM head's greedy argmax reduced across ranks without gathering the
                      logits, and the gather the full sampler needs
    numpy_ranks.py    the numpy twin: N ranks in one process, each a reference model over its
                      shards, partial sums all-reduced as a sum in rank order
    workers.py        the group as the engine's runner: rank 0 in the engine process, one
                      process per other rank, each with its GPU, shards, runner and NCCL
                      communicator (gpu/nccl.py); each step goes to the other ranks, then runs here
    cuda_rank.py      a CUDA rank's start-up in stages (runner, communicator, graphs) and close
    numpy_rank.py     a numpy rank in a process of its own, its collectives over pipes (the CPU
                      twin of the rank processes)
"""
