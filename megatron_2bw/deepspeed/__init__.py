"""`deepspeed.initialize` / `init_distributed` / `add_config_arguments` and a pipeline engine with
DeepSpeed's contract, running on the 2BW engine (or flush / gpipe: `"pipeline": {"schedule":
...}`, default 2bw).

    import megatron_2bw as deepspeed          # the only line a DeepSpeed script changes
    deepspeed.init_distributed(dist_backend="gloo")
    net = deepspeed.pipe.PipelineModule(layers=..., num_stages=2, loss_fn=...)
    engine, _, _, _ = deepspeed.initialize(model=net, config="ds_config.json")
    for step in range(steps):
        loss = engine.train_batch(data_iter)

Owns: the DeepSpeed drop-in, DeepSpeed's names over the 2BW engine: initialize.py (initialize,
init_distributed, add_config_arguments), engine.py (DeepSpeedPipelineEngine and its contract
differences from DeepSpeed), views.py (the optimizer / lr scheduler / mpu objects it hands out),
checkpoint.py (DeepSpeed's checkpoint layout, loadable under another stage count),
from_deepspeed.py (what a tag written by DeepSpeed itself restores: steps, ZeRO-0/1 Adam state,
client_state, as DeepSpeed's load_checkpoint), pipe/
(`deepspeed.pipe`: PipelineModule, LayerSpec, TiedLayerSpec, topologies, partitioning), utils.py
(`deepspeed.utils`), runtime/ (`deepspeed.runtime`: utils, pipe.schedule as a view of the flush
tables, pipe.topology's PipelineParallelGrid), accelerator.py, checkpointing.py, comm.py
(`deepspeed.accelerator` / `.checkpointing` / `.comm`), monitor.py (`engine.monitor`: DeepSpeed's
tensorboard / wandb / csv_monitor / comet), names.py (the API version, the module names) and
alias.py (the opt-in `deepspeed` module name for `from deepspeed.x import y`).
Must not import: data, planner, testing, pretrain, generate.
DeepSpeed scripts bring their own data and fix their own layout (no planner); no other
package imports this one, only the `megatron_2bw.pipe` name and the package root's lazy names.
"""
from megatron_2bw.deepspeed.engine import DeepSpeedPipelineEngine
from megatron_2bw.deepspeed.initialize import add_config_arguments, init_distributed, initialize

__all__ = ["DeepSpeedPipelineEngine", "add_config_arguments", "init_distributed", "initialize"]
