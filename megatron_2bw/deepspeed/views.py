"""What a DeepSpeed engine hands out besides itself, as views over our engine: the mpu grid
queries (`engine.grid`), the optimizer and the lr scheduler initialize returns."""
from __future__ import annotations

from typing import Callable

from megatron_2bw.deepspeed.pipe.module import PipelineError
from megatron_2bw.parallel.grid import ProcessGrid


class MPU:
    """DeepSpeed's PipelineParallelGrid queries over our ProcessGrid."""

    def __init__(self, grid: ProcessGrid):
        self.grid = grid
        self.pipe_parallel_size, self.data_parallel_size = grid.pipeline, grid.data
        self.model_parallel_size = grid.tensor
        self.stage_id, self.data_parallel_id = grid.stage, grid.dp_rank

    def get_global_rank(self):
        return self.grid.rank

    def get_stage_id(self):
        return self.grid.stage

    get_pipe_parallel_rank = get_stage_id

    def get_pipe_parallel_world_size(self):
        return self.grid.pipeline

    def get_pipe_parallel_group(self):
        return self.grid.group("pp")

    def get_data_parallel_rank(self):
        return self.grid.dp_rank

    def get_data_parallel_world_size(self):
        return self.grid.data

    def get_data_parallel_group(self):
        return self.grid.group("dp")

    def get_model_parallel_rank(self):
        return self.grid.tp_rank

    def get_model_parallel_world_size(self):
        return self.grid.tensor

    def get_model_parallel_group(self):
        return self.grid.group("tp")

    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size

    def stage_to_global(self, stage_id, data=None, model=0):
        tp, _, dp = self.grid.coords()
        return self.grid.rank_of(model if model is not None else tp, stage_id,
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
