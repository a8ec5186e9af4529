"""DeepSpeed drop-in, no processes: JSON -> Config, one-line errors, flag merging, DeepSpeed's lr
schedules, and the lazy `import megatron_2bw as deepspeed` surface (partition methods and
topologies: test_deepspeed_pipe.py)."""
import importlib.util
import math
import os

import pytest
import torch
from torch import nn

from megatron_2bw.config import Config, ConfigError
from megatron_2bw.config.ds_json import (batch_triple, config_from_deepspeed, explicit_flags,
                                         merge_flags_and_ds_config)
from megatron_2bw.deepspeed.pipe import (LayerSpec, PipeDataParallelTopology, PipelineModule,
                                         TiedLayerSpec)
from megatron_2bw.optim import LRSchedule
import megatron_2bw as deepspeed

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}


def deepspeed_module(name: str):
    """A module of the real DeepSpeed for an equality check; without DeepSpeed installed the
    calling test is skipped, and says so."""
    pytest.importorskip("deepspeed", reason="deepspeed not installed: no equality check against it")
    return importlib.import_module(name)


def one_line_error(fn, *args, match=None, **kwargs):
    with pytest.raises(ConfigError) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg and msg, msg
    if match:
        assert match in msg, msg
    return msg


def test_lazy_surface():
    assert deepspeed.pipe.PipelineModule is PipelineModule
    assert deepspeed.utils.RepeatingLoader.__name__ == "RepeatingLoader"
    assert callable(deepspeed.initialize) and callable(deepspeed.init_distributed)
    loader = deepspeed.utils.RepeatingLoader([1, 2, 3])
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]


# -- batch triple ------------------------------------------------------------------------------------
@pytest.mark.parametrize("given,dp,want", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (4, 4, 32)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (8, 2, 32)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2, (4, 2, 16)),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2}, 2, (4, 2, 16)),
    ({"train_batch_size": 8}, 2, (4, 1, 8)),
    ({"train_micro_batch_size_per_gpu": 3}, 2, (3, 1, 6)),
])
def test_any_two_of_the_batch_triple_imply_the_third(given, dp, want):
    assert batch_triple(given, dp) == want


def test_batch_triple_errors_are_one_line():
    one_line_error(batch_triple, {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                  "gradient_accumulation_steps": 2}, 2,
                   match="train_batch_size 32 != train_micro_batch_size_per_gpu 4 x "
                         "gradient_accumulation_steps 2 x data-parallel size 2 = 16")
    one_line_error(batch_triple, {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2,
                   match="not divisible")
    one_line_error(batch_triple, {"gradient_accumulation_steps": 4}, 1,
                   match="train_micro_batch_size_per_gpu")
    one_line_error(batch_triple, {"train_micro_batch_size_per_gpu": 0}, 1, match="positive")


# -- config errors DeepSpeed users hit -----------------------------------------------------------
@pytest.mark.parametrize("extra,match", [
    ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage 2 is incompatible"),
    ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage 3"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both enabled"),
    ({"optimizer": {"type": "Lamb", "params": {}}}, "optimizer type 'Lamb'"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1, "max_grad_norm": 1}}}, "gradient_clipping"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1, "betaz": [0.9, 0.9]}}}, "'betaz'"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler type 'OneCycle'"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "total_num_steps"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}, "warmup_num_steps"),
    ({"pipeline": {"schedule": "1f1b"}}, "pipeline.schedule '1f1b'"),
    ({"fp16": {"enabled": True, "loss_scale_windw": 100}},
     "'loss_scale_windw' in fp16 (did you mean 'loss_scale_window'?)"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 1, "momentun": 0.9}}},
     "(did you mean 'momentum'?)"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 5}}},
     "(did you mean 'warmup_num_steps'?)"),
    ({"torch_autocast": {"enabled": True}}, "'torch_autocast' is not supported"),
    ({"curriculum_learning": {"enabled": True}}, "'curriculum_learning' is not supported"),
    ({"gradient_allreduce_op": "sum"}, "'gradient_allreduce_op' is not supported"),
    ({"gradient_clipping": -1}, "gradient_clipping"),
    ({"amp": {"enabled": True}}, "amp"),
])
def test_deepspeed_config_errors_are_one_line(extra, match):
    one_line_error(config_from_deepspeed, {**BASE, **extra}, world_size=2, num_stages=2,
                   num_layers=4, match=match)


IGNORED_BY_DEEPSPEED = [
    ({"train_micro_batch_size_per_gp": 2}, "did you mean 'train_micro_batch_size_per_gpu'"),
    ({"gradient_cliping": 1.0}, "unknown DeepSpeed config key 'gradient_cliping' (did you mean "
                                "'gradient_clipping'?)"),
    ({"zero_optimisation": {"stage": 1}}, "did you mean 'zero_optimization'"),
    ({"my_own_setting": 1}, "unknown DeepSpeed config key 'my_own_setting'"),
    ({"pipeline": {"schedul": "flush"}}, "'schedul' in pipeline (did you mean 'schedule'?)"),
]


@pytest.mark.parametrize("extra,match", IGNORED_BY_DEEPSPEED)
def test_keys_deepspeed_ignores_warn_in_one_line_and_strict_refuses(extra, match):
    cfg, settings = config_from_deepspeed({**BASE, **extra}, world_size=2, num_stages=2,
                                          num_layers=4)
    (line,) = settings.notes
    assert "\n" not in line and match in line and line.startswith("megatron-2bw: warning:")
    assert "DeepSpeed ignores it" in line and '"strict": true' in line
    plain, _ = config_from_deepspeed(BASE, world_size=2, num_stages=2, num_layers=4)
    assert cfg == plain   # ignored: the run is the one without the key
    msg = one_line_error(config_from_deepspeed, {**BASE, **extra, "strict": True}, world_size=2,
                         num_stages=2, num_layers=4, match=match)
    assert "strict" in msg


def test_strict_must_be_a_bool_and_sections_deepspeed_validates_stay_refusals():
    one_line_error(config_from_deepspeed, {**BASE, "strict": "yes"}, world_size=2,
                   num_stages=2, num_layers=4, match='strict must be true or false, got "yes"')
    _, settings = config_from_deepspeed({**BASE, "strict": False}, world_size=2, num_stages=2,
                                        num_layers=4)
    assert settings.notes == ()
    one_line_error(config_from_deepspeed, {**BASE, "bf16": {"enabled": False, "enabld": 1}},
                   world_size=2, num_stages=2, num_layers=4, match="'enabld' in bf16")


def test_pipeline_keys_deepspeed_knows_are_accepted_with_their_meaning():
    pipe = {"use_reentrant": False, "partition": "parameters", "seed_layers": True,
            "pipe_partitioned": False, "grad_partitioned": False, "stages": "auto"}
    cfg, settings = config_from_deepspeed({**BASE, "pipeline": pipe}, world_size=2,
                                          num_stages=2, num_layers=4)
    assert settings.notes == () and settings.use_reentrant is False
    _, default = config_from_deepspeed(BASE, world_size=2, num_stages=2, num_layers=4)
    assert default.use_reentrant is True   # DeepSpeed's default
    one_line_error(config_from_deepspeed, {**BASE, "pipeline": {"use_reentrant": "no"}},
                   world_size=2, num_stages=2, num_layers=4,
                   match="pipeline.use_reentrant must be true or false")


@pytest.mark.parametrize("extra", [
    {"tensorboard": {"enabled": True, "output_path": "tb"}}, {"flops_profiler": {"enabled": True}},
    {"activation_checkpointing": {"partition_activations": True}}, {"comms_logger": {}},
    {"torch_autocast": {"enabled": False}}, {"curriculum_learning": {"enabled": False}},
    {"gradient_allreduce_op": "mean"}, {"wandb": {"enabled": False, "team": "t"}},
    {"bf16": {"enabled": True, "immediate_grad_update": True}}])
def test_known_deepspeed_keys_that_change_nothing_here_are_accepted(extra):
    config_from_deepspeed({**BASE, **extra}, world_size=2, num_stages=2, num_layers=4)


def test_2bw_with_fewer_microbatches_than_stages_names_the_deepspeed_keys():
    msg = one_line_error(config_from_deepspeed, {"train_micro_batch_size_per_gpu": 2,
                                                 "gradient_accumulation_steps": 1},
                         world_size=2, num_stages=2, num_layers=4)
    assert msg == ("DeepSpeed config: 2bw needs at least as many microbatches per batch as "
                   "pipeline stages (m=1 < d=2): raise gradient_accumulation_steps to at least 2 "
                   "(DeepSpeed's default is 1), or set \"pipeline\": {\"schedule\": \"flush\"} "
                   "(DeepSpeed's own schedule)")
    # DeepSpeed's default (no gradient_accumulation_steps: 1) at 4 stages
    msg = one_line_error(config_from_deepspeed, {"train_batch_size": 1,
                                                 "train_micro_batch_size_per_gpu": 1},
                         world_size=4, num_stages=4, num_layers=4)
    assert "(m=1 < d=4)" in msg and "at least 4" in msg and '"schedule": "flush"' in msg
    cfg, _ = config_from_deepspeed({"train_micro_batch_size_per_gpu": 2,
                                    "gradient_accumulation_steps": 1,
                                    "pipeline": {"schedule": "flush"}},
                                   world_size=2, num_stages=2, num_layers=4)
    assert cfg.schedule == "flush"


def test_num_stages_not_dividing_the_world_fails_before_any_process_group(monkeypatch):
    import torch.distributed as dist
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    layers = [LayerSpec(nn.Linear, 4, 4) for _ in range(6)]
    one_line_error(PipelineModule, layers, num_stages=3,
                   match="num_stages (3) must divide the world size (4)")
    one_line_error(PipelineModule, layers, topology=PipeDataParallelTopology(2, 1),
                   match="the topology has 2 ranks but the world size is 4")
    one_line_error(PipelineModule, layers[:3], num_stages=4, match="cannot place 3 layers on 4")
    assert not dist.is_initialized()


def test_tied_keys_must_tie_first_and_last_stage(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    layers = [TiedLayerSpec("e", nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 4),
              TiedLayerSpec("e", nn.Linear, 4, 4)] + [LayerSpec(nn.Linear, 4, 4)] * 3
    one_line_error(PipelineModule, layers, num_stages=3, partition_method="uniform",
                   match="tied layer key 'e' sits on stages [0, 1]")


def test_mapping_of_a_full_deepspeed_config():
    ds = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
          "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.8, 0.9], "eps": 1e-6,
                                                     "weight_decay": 0.1}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100,
                                                            "warmup_max_lr": 2e-4,
                                                            "warmup_num_steps": 10}},
          "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                   "loss_scale_window": 500, "hysteresis": 3, "min_loss_scale": 2},
          "gradient_clipping": 0.5, "steps_per_print": 7, "wall_clock_breakdown": True,
          "wandb": {"enabled": True, "project": "p", "group": "g", "team": "tm"},
          "zero_optimization": {"stage": 1},
          "pipeline": {"schedule": "gpipe", "activation_checkpoint_interval": 2}}
    cfg, settings = config_from_deepspeed(ds, world_size=4, num_stages=2, num_layers=8)
    o, p, t = cfg.optimizer, cfg.precision, cfg.train
    assert (cfg.batch.micro_batch_size, cfg.batch.global_batch_size) == (4, 64)
    assert cfg.num_microbatches == 8 and cfg.schedule == "gpipe"
    assert (o.name, o.lr, o.adam_beta1, o.adam_beta2, o.adam_eps, o.weight_decay) == \
        ("adam", 2e-4, 0.8, 0.9, 1e-6, 0.1)
    assert (o.clip_grad, o.lr_warmup_iters, o.lr_decay_iters, o.lr_decay_style) == \
        (0.5, 10, 100, "linear")
    assert settings.lr_schedule.type == "WarmupDecayLR" and settings.lr_schedule.base_lr == 2e-4
    assert not hasattr(o, "ds_scheduler")  # DeepSpeed-only settings stay out of the Config
    assert (p.dtype, p.loss_scale, p.initial_loss_scale, p.loss_scale_window, p.hysteresis,
            p.min_loss_scale) == ("fp16", None, 4096.0, 500, 3, 2)
    # DeepSpeed's wandb section: group is wandb's run group, team its entity (--wandb-entity)
    assert (t.log_interval, t.wall_clock_breakdown, t.wandb_project, t.wandb_group,
            t.wandb_entity, t.wandb_exp_name) == (7, True, "p", "g", "tm", None)
    assert settings.activation_checkpoint_interval == 2
    assert cfg.model.recompute_method == "uniform" and cfg.model.recompute_num_layers == 2


def test_deepspeed_defaults_differ_from_megatron_defaults():
    cfg, _ = config_from_deepspeed({**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
                                   world_size=1, num_stages=1, num_layers=2)
    o = cfg.optimizer
    assert (o.name, o.lr, o.sgd_momentum, o.weight_decay, o.clip_grad) == ("sgd", 0.1, 0, 0, 0)
    assert cfg.train.log_interval == 10 and cfg.schedule == "2bw"
    cfg, _ = config_from_deepspeed({**BASE, "optimizer": {"type": "Adam", "params": {
        "lr": 0.1, "torch_adam": True}}}, world_size=1, num_stages=1, num_layers=2)
    assert cfg.optimizer.weight_decay == 0.01  # torch.optim.AdamW's default
    cfg, _ = config_from_deepspeed({**BASE, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}},
                                   world_size=1, num_stages=1, num_layers=2)
    assert cfg.optimizer.weight_decay == 0.0  # FusedAdam's default


# -- merging with Megatron flags ------------------------------------------------------------------
def flags_cfg(pipeline=2, micro=1, global_batch=None, lr=1e-3, **more):
    return Config().replace(parallel={"pipeline": pipeline}, model={"num_layers": 4},
                            batch={"micro_batch_size": micro, "global_batch_size": global_batch},
                            optimizer={"lr": lr}, **more)


def test_merge_conflict_names_the_flag_and_the_json_key():
    msg = one_line_error(merge_flags_and_ds_config, flags_cfg(micro=8), {"--micro-batch-size"},
                         {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
                         world_size=2)
    assert "--micro-batch-size 8" in msg and "train_micro_batch_size_per_gpu=4" in msg
    msg = one_line_error(merge_flags_and_ds_config, flags_cfg(lr=0.5), ["--lr"],
                         {**BASE, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}},
                         world_size=2)
    assert "--lr 0.5" in msg and "optimizer.params.lr=0.1" in msg
    msg = one_line_error(merge_flags_and_ds_config, flags_cfg(global_batch=64),
                         ["--global-batch-size"], BASE, world_size=2)
    assert "--global-batch-size 64" in msg and "gradient_accumulation_steps" in msg
    msg = one_line_error(merge_flags_and_ds_config, flags_cfg(), ["--clip-grad"],
                         {**BASE, "gradient_clipping": 0.3}, world_size=2)
    assert "--clip-grad" in msg and "gradient_clipping=0.3" in msg


def test_merge_fills_unset_flags_and_keeps_typed_ones():
    cfg = flags_cfg(micro=2, lr=0.5, **{"optimizer.weight_decay": 0.2})
    out, _ = merge_flags_and_ds_config(
        cfg, {"--micro-batch-size", "--lr", "--weight-decay"},
        {"gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 2,
         "optimizer": {"type": "Adam", "params": {"betas": [0.8, 0.95]}},
         "bf16": {"enabled": True}, "pipeline": {"schedule": "flush"}}, world_size=4)
    assert (out.batch.micro_batch_size, out.batch.global_batch_size) == (2, 16)
    assert out.optimizer.lr == 0.5            # typed flag, JSON only implies the default
    assert out.optimizer.weight_decay == 0.2  # typed flag beats DeepSpeed's implied 0
    assert (out.optimizer.adam_beta1, out.optimizer.adam_beta2) == (0.8, 0.95)
    assert out.precision.dtype == "bf16" and out.schedule == "flush"
    assert out.optimizer.clip_grad == 1.0 and out.train.log_interval == 1  # absent: flags stand
    out.validate(4)
    # flags the user did not type take the JSON values (and agreeing typed flags are fine)
    out, _ = merge_flags_and_ds_config(flags_cfg(micro=4), ["--micro-batch-size"],
                                       {"train_batch_size": 16,
                                        "train_micro_batch_size_per_gpu": 4,
                                        "gradient_clipping": 0.0}, world_size=2)
    assert out.batch.global_batch_size == 16 and out.optimizer.clip_grad == 0.0


def test_explicit_flags():
    argv = ["--lr", "0.1", "--micro_batch_size=4", "--fp16", "x", "-v"]
    assert explicit_flags(argv) == {"--lr", "--micro-batch-size", "--fp16"}


# -- DeepSpeed's lr schedules ------------------------------------------------------------------------
SCHEDULES = [
    {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2,
                                    "warmup_num_steps": 7, "warmup_type": "linear"}},
    {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
    {"type": "WarmupDecayLR", "params": {"total_num_steps": 20, "warmup_min_lr": 0,
                                         "warmup_max_lr": 3e-3, "warmup_num_steps": 4}},
    {"type": "WarmupCosineLR", "params": {"total_num_steps": 25, "warmup_num_steps": 6,
                                          "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01,
                                          "warmup_type": "linear"}},
]


def _our_lrs(sched, n=30, lr=2e-3):
    _, settings = config_from_deepspeed({**BASE, "scheduler": sched, "optimizer": {
        "type": "Adam", "params": {"lr": lr}}}, world_size=1, num_stages=1, num_layers=2)
    return [settings.lr_schedule(t) for t in range(n)]


@pytest.mark.parametrize("sched", SCHEDULES)
def test_lr_schedules_follow_deepspeed(sched):
    lr_schedules = deepspeed_module("deepspeed.runtime.lr_schedules")
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2e-3)
    s = getattr(lr_schedules, sched["type"])(opt, **sched["params"])
    ref = []
    for _ in range(30):
        ref.append(opt.param_groups[0]["lr"])   # the lr the engine's step uses
        s.step()                                 # DeepSpeed steps it after the optimizer
    assert _our_lrs(sched) == pytest.approx(ref, rel=1e-12, abs=1e-15)


def test_linear_warmup_lr_written_out():
    """DeepSpeed's WarmupLR arithmetic for the first schedule, written out (no DeepSpeed)."""
    ref = [1e-4] + [1e-4 + (1e-2 - 1e-4) * min(i / 7, 1.0) for i in range(29)]
    assert _our_lrs(SCHEDULES[0]) == pytest.approx(ref, rel=1e-12, abs=1e-15)


def test_deepspeed_lr_warmup_log_shape():
    lrs = _our_lrs({"type": "WarmupLR", "params": {"warmup_num_steps": 10}}, n=12, lr=1.0)
    assert lrs[0] == lrs[1] == 0.0 and lrs[11] == 1.0
    assert lrs[5] == pytest.approx(math.log(5) / math.log(10))


# -- partition methods --------------------------------------------------------------------------------
def test_merge_with_a_config_built_from_real_megatron_flags():
    from megatron_2bw.config.flags import config_from_args
    from megatron_2bw.pretrain import build_parser
    argv = ["--mock-data", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
            "--micro-batch-size", "2", "--lr", "0.01"]
    cfg = config_from_args(build_parser("gpt").parse_args(argv), "gpt")
    ds = {"gradient_accumulation_steps": 4, "gradient_clipping": 0.5,
          "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95], "weight_decay": 0.1}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}}
    cfg, settings = merge_flags_and_ds_config(cfg, explicit_flags(argv), ds, world_size=4)
    cfg = cfg.validate(4)
    assert (cfg.batch.micro_batch_size, cfg.batch.global_batch_size) == (2, 16)
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.optimizer.clip_grad) == \
        (0.01, 0.1, 0.5)
    assert settings.lr_schedule(0) == 0.0  # DeepSpeed's warm-up (log warm-up starts at 0)
    assert settings.lr_schedule(3) == pytest.approx(0.01)  # on --lr, the flag the user typed
    assert LRSchedule(cfg.optimizer, cfg.train.train_iters)(0) != 0.0  # the Config's is Megatron's
    argv += ["--clip-grad", "1"]
    cfg = config_from_args(build_parser("gpt").parse_args(argv), "gpt")
    one_line_error(merge_flags_and_ds_config, cfg, explicit_flags(argv), ds, world_size=4,
                   match="--clip-grad 1.0 conflicts with gradient_clipping=0.5")


@pytest.mark.parametrize("env,want", [
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
      "SLURM_JOB_NODELIST": "gpu[003-004]"}, ("5", "8", "1", "gpu003")),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
     ("2", "4", "2", "127.0.0.1")),
])
def test_init_distributed_reads_slurm_and_mpi_environments(monkeypatch, env, want):
    from megatron_2bw.parallel.launcher import discover_env
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "SLURM_JOB_ID", "SLURM_NODELIST"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    discover_env(29500)
    assert tuple(os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")) \
        == want
    assert os.environ["MASTER_PORT"] == "29500"


def test_initialize_rejects_bad_input_before_any_process_group(monkeypatch):
    import torch.distributed as dist
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    net = PipelineModule([LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 2)], num_stages=1)
    for kwargs, match in [
        ({"model": nn.Linear(2, 2), "config": BASE}, "PipelineModule"),
        ({"model": net, "config": {**BASE, "zero_optimization": {"stage": 2}}}, "stage 2"),
        ({"model": net, "config": {"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2}},
         "not divisible"),
        ({"model": net, "config": BASE, "optimizer": torch.optim.SGD(net.parameters(), lr=0.1),
          "lr_scheduler": object()}, "lr_scheduler"),
        ({"model": net, "config": {**BASE, "optimizer": {"type": "SGD", "params": {}}},
          "optimizer": torch.optim.SGD(net.parameters(), lr=0.1)}, "optimizer given twice"),
        ({"model": net, "config": "/nonexistent/ds.json"}, "does not exist"),
        ({"model": net}, "no DeepSpeed config"),
    ]:
        one_line_error(deepspeed.initialize, match=match, **kwargs)
    next(net.parameters()).requires_grad_(False)
    one_line_error(deepspeed.initialize, model=net, config=BASE, match="frozen parameter")
    assert not dist.is_initialized()
