"""One typed config: the single source of truth. Front doors (Megatron flags, DeepSpeed JSON) fill it
through one pipeline (`build.build_config`); the planner returns a new one.

Every dataclass here is frozen: a change is a new config (`cfg.replace(batch={...})`,
`cfg.replace(**{"optimizer.lr": 0.1})`), so nobody changes a setting behind another's back.

`Config.validate(world_size)` checks everything that can be checked without a process group
(the rules: checks.py), raises `ConfigError` with a one-line message naming the setting
and the fix, and returns the config resolved for that world (the data-parallel size and
Megatron's default global batch filled in). It never mutates. `Config.num_microbatches` (m) and
`Config.data_parallel_size` (w) are properties of a resolved config: the one place m is computed
(`num_microbatches` below).

A batch that changes during the run (Megatron's ramps, `BatchConfig`; arithmetic: ramps.py) is
answered here too: `Config.global_batch_at(consumed)`, `Config.num_microbatches_at(consumed)` and
`Config.batch_plan` (every iteration's); `global_batch_size` / `num_microbatches` stay the largest
(the final) batch: what the planner and the memory check size for and an evaluation runs.

`Config.fixed` records which settings the user fixed and where (a flag or a DeepSpeed key), so
the planner keeps them and a contradiction names both sources; it is not part of the settings
(`to_dict` and `==` ignore it).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import NamedTuple

from megatron_2bw.config import ramps
from megatron_2bw.config.choices import NO_COMPENSATION
from megatron_2bw.schedule.kinds import DEFAULT_SCHEDULE


def num_microbatches(global_batch: int, micro_batch: int, data_parallel: int) -> int:
    """m = B / (b x w): microbatches per batch per pipeline (the one place it is computed)."""
    return global_batch // (micro_batch * data_parallel)


@lru_cache(maxsize=64)
def _batch_plan(batch: BatchConfig, seq_length: int, data_parallel: int) -> "ramps.BatchPlan":
    unit = batch.micro_batch_size * data_parallel
    return ramps.plan_of(ramps.batch_stretches(batch, seq_length, unit), unit,
                         lambda b: num_microbatches(b, batch.micro_batch_size, data_parallel))


class Fixed(NamedTuple):
    """A setting the user fixed: the config path (or "batch.num_microbatches" for DeepSpeed's
    gradient_accumulation_steps), where it came from ("--micro-batch-size", "train_batch_size in
    the DeepSpeed config") and its value."""
    path: str
    source: str
    value: object


@dataclass(frozen=True)
class ModelConfig:
    family: str = "gpt"                           # "gpt" or "bert"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None          # None -> 4 * hidden_size
    seq_length: int = 32
    max_position_embeddings: int | None = None  # None -> seq_length
    vocab_size: int = 512
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    untie_embeddings_and_output_weights: bool = False
    layernorm_epsilon: float = 1e-5
    recompute_method: str | None = None           # full recompute: None (off), "uniform", "block"
    bert_binary_head: bool = True
    num_tokentypes: int = 2
    recompute_num_layers: int = 0
    # Megatron's --recompute-granularity: "selective" (core attention: softmax and dropout over
    # the scores), "full" (whole layers, by recompute_method), None (no recomputation); a
    # recompute_method given alone means "full"
    recompute_granularity: str | None = None
    # -- architecture: Megatron's flags and meanings; the defaults are the GPT-2 shape --------
    # (--norm-epsilon fills layernorm_epsilon above; rules: _check_architecture below)
    position_embedding_type: str = "learned_absolute"  # or "rope" (no learned positions)
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0                 # fraction of each head's channels rotated
    normalization: str = "LayerNorm"            # or "RMSNorm"
    swiglu: bool = False                        # gated SiLU MLP (fc1 holds [gate; up])
    group_query_attention: bool = False
    num_query_groups: int = 1                   # key/value heads; read with group_query_attention
    add_bias_linear: bool = True                # --disable-bias-linear: no bias in any linear
    openai_gelu: bool = False                   # tanh-approximated GeLU (GPT-2's "gelu_new")
    num_kv_channels: int | None = None          # --kv-channels; None: hidden_size / heads
    apply_layernorm_1p: bool = False            # norm weights hold gamma - 1 (zero-centred)
    qk_layernorm: bool = False                  # a norm over each query and key head
    eod_mask_loss: bool = False                 # GPT: no loss where the input token is eod_token
    eod_token: int | None = None                # the tokenizer's end-of-document id
    reset_position_ids: bool = False            # learned positions restart after eod_token
    reset_attention_mask: bool = False          # GPT attention stays within each document

    def __post_init__(self):
        if self.recompute_method is not None and self.recompute_granularity is None:
            object.__setattr__(self, "recompute_granularity", "full")

    @property
    def selective_recompute(self) -> bool:
        """--recompute-activations: recompute core attention only (Megatron's meaning)."""
        return self.recompute_granularity == "selective"

    @property
    def full_recompute(self) -> bool:
        return self.recompute_granularity == "full"

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.swiglu:  # Megatron's default: about 2/3 of 4h (three matrices), a multiple of 64
            return int((4 * self.hidden_size * 2 / 3) / 64) * 64
        return 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        """Key/value heads: --num-query-groups with --group-query-attention, else one per head."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        return self.num_kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (Megatron: kv_channels x rotary_percent)."""
        return int(self.kv_channels * self.rotary_percent)

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length


@dataclass(frozen=True)
class ParallelConfig:
    tensor: int = 1                 # t
    pipeline: int = 1               # d
    data: int | None = None         # w; None -> world_size // (t * d)
    rank_order: str = "tp-dp-pp"    # innermost axis first; Megatron's default
    backend: str | None = None      # None -> nccl when CUDA is available, else gloo
    timeout_minutes: float = 10.0
    partition: tuple[int, ...] | None = None  # stage boundaries over [embedding, blocks..., head]
    distributed_optimizer: bool = False  # shard master weights + optimizer state over w ranks
    sequence_parallel: bool = False      # norms, dropout, residuals split along the sequence (t>1)
    # the data-parallel gradient reduction (pipeline/grad_reduce.py): elements per bucket
    # (--ddp-bucket-size; None: Megatron's max(40M, 1M * w)), and whether a bucket starts as
    # soon as the batch's last backward produced it (--no-overlap-grad-reduce: all at R)
    grad_bucket_size: int | None = None
    overlap_grad_reduce: bool = True

    def __post_init__(self):
        if self.partition is not None and not isinstance(self.partition, tuple):
            object.__setattr__(self, "partition", tuple(self.partition))


@dataclass(frozen=True)
class BatchConfig:
    micro_batch_size: int = 1       # b
    global_batch_size: int | None = 1  # B = b * m * w; None: one microbatch per replica
    # Megatron's batch-size ramps (ramps.py): (START, INCREMENT, SAMPLES) up to B, or
    # ((threshold in tokens, global batch), ...) sorted (B is the largest); with
    # decrease_batch_size_if_needed each batch runs rounded down to a multiple of b x w
    rampup_batch_size: tuple[int, int, int] | None = None
    step_batch_size_schedule: tuple[tuple[int, int], ...] | None = None
    decrease_batch_size_if_needed: bool = False

    def __post_init__(self):  # tuples (hashable) also from a saved config's lists
        for name in ("rampup_batch_size", "step_batch_size_schedule"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(tuple(v) if isinstance(v, list) else v
                                                     for v in value))


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adam"
    lr: float = 1e-3
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0          # 0 disables clipping
    lr_warmup_iters: int = 0
    lr_warmup_init: float = 0.0     # --lr-warmup-init: the lr the warmup starts from (Megatron's)
    lr_decay_iters: int | None = None
    lr_decay_style: str = "constant"
    # --optimizer-impl: the kernel that steps it (optim/kernels.py); "auto": torch's fused kernel
    # where it runs, else apex (CUDA) or the unfused ops; "native" (Adam, CPU) only when asked
    impl: str = "auto"
    # Megatron's sample-based schedule: warmup as a fraction of the decay span, or warmup and
    # decay in samples; Megatron-DeepSpeed's in tokens (samples x seq length; optim/lr.py)
    lr_warmup_fraction: float | None = None
    lr_warmup_samples: int = 0
    lr_decay_samples: int | None = None
    lr_warmup_tokens: int | None = None
    lr_decay_tokens: int | None = None
    # Megatron's --decoupled-lr / --decoupled-min-lr: the input embedding and the output layer
    # step at their own lr, between these bounds on the same warmup and decay (optim/lr.py);
    # None: --lr (the min: --min-lr)
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None


@dataclass(frozen=True)
class PrecisionConfig:
    dtype: str = "fp32"
    loss_scale: float | None = None  # fp16 only: a fixed scale; None -> dynamic
    initial_loss_scale: float = 2.0 ** 16
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    max_skipped_steps: int | None = None  # fp16: end the run after this many skips in a row
    tf32: bool = True  # CUDA: fp32 matmuls and convolutions on TF32 tensor cores (--no-tf32: off)
    # bf16/fp16: how backward's gradients reach the fp32 buffer (pipeline/weights.py): "fp32"
    # through per-parameter hooks, "buffer" through a stage-sized low-precision buffer
    grad_accumulation: str = "fp32"

    def skip_limit(self) -> int:
        """The most consecutive skipped fp16 steps a run may take (0: no limit). By default the
        overflows a dynamic scaler needs to fall from the initial to the minimum scale, plus 10:
        more skips than that in a row mean the run diverged, not that the scale was too high."""
        if self.max_skipped_steps is not None:
            return self.max_skipped_steps
        if self.loss_scale is not None:
            return 10
        halvings = math.ceil(math.log2(max(self.initial_loss_scale / self.min_loss_scale, 1.0)))
        return self.hysteresis - 1 + halvings + 10


@dataclass(frozen=True)
class TrainConfig:
    train_iters: int = 10
    seed: int = 1234
    log_interval: int = 1
    eval_interval: int = 0            # 0: no evaluation
    eval_iters: int = 1               # evaluation batches (of m microbatches) per evaluation
    skip_train: bool = False          # --skip-train: evaluate the loaded weights, train none
    save: str | None = None
    load: str | None = None
    save_interval: int = 0            # 0: save only at the end (when --save is given)
    keep_last: int = 0                # > 0: delete all but the newest N checkpoints
    save_optim: bool = True
    load_optim: bool = True
    load_rng: bool = True             # --no-load-rng: keep this process's RNG state on resume
    ckpt_format: str = "torch_dist"   # torch_dist: layout-free (ckpt/); torch: Megatron's layout
    async_save: bool = False          # torch_dist: write in the background while training
    finetune: bool = False
    override_opt_param_scheduler: bool = False  # Megatron's: a checkpoint's lr state may differ
    exit_interval: int = 0
    exit_duration_in_mins: float = 0.0
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    wandb_entity: str | None = None   # Megatron's --wandb-entity (team or user); DeepSpeed's
    wandb_group: str | None = None    # wandb.group (no Megatron flag)
    log_throughput: bool = False      # --log-throughput: Megatron's TFLOP/s field in the line
    wall_clock_breakdown: bool = False
    trace: str | None = None          # write per-rank action traces to {trace}.rank{r}.json
    # observability (training/observe/: logger.py, profiling.py, straggler.py; Megatron's flags)
    tensorboard_dir: str | None = None
    tensorboard_queue_size: int = 1000
    tensorboard_log_interval: int = 1  # per-iteration scalars every N iterations
    log_timers_to_tensorboard: bool = False
    profile: bool = False             # torch.profiler over iterations (start, end] of these ranks
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: tuple[int, ...] = (0,)
    log_straggler: bool = False
    straggler_threshold: float = 20.0  # percent above the median compute time that names a rank
    check_for_nan_in_loss_and_grad: bool = True
    log_params_norm: bool = False      # `params norm` in the line (a collective per interval)
    num_workers: int | None = None     # loader processes per data rank; None: 2 on CUDA, else 0

    @property
    def times_actions(self) -> bool:
        """The engine times its actions (pipeline/timers.py) for one of the readers that need it."""
        return self.wall_clock_breakdown or self.log_timers_to_tensorboard or self.log_straggler


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    schedule: str = DEFAULT_SCHEDULE
    compensation: str = NO_COMPENSATION  # 2BW staleness compensation (pipeline/compensation.py)
    grad_buffers: int | str | None = None  # --2bw-grad-buffers: fp32 gradient buffers per stage
    # (schedule/kinds.py `with_grad_buffers`; None: the kind's own, one per weight version)
    microbatches_per_flush: int | None = None  # --gpipe-microbatches-per-flush: GPipe runs each
    # batch as flushes of at most this many microbatches (None: one flush of all m)

    fixed: tuple[Fixed, ...] = field(default=(), compare=False, repr=False)

    # -- derived sizes (of a resolved config: see `resolved`) -----------------------------------
    @property
    def data_parallel_size(self) -> int:
        """w. A config not resolved for a world (parallel.data None) is one replica."""
        return self.parallel.data if self.parallel.data is not None else 1

    @property
    def global_batch_size(self) -> int:
        """B; Megatron's default (None) is one microbatch per replica."""
        b = self.batch
        return b.global_batch_size or b.micro_batch_size * self.data_parallel_size

    @property
    def num_microbatches(self) -> int:
        """m = B / (b x w) (a ramp's largest, the final one)."""
        return num_microbatches(self.global_batch_size, self.batch.micro_batch_size,
                                self.data_parallel_size)

    def global_batch_at(self, consumed: int) -> int:
        """The global batch of the iteration after `consumed` samples (Megatron's calculator's
        running batch; ramps.py), B without a ramp."""
        unit = self.batch.micro_batch_size * self.data_parallel_size
        return ramps.running_batch(self._sized_batch, self.model.seq_length, unit, consumed)

    def num_microbatches_at(self, consumed: int) -> int:
        """m of the iteration that starts after `consumed` samples."""
        return num_microbatches(self.global_batch_at(consumed), self.batch.micro_batch_size,
                                self.data_parallel_size)

    @property
    def batch_plan(self) -> "ramps.BatchPlan":
        """Every iteration's global batch, m and consumed samples (ramps.BatchPlan); ValueError
        when the batch falls or rounds to nothing (`validate` refuses such a config first)."""
        return _batch_plan(self._sized_batch, self.model.seq_length, self.data_parallel_size)

    @property
    def _sized_batch(self) -> BatchConfig:
        b = self.batch
        return b if b.global_batch_size else dataclasses.replace(
            b, global_batch_size=self.global_batch_size)

    def resolved(self, world_size: int | None) -> "Config":
        """This config on `world_size` processes: the data-parallel size (world / (t x d)) and the
        default global batch filled in. Pure; `validate` checks the result."""
        p = self.parallel
        data = p.data
        if data is None and world_size is not None and p.tensor >= 1 and p.pipeline >= 1:
            data = max(world_size // (p.tensor * p.pipeline), 1)
        out = self.replace(parallel={"data": data}) if data != p.data else self
        if out.batch.global_batch_size is None:
            out = out.replace(batch={"global_batch_size": out.global_batch_size})
        return out

    # -- changes ---------------------------------------------------------------------------------
    def replace(self, **changes) -> "Config":
        """A copy with `changes`: a top-level field by name (schedule="flush"), a section's fields
        as a dict (batch={"micro_batch_size": 2}) or by dotted path ("optimizer.lr")."""
        top: dict = {}
        for key, value in changes.items():
            section, _, name = key.partition(".")
            if name:
                value = {name: value}
            current = top.get(section, getattr(self, section))
            if isinstance(value, dict) and dataclasses.is_dataclass(current):
                top[section] = dataclasses.replace(current, **value)
            else:
                top[section] = value
        return dataclasses.replace(self, **top)

    def get(self, path: str):
        """The setting at a dotted path ("optimizer.lr", "schedule")."""
        section, _, name = path.rpartition(".")
        return getattr(getattr(self, section) if section else self, name)

    def source_of(self, path: str) -> str | None:
        """Where the user fixed `path` ("--global-batch-size", "train_batch_size in the DeepSpeed
        config"), or None when the setting is a default the planner may choose."""
        return next((f.source for f in self.fixed if f.path == path), None)

    def fixed_value(self, path: str):
        return next((f.value for f in self.fixed if f.path == path), None)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("fixed")
        return d

    # -- validation ----------------------------------------------------------------------------
    def validate(self, world_size: int | None = None) -> "Config":
        """Raise ConfigError (one line) for the first bad setting; return the config resolved for
        `world_size` when all is well (self itself is never changed)."""
        return self.resolved(world_size)._check(world_size)

    def _check(self, world_size: int | None) -> "Config":
        from megatron_2bw.config.checks import check_config  # the rules (checks.py)
        return check_config(self, world_size)
