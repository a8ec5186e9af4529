"""What a DeepSpeed engine hands out besides itself, as views over our engine: the mpu grid
queries (`engine.grid`), the optimizer and the lr scheduler initialize returns."""
from __future__ import annotations

from typing import Callable

from megatron_2bw.deepspeed.pipe.module import PipelineError
from megatron_2bw.parallel.grid import ProcessGrid


class MPU:
    """DeepSpeed's PipelineParallelGrid queries (the `mpu` Megatron-DeepSpeed code asks) over our
    ProcessGrid, with DeepSpeed's meanings: the "model parallel" group is one whole replica
    (every stage and tensor rank of a data-parallel index: DeepSpeed checks overflow over it),
    the "slice" / tensor-model-parallel group the tensor ranks of a stage."""

    def __init__(self, grid: ProcessGrid, topology=None):
        self.grid = grid
        self._topo = topology
        self.global_rank, self.world_size = grid.rank, grid.world_size
        self.pipe_parallel_size, self.data_parallel_size = grid.pipeline, grid.data
        self.model_parallel_size = self.slice_parallel_size = grid.tensor
        self.stage_id, self.data_parallel_id = grid.stage, grid.dp_rank
        self.is_first_stage, self.is_last_stage = grid.is_first_stage, grid.is_last_stage
        replica = sorted(grid.group_ranks("mp")) or [grid.rank]
        self.ds_model_rank, self.ds_model_world_size = replica.index(grid.rank), len(replica)
        self.dp_group = grid.group_ranks("dp") or [grid.rank]
        self.pp_group = grid.group_ranks("pp") or [grid.rank]
        self.slice_group = grid.group_ranks("tp") or [grid.rank]

    def topology(self):
        return self._topo

    def get_global_rank(self):
        return self.grid.rank

    def get_stage_id(self):
        return self.grid.stage

    def get_data_parallel_id(self):
        return self.grid.dp_rank

    get_pipe_parallel_rank = get_pipeline_model_parallel_rank = get_stage_id

    def get_pipe_parallel_world_size(self):
        return self.grid.pipeline

    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_pipe_parallel_group(self):
        return self.grid.group("pp")

    def get_data_parallel_rank(self):
        return self.grid.dp_rank

    def get_data_parallel_world_size(self):
        return self.grid.data

    def get_data_parallel_group(self):
        return self.grid.group("dp")

    def get_data_parallel_group_ranks(self):
        return list(self.dp_group)

    def get_model_parallel_rank(self):
        return self.ds_model_rank

    def get_model_parallel_world_size(self):
        return self.ds_model_world_size

    def get_model_parallel_group(self):
        return self.grid.group("mp")

    def get_slice_parallel_rank(self):
        return self.grid.tp_rank

    get_tensor_model_parallel_rank = get_slice_parallel_rank

    def get_slice_parallel_world_size(self):
        return self.grid.tensor

    get_tensor_model_parallel_world_size = get_slice_parallel_world_size

    def get_slice_parallel_group(self):
        return self.grid.group("tp")

    get_tensor_model_parallel_group = get_slice_parallel_group

    def stage_to_global(self, stage_id, data=None, model=None):
        """The global rank of `stage_id` in this rank's replica (or `data`'s), this tensor rank
        (or `model`'s)."""
        tp, _, dp = self.grid.coords()
        return self.grid.rank_of(tp if model is None else model, stage_id,
                                 dp if data is None else data)


class OptimizerView:
    """What DeepSpeed returns as the optimizer: param_groups with the current lr; the engine
    steps it (flat buffers, both 2BW versions) inside train_batch. Built from the engine's public
    `optimizer` (state_dict / load_state_dict), the optimizer settings, the lr and the module."""

    def __init__(self, optimizer, settings, lr: Callable[[], list], params: Callable):
        self._optimizer, self._settings, self._lr, self._params = optimizer, settings, lr, params

    @property
    def param_groups(self):
        c = self._settings
        group = {"lr": self._lr()[0], "weight_decay": c.weight_decay,
                 "params": list(self._params())}
        if c.name == "adam":
            group.update(betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps)
        else:
            group.update(momentum=c.sgd_momentum)
        return [group]

    def state_dict(self):
        return self._optimizer.state_dict()

    def load_state_dict(self, state):
        self._optimizer.load_state_dict(state)

    def zero_grad(self, set_to_none=True):
        pass

    def step(self, *a, **k):
        raise PipelineError("the optimizer is stepped by engine.train_batch()")


class LRSchedulerView:
    """DeepSpeed's scheduler object: the lr is a function of the applied steps (the engine
    advances it); step() is a no-op so a script that calls it does not advance it twice."""

    def __init__(self, engine):  # the DeepSpeedPipelineEngine (engine.py) it views
        self._adapter = engine

    def get_lr(self):
        return self._adapter.get_lr()

    def get_last_lr(self):
        return self._adapter.get_lr()  # DeepSpeed: the lr its last step() set, for the next step

    def step(self, *a, **k):
        pass

    def state_dict(self):
        return {"last_batch_iteration": self._adapter.global_steps - 1}

    def load_state_dict(self, state):
        pass
