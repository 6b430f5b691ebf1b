"""Tensor parallelism over torch.distributed (torchrun): the process group, sharded weights and layers,
and the broadcast of each step from rank 0.

    torchrun --nproc-per-node N -m pocketmoe.serve --model X.gguf

Every process builds a ModelRunner; `init_parallel()` gives its group (world size 1 outside torchrun), the
runner shards the model at load (parallel/model.py), rank 0 runs the server or CLI and broadcasts each
step (parallel/steps.py), the others run `ModelRunner.serve_steps()` until rank 0 says stop.
"""

from pocketmoe.parallel.group import (
    CommStats,
    Parallel,
    RankLost,
    init_parallel,
    rank,
    shutdown_parallel,
    under_torchrun,
    world_size,
)
from pocketmoe.parallel.linear import (
    ColumnParallelLinear,
    HeadParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    split_range,
)

__all__ = [
    "ColumnParallelLinear", "CommStats", "HeadParallelLinear", "Parallel", "RankLost", "RowParallelLinear",
    "VocabParallelEmbedding", "init_parallel", "rank", "shutdown_parallel", "split_range", "under_torchrun",
    "world_size",
]
