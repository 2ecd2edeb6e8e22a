"""Data parallelism on JAX's own machinery: a mesh with a data axis (`jax.sharding`), the
train step jitted with the batch sharded over it (GSPMD inserts the gradient all-reduce),
placement of replicated state and per-process batches, the compiled program's collectives,
a 1x gradient helper for ``shard_map``/``pmap`` code, and ``jax.distributed`` start-up for
several processes (`funcgrad.parallel.distributed`; ``funcgrad launch`` starts them).

The step's contract does not change: the loss is written on the global batch, exactly as on
one device, and the step computes the same numbers (see docs/guide/distributed.md).
"""
from funcgrad.parallel.collectives import Collective as Collective
from funcgrad.parallel.collectives import CollectiveReport as CollectiveReport
from funcgrad.parallel.collectives import collectives as collectives
from funcgrad.parallel.distributed import DistributedInfo as DistributedInfo
from funcgrad.parallel.distributed import distributed_init as distributed_init
from funcgrad.parallel.grad import data_parallel_value_and_grad as data_parallel_value_and_grad
from funcgrad.parallel.grad import device_key as device_key
from funcgrad.parallel.placement import DATA_AXIS as DATA_AXIS
from funcgrad.parallel.placement import data_mesh as data_mesh
from funcgrad.parallel.placement import process_batch as process_batch
from funcgrad.parallel.placement import process_rows as process_rows
from funcgrad.parallel.placement import replicate as replicate
from funcgrad.parallel.placement import shard_batch as shard_batch
