"""DeepSpeed JSON sections beyond the batch and optimizer (issue 33), no processes: strict mode
at the pretrain and initialize front doors, ZeRO stage 1 as the distributed optimizer (its
reduce_bucket_size and overlap_comm as the gradient reduction's buckets and overlap), the
monitor sections, activation_checkpointing and fp16.auto_cast (the rest of the JSON mapping:
test_deepspeed_config.py)."""
import importlib.util

import torch

import megatron_2bw as deepspeed
from megatron_2bw.config.ds_json import config_from_deepspeed, merge_flags_and_ds_config
from megatron_2bw.deepspeed.pipe import PipelineModule
from test_deepspeed_config import BASE, flags_cfg, one_line_error


def test_pretrain_front_door_warns_too_and_strict_refuses():
    _, settings = merge_flags_and_ds_config(flags_cfg(), [], {**BASE, "gradient_cliping": 1.0},
                                            world_size=2)
    assert len(settings.notes) == 1 and "did you mean 'gradient_clipping'" in settings.notes[0]
    one_line_error(merge_flags_and_ds_config, flags_cfg(), [],
                   {**BASE, "gradient_cliping": 1.0, "strict": True}, world_size=2,
                   match="did you mean 'gradient_clipping'")


def test_initialize_strict_argument_and_flag_refuse_before_any_process_group():
    import argparse
    import torch.distributed as dist
    net = PipelineModule(layers=[torch.nn.Linear(4, 4)], num_stages=1)
    config = {**BASE, "gradient_cliping": 1.0}
    one_line_error(deepspeed.initialize, model=net, config=config, strict=True,
                   match="did you mean 'gradient_clipping'")
    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(
        ["--deepspeed_strict"])
    one_line_error(deepspeed.initialize, args=args, model=net, config=config,
                   match="strict: unknown keys are errors")
    assert not dist.is_initialized()


def test_zero_stage_1_is_the_distributed_optimizer():
    cfg, _ = config_from_deepspeed({**BASE, "zero_optimization": {"stage": 1}}, world_size=4,
                                   num_stages=2, num_layers=4)
    assert cfg.parallel.distributed_optimizer is True
    for zero in ({"stage": 0}, {}):
        cfg, _ = config_from_deepspeed({**BASE, "zero_optimization": zero}, world_size=4,
                                       num_stages=2, num_layers=4)
        assert cfg.parallel.distributed_optimizer is False
    # DeepSpeed's pydantic model coerces "1" and 1.0 to stage 1 (test_deepspeed_types.py)
    cfg, _ = config_from_deepspeed({**BASE, "zero_optimization": {"stage": "1"}}, world_size=4,
                                   num_stages=2, num_layers=4)
    assert cfg.parallel.distributed_optimizer is True
    one_line_error(config_from_deepspeed, {**BASE, "zero_optimization": {"stage": 4}},
                   world_size=4, num_stages=2, num_layers=4, match="must be 0, 1, 2 or 3")
    one_line_error(config_from_deepspeed, {**BASE, "zero_optimization": {"stage": "one"}},
                   world_size=4, num_stages=2, num_layers=4,
                   match='zero_optimization.stage must be an integer, got "one"')


def test_zero_stage_1_bucket_size_and_overlap_are_the_reductions():
    """reduce_bucket_size (elements) and overlap_comm at stage 1: the reduce-scatter's buckets
    and whether they start during the last backward (pipeline/grad_reduce.py)."""
    zero = {"stage": 1, "reduce_bucket_size": 5e8, "overlap_comm": False}
    cfg, _ = config_from_deepspeed({**BASE, "zero_optimization": zero}, world_size=4,
                                   num_stages=2, num_layers=4)
    assert cfg.parallel.grad_bucket_size == 500_000_000 and not cfg.parallel.overlap_grad_reduce
    cfg, _ = config_from_deepspeed({**BASE, "zero_optimization": {"stage": 1}}, world_size=4,
                                   num_stages=2, num_layers=4)
    assert cfg.parallel.grad_bucket_size is None and cfg.parallel.overlap_grad_reduce
    for bad, match in ((0, "must be a positive"), (-3, "must be a positive"),
                       (1.5, "must be an integer, got 1.5"),
                       ("big", 'must be an integer, got "big"')):
        one_line_error(config_from_deepspeed,
                       {**BASE, "zero_optimization": {"stage": 1, "reduce_bucket_size": bad}},
                       world_size=4, num_stages=2, num_layers=4,
                       match=f"zero_optimization.reduce_bucket_size {match}")


def test_monitor_sections_keys_types_and_packages():
    from megatron_2bw.config.ds_json.monitors import check_monitors
    msg = one_line_error(config_from_deepspeed, {**BASE, "comet": {"enabled": True}},
                         world_size=2, num_stages=2, num_layers=4)
    if importlib.util.find_spec("comet_ml") is None:
        assert "the comet_ml package is not installed: pip install comet-ml" in msg
    one_line_error(check_monitors, {"tensorboard": {"enabled": True}},
                   find_spec=lambda name: None, match="pip install tensorboard")
    one_line_error(check_monitors, {"wandb": {"enabled": True}}, find_spec=lambda name: None,
                   match="the wandb package is not installed")
    check_monitors({"comet": {"enabled": False}}, find_spec=lambda name: None)  # off: no package
    one_line_error(config_from_deepspeed, {**BASE, "csv_monitor": {"enabled": True,
                                                                   "output_pth": "x"}},
                   world_size=2, num_stages=2, num_layers=4,
                   match="'output_pth' in csv_monitor (did you mean 'output_path'?)")
    one_line_error(config_from_deepspeed, {**BASE, "tensorboard": {"enabled": "maybe"}},
                   world_size=2, num_stages=2, num_layers=4,
                   match='tensorboard.enabled must be true or false, got "maybe"')


def test_activation_checkpointing_section_and_fp16_auto_cast():
    _, settings = config_from_deepspeed(
        {**BASE, "activation_checkpointing": {"partition_activations": True,
                                              "cpu_checkpointing": True, "profile": True,
                                              "number_checkpoints": 4}},
        world_size=2, num_stages=2, num_layers=4)
    assert len(settings.notes) == 2 and all("\n" not in n for n in settings.notes)
    assert "activation_checkpointing.partition_activations is not supported" in settings.notes[0]
    assert "activation_checkpointing.cpu_checkpointing" in settings.notes[1]
    _, settings = config_from_deepspeed(
        {**BASE, "activation_checkpointing": {"cpu_checkpoint": True}}, world_size=2,
        num_stages=2, num_layers=4)
    assert "did you mean 'cpu_checkpointing'" in settings.notes[0]
    one_line_error(config_from_deepspeed, {**BASE, "activation_checkpointing": {
        "number_checkpoints": 0}}, world_size=2, num_stages=2, num_layers=4,
        match="number_checkpoints must be an integer >= 1")
    one_line_error(config_from_deepspeed, {**BASE, "fp16": {"enabled": True, "auto_cast": True}},
                   world_size=2, num_stages=2, num_layers=4,
                   match="fp16.auto_cast is not supported")
    config_from_deepspeed({**BASE, "fp16": {"enabled": True, "auto_cast": False}},
                          world_size=2, num_stages=2, num_layers=4)
