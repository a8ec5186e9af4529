"""One typed config: the single source of truth. Front doors (Megatron flags, DeepSpeed JSON) fill it
through one pipeline (`config_pipeline.build_config`); the planner returns a new one.

Every dataclass here is frozen: a change is a new config (`cfg.replace(batch={...})`,
`cfg.replace(**{"optimizer.lr": 0.1})`), so nobody changes a setting behind another's back.

`Config.validate(world_size)` checks everything that can be checked without a process group,
raises `ConfigError` with a one-line message naming the setting and the fix, and returns the
config resolved for that world (the data-parallel size and Megatron's default global batch filled
in). It never mutates. `Config.num_microbatches` (m) and `Config.data_parallel_size` (w) are
properties of a resolved config: the one place m is computed (`num_microbatches` below).

`Config.fixed` records which settings the user fixed and where (a flag or a DeepSpeed key), so
the planner keeps them and a contradiction names both sources; it is not part of the settings
(`to_dict` and `==` ignore it).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from .pipeline.compensation import NONE as NO_COMPENSATION, compensation_error
from .pipeline.registry import DEFAULT_SCHEDULE, schedule_kind, schedule_names

SCHEDULES = schedule_names()  # the schedule kinds own their names and rules (pipeline/registry.py)
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "sgd")
RANK_ORDERS = ("tp-dp-pp", "tp-pp-dp")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_GRANULARITIES = ("selective", "full")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
CKPT_FORMATS = ("torch_dist", "torch")  # checkpointing.py; Megatron's names, its default first


class ConfigError(ValueError):
    """A bad setting. The message is one line: what is wrong and how to fix it."""


MODEL_FAMILIES = ("gpt", "bert")


def num_microbatches(global_batch: int, micro_batch: int, data_parallel: int) -> int:
    """m = B / (b x w): microbatches per batch per pipeline (the one place it is computed)."""
    return global_batch // (micro_batch * data_parallel)


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
        return self.hidden_size // self.num_attention_heads

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

    def __post_init__(self):
        if self.partition is not None and not isinstance(self.partition, tuple):
            object.__setattr__(self, "partition", tuple(self.partition))


@dataclass(frozen=True)
class BatchConfig:
    micro_batch_size: int = 1       # b
    global_batch_size: int | None = 1  # B = b * m * w; None: one microbatch per replica


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
    lr_decay_iters: int | None = None
    lr_decay_style: str = "constant"


@dataclass(frozen=True)
class PrecisionConfig:
    dtype: str = "fp32"
    loss_scale: float | None = None  # fp16 only: a fixed scale; None -> dynamic
    initial_loss_scale: float = 2.0 ** 16
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    max_skipped_steps: int | None = None  # fp16: end the run after this many skips in a row

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
    save: str | None = None
    load: str | None = None
    save_interval: int = 0            # 0: save only at the end (when --save is given)
    keep_last: int = 0                # > 0: delete all but the newest N checkpoints
    save_optim: bool = True
    load_optim: bool = True
    ckpt_format: str = "torch_dist"   # torch_dist: layout-free (ckpt/); torch: Megatron's layout
    async_save: bool = False          # torch_dist: write in the background while training
    finetune: bool = False
    exit_interval: int = 0
    exit_duration_in_mins: float = 0.0
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    wall_clock_breakdown: bool = False
    trace: str | None = None          # write per-rank action traces to {trace}.rank{r}.json
    # observability (logger.py, profiling.py, straggler.py; Megatron's flag names)
    tensorboard_dir: str | None = None
    tensorboard_queue_size: int = 1000
    log_timers_to_tensorboard: bool = False
    profile: bool = False             # torch.profiler over iterations (start, end] of these ranks
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: tuple[int, ...] = (0,)
    log_straggler: bool = False
    straggler_threshold: float = 20.0  # percent above the median compute time that names a rank
    check_for_nan_in_loss_and_grad: bool = True

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
        """m = B / (b x w)."""
        return num_microbatches(self.global_batch_size, self.batch.micro_batch_size,
                                self.data_parallel_size)

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
        m, p, b, o, pr = self.model, self.parallel, self.batch, self.optimizer, self.precision
        if self.schedule not in SCHEDULES:
            _fail(f"unknown pipeline schedule {self.schedule!r}: use one of {', '.join(SCHEDULES)} "
                  "(--pipeline-schedule)")
        for name, value in (("--tensor-model-parallel-size", p.tensor),
                            ("--pipeline-model-parallel-size", p.pipeline)):
            if value < 1:
                _fail(f"{name} must be >= 1, got {value}")
        if p.data is not None and p.data < 1:
            _fail(f"--data-parallel-size must be >= 1, got {p.data}")
        if world_size is not None:
            model_parallel = p.tensor * p.pipeline
            if world_size % model_parallel != 0:
                _fail(f"world size {world_size} is not divisible by tensor x pipeline = "
                      f"{p.tensor} x {p.pipeline} = {model_parallel}: launch a multiple of "
                      f"{model_parallel} processes or change the parallel sizes")
            w = self.data_parallel_size
            if p.tensor * p.pipeline * w != world_size:
                _fail(f"world size {world_size} != tensor x pipeline x data = {p.tensor} x "
                      f"{p.pipeline} x {w}: launch {p.tensor * p.pipeline * w} processes or "
                      "change the parallel sizes")
        if p.rank_order not in RANK_ORDERS:
            _fail(f"unknown rank order {p.rank_order!r}: use one of {', '.join(RANK_ORDERS)}")
        if p.timeout_minutes <= 0:
            _fail(f"--distributed-timeout-minutes must be > 0, got {p.timeout_minutes}")
        for name, value in (("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
                            ("--num-attention-heads", m.num_attention_heads),
                            ("--seq-length", m.seq_length), ("vocab size", m.vocab_size),
                            ("--micro-batch-size", b.micro_batch_size),
                            ("--global-batch-size", b.global_batch_size),
                            ("--train-iters", self.train.train_iters),
                            ("--log-interval", self.train.log_interval)):
            if value < 1:
                _fail(f"{name} must be >= 1, got {value}")
        for name, value in (("--ffn-hidden-size", m.ffn_hidden_size),
                            ("--max-position-embeddings", m.max_position_embeddings)):
            if value is not None and value < 1:
                _fail(f"{name} must be >= 1 (or unset for the default), got {value}")
        if m.hidden_size % m.num_attention_heads != 0:
            _fail(f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
                  f"{m.num_attention_heads}: pick a head count that divides the hidden size")
        if m.num_attention_heads % p.tensor != 0:
            _fail(f"--num-attention-heads {m.num_attention_heads} is not divisible by "
                  f"--tensor-model-parallel-size {p.tensor}")
        if m.max_positions < m.seq_length:
            _fail(f"--max-position-embeddings {m.max_positions} < --seq-length {m.seq_length}: "
                  "raise --max-position-embeddings")
        if m.family not in MODEL_FAMILIES:
            _fail(f"unknown model family {m.family!r}: use one of {', '.join(MODEL_FAMILIES)}")
        if m.vocab_size % p.tensor != 0:
            _fail(f"vocabulary size {m.vocab_size} is not divisible by "
                  f"--tensor-model-parallel-size {p.tensor}: pad it with "
                  "--make-vocab-size-divisible-by")
        if p.partition is not None:
            bounds, n = p.partition, m.num_layers + 2
            if (len(bounds) != p.pipeline + 1 or bounds[0] != 0 or bounds[-1] != n
                    or any(x >= y for x, y in zip(bounds, bounds[1:]))):
                _fail(f"stage partition {bounds} must rise strictly from 0 to {n} in "
                      f"{p.pipeline} steps (one boundary per stage)")
        if m.recompute_granularity not in (None,) + RECOMPUTE_GRANULARITIES:
            _fail(f"unknown --recompute-granularity {m.recompute_granularity!r}: use one of "
                  f"{', '.join(RECOMPUTE_GRANULARITIES)}")
        if m.full_recompute and m.recompute_method is None:
            _fail("--recompute-granularity full needs --recompute-method {uniform,block} and "
                  "--recompute-num-layers N")
        if m.selective_recompute and m.recompute_method is not None:
            _fail("--recompute-method applies to --recompute-granularity full, not selective: "
                  "drop one of them")
        if p.sequence_parallel:
            if p.tensor < 2:
                _fail("--sequence-parallel splits the sequence across tensor ranks: it needs "
                      f"--tensor-model-parallel-size > 1 (got {p.tensor})")
            if m.seq_length % p.tensor:
                _fail(f"--sequence-parallel needs --seq-length {m.seq_length} divisible by "
                      f"--tensor-model-parallel-size {p.tensor}")
        if m.recompute_method is not None:
            if m.recompute_method not in RECOMPUTE_METHODS:
                _fail(f"unknown --recompute-method {m.recompute_method!r}: use one of "
                      f"{', '.join(RECOMPUTE_METHODS)}")
            if m.recompute_num_layers < 1:
                _fail(f"--recompute-num-layers must be >= 1 with --recompute-method, got "
                      f"{m.recompute_num_layers}")
            # Megatron's bounds: block recomputes the first N layers of each stage, uniform
            # groups the layers into chunks of N
            per_stage = m.num_layers // max(p.pipeline, 1)
            most, what = ((per_stage, f"the {per_stage} layers per pipeline stage")
                          if m.recompute_method == "block" else
                          (m.num_layers, f"--num-layers {m.num_layers}"))
            if most >= 1 and m.recompute_num_layers > most:
                _fail(f"--recompute-num-layers {m.recompute_num_layers} is more than {what} "
                      f"(--recompute-method {m.recompute_method}): use at most {most}")
        _check_architecture(m, p)
        if p.pipeline > m.num_layers:
            _fail(f"--pipeline-model-parallel-size {p.pipeline} is larger than --num-layers "
                  f"{m.num_layers}: every stage needs at least one transformer layer")
        for name, value in (("--hidden-dropout", m.hidden_dropout),
                            ("--attention-dropout", m.attention_dropout)):
            if not 0.0 <= value < 1.0:
                _fail(f"{name} must be in [0, 1), got {value}")
        w = self.data_parallel_size
        if b.global_batch_size % (b.micro_batch_size * w) != 0:
            _fail(f"--global-batch-size {b.global_batch_size} is not divisible by "
                  f"--micro-batch-size x data-parallel size = {b.micro_batch_size} x {w}: "
                  f"use a multiple of {b.micro_batch_size * w}")
        kind = schedule_kind(self.schedule)
        low = kind.min_microbatches(p.pipeline)
        error = kind.microbatch_error(
            p.pipeline, self.num_microbatches,
            f"raise --global-batch-size to at least {low * b.micro_batch_size * w} or lower "
            "--micro-batch-size")
        if error:
            _fail(error)
        error = compensation_error(self.compensation, self.schedule, o.name, o.sgd_momentum)
        if error:
            _fail(error)
        tr = self.train
        for name, value in (("--eval-interval", tr.eval_interval),
                            ("--save-interval", tr.save_interval),
                            ("--keep-last", tr.keep_last),
                            ("--exit-interval", tr.exit_interval),
                            ("--exit-duration-in-mins", tr.exit_duration_in_mins)):
            if value < 0:
                _fail(f"{name} must be >= 0, got {value}")
        if tr.eval_interval and tr.eval_iters < 1:
            _fail(f"--eval-iters must be >= 1 with --eval-interval, got {tr.eval_iters}")
        if tr.save_interval and not tr.save:
            _fail("--save-interval needs --save DIR: say where checkpoints go")
        if tr.ckpt_format not in CKPT_FORMATS:
            _fail(f"unknown --ckpt-format {tr.ckpt_format!r}: use one of "
                  f"{', '.join(CKPT_FORMATS)}")
        if tr.async_save and tr.ckpt_format != "torch_dist":
            _fail(f"--async-save needs --ckpt-format torch_dist (the {tr.ckpt_format} format is "
                  "written synchronously): drop one of them")
        if tr.async_save and not tr.save:
            _fail("--async-save needs --save DIR: say where checkpoints go")
        _check_observability(tr, world_size)
        if o.name not in OPTIMIZERS:
            _fail(f"unknown optimizer {o.name!r}: use one of {', '.join(OPTIMIZERS)}")
        if o.lr < 0 or o.min_lr < 0:
            _fail(f"learning rates must be >= 0, got --lr {o.lr} --min-lr {o.min_lr}")
        if o.clip_grad < 0:
            _fail(f"--clip-grad must be >= 0 (0 disables clipping), got {o.clip_grad}")
        if o.weight_decay < 0:
            _fail(f"--weight-decay must be >= 0, got {o.weight_decay}")
        if not (0 <= o.adam_beta1 < 1 and 0 <= o.adam_beta2 < 1):
            _fail(f"--adam-beta1/--adam-beta2 must be in [0, 1), got {o.adam_beta1}, "
                  f"{o.adam_beta2}")
        if o.lr_decay_style not in LR_DECAY_STYLES:
            _fail(f"unknown --lr-decay-style {o.lr_decay_style!r}: use one of "
                  f"{', '.join(LR_DECAY_STYLES)}")
        if o.lr_warmup_iters < 0:
            _fail(f"--lr-warmup-iters must be >= 0, got {o.lr_warmup_iters}")
        if pr.dtype not in PRECISIONS:
            _fail(f"unknown precision {pr.dtype!r}: use one of {', '.join(PRECISIONS)}")
        if pr.loss_scale is not None and pr.loss_scale <= 0:
            _fail(f"--loss-scale must be > 0, got {pr.loss_scale}")
        if pr.initial_loss_scale <= 0:
            _fail(f"--initial-loss-scale must be > 0, got {pr.initial_loss_scale}")
        if pr.min_loss_scale <= 0:
            _fail(f"--min-loss-scale must be > 0, got {pr.min_loss_scale}")
        if pr.max_skipped_steps is not None and pr.max_skipped_steps < 0:
            _fail(f"--max-skipped-steps must be >= 0 (0: no limit), got {pr.max_skipped_steps}")
        return self


def _fail(message: str):
    raise ConfigError(message)


def _check_observability(tr: TrainConfig, world_size: int | None) -> None:
    """The rules of the logging, profiling and straggler flags (one-line errors)."""
    if tr.log_timers_to_tensorboard and not tr.tensorboard_dir:
        _fail("--log-timers-to-tensorboard needs --tensorboard-dir DIR: say where events go")
    if tr.tensorboard_queue_size < 1:
        _fail(f"--tensorboard-queue-size must be >= 1, got {tr.tensorboard_queue_size}")
    if tr.profile:
        if not 0 <= tr.profile_step_start < tr.profile_step_end:
            _fail(f"--profile-step-start {tr.profile_step_start} / --profile-step-end "
                  f"{tr.profile_step_end}: need 0 <= start < end (the iterations after start up "
                  "to end are profiled)")
        bad = [r for r in tr.profile_ranks if r < 0 or (world_size and r >= world_size)]
        if bad or not tr.profile_ranks:
            _fail(f"--profile-ranks {' '.join(map(str, tr.profile_ranks))}: each must be a rank "
                  f"of the world (0..{(world_size or 1) - 1})")
    if not tr.straggler_threshold > 0:
        _fail(f"--straggler-threshold must be > 0 (percent above the median), got "
              f"{tr.straggler_threshold}")


POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def _check_architecture(m: ModelConfig, p: ParallelConfig) -> None:
    """The rules of the architecture flags (one block, one-line errors)."""
    if m.position_embedding_type not in POSITION_EMBEDDING_TYPES:
        _fail(f"unknown --position-embedding-type {m.position_embedding_type!r}: use one of "
              f"{', '.join(POSITION_EMBEDDING_TYPES)}")
    if m.normalization not in NORMALIZATIONS:
        _fail(f"unknown --normalization {m.normalization!r}: use one of "
              f"{', '.join(NORMALIZATIONS)}")
    if not m.layernorm_epsilon > 0:
        _fail(f"--norm-epsilon must be > 0, got {m.layernorm_epsilon}")
    if m.position_embedding_type == "rope":
        if not 0 < m.rotary_percent <= 1:
            _fail(f"--rotary-percent must be in (0, 1], got {m.rotary_percent}")
        if m.rotary_dim < 2 or m.rotary_dim % 2:
            _fail(f"--rotary-percent {m.rotary_percent} rotates {m.rotary_dim} of the "
                  f"{m.kv_channels} channels per head: RoPE needs an even number >= 2")
        if not m.rotary_base > 0:
            _fail(f"--rotary-base must be > 0, got {m.rotary_base}")
    if m.group_query_attention:
        g = m.num_query_groups
        if g < 1 or m.num_attention_heads % g:
            _fail(f"--num-query-groups {g} must divide --num-attention-heads "
                  f"{m.num_attention_heads} (each group shares one key/value head)")
        if g % p.tensor:
            _fail(f"--num-query-groups {g} is not divisible by --tensor-model-parallel-size "
                  f"{p.tensor}: every tensor rank holds whole query groups; use a multiple of "
                  f"{p.tensor} groups or a smaller tensor size")
    if m.openai_gelu and m.swiglu:
        _fail("--openai-gelu and --swiglu exclude each other: SwiGLU's activation is SiLU")
    if m.ffn_size < 1:
        _fail(f"--swiglu's default ffn size int(8h/3 / 64) * 64 is 0 for --hidden-size "
              f"{m.hidden_size}: give --ffn-hidden-size")
    if m.ffn_size % p.tensor:
        _fail(f"the ffn size {m.ffn_size} is not divisible by --tensor-model-parallel-size "
              f"{p.tensor}: change --ffn-hidden-size")
