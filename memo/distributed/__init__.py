"""memo.distributed: memo inside megatron-core's tensor, sequence, context and data parallelism.

- :mod:`memo.distributed.cpu_shims`: the small patches megatron-core 0.16.1 needs to run its
  tensor/sequence/context parallel layers and its ``DistributedDataParallel`` in several CPU
  processes over gloo (used by the multi-process tests; they patch nothing where CUDA is
  usable), and a torch norm that sequence parallelism accepts.

This package imports nothing heavy: megatron-core is imported by the functions that need it.
"""
