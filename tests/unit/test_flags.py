"""Every Megatron flag the training scripts accept lands in the typed config (table-driven), and
the lr schedules match their closed forms."""
import math

import pytest

from megatron_2bw.config import OptimizerConfig
from megatron_2bw.config.build import build_config
from megatron_2bw.config.flags import config_from_args
from megatron_2bw.optim.lr import LRSchedule
from megatron_2bw.pretrain import build_parser

# (flags, dotted config field, expected value)
TABLE = [
    (["--tensor-model-parallel-size", "2"], "parallel.tensor", 2),
    (["--pipeline-model-parallel-size", "4"], "parallel.pipeline", 4),
    (["--data-parallel-size", "3"], "parallel.data", 3),
    (["--pipeline-schedule", "gpipe"], "schedule", "gpipe"),
    (["--rank-order", "tp-pp-dp"], "parallel.rank_order", "tp-pp-dp"),
    (["--distributed-backend", "gloo"], "parallel.backend", "gloo"),
    (["--distributed-timeout-minutes", "3"], "parallel.timeout_minutes", 3.0),
    (["--micro-batch-size", "4"], "batch.micro_batch_size", 4),
    (["--global-batch-size", "64"], "batch.global_batch_size", 64),
    (["--model", "gpt-355m"], "model.hidden_size", 1024),
    (["--num-layers", "7"], "model.num_layers", 7),
    (["--hidden-size", "96"], "model.hidden_size", 96),
    (["--num-attention-heads", "6"], "model.num_attention_heads", 6),
    (["--ffn-hidden-size", "100"], "model.ffn_hidden_size", 100),
    (["--seq-length", "48"], "model.seq_length", 48),
    (["--max-position-embeddings", "96"], "model.max_position_embeddings", 96),
    (["--vocab-size", "1000"], "model.vocab_size", 1000),
    (["--hidden-dropout", "0.1"], "model.hidden_dropout", 0.1),
    (["--attention-dropout", "0.2"], "model.attention_dropout", 0.2),
    (["--init-method-std", "0.01"], "model.init_method_std", 0.01),
    (["--untie-embeddings-and-output-weights"], "model.untie_embeddings_and_output_weights", True),
    (["--recompute-activations"], "model.recompute_granularity", "selective"),
    (["--recompute-activations"], "model.recompute_method", None),
    (["--recompute-granularity", "selective"], "model.recompute_granularity", "selective"),
    (["--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "2"], "model.recompute_num_layers", 2),
    (["--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "2"], "model.recompute_granularity", "full"),
    (["--use-distributed-optimizer"], "parallel.distributed_optimizer", True),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], "parallel.sequence_parallel",
     True),
    (["--train-iters", "17"], "train.train_iters", 17),
    (["--seed", "7"], "train.seed", 7),
    (["--log-interval", "5"], "train.log_interval", 5),
    (["--eval-interval", "50"], "train.eval_interval", 50),
    (["--eval-iters", "3"], "train.eval_iters", 3),
    (["--save", "ck"], "train.save", "ck"),
    (["--load", "ck"], "train.load", "ck"),
    (["--save-interval", "9", "--save", "ck"], "train.save_interval", 9),
    (["--no-save-optim"], "train.save_optim", False),
    (["--no-load-optim"], "train.load_optim", False),
    (["--finetune"], "train.finetune", True),
    (["--exit-interval", "11"], "train.exit_interval", 11),
    (["--exit-duration-in-mins", "30"], "train.exit_duration_in_mins", 30.0),
    (["--wandb-project", "p"], "train.wandb_project", "p"),
    (["--wandb-exp-name", "e"], "train.wandb_exp_name", "e"),
    (["--wandb-save-dir", "w"], "train.wandb_save_dir", "w"),
    (["--wall-clock-breakdown"], "train.wall_clock_breakdown", True),
    (["--optimizer", "sgd"], "optimizer.name", "sgd"),
    (["--lr", "0.5"], "optimizer.lr", 0.5),
    (["--min-lr", "0.05"], "optimizer.min_lr", 0.05),
    (["--lr-decay-style", "cosine"], "optimizer.lr_decay_style", "cosine"),
    (["--lr-warmup-iters", "10"], "optimizer.lr_warmup_iters", 10),
    (["--lr-decay-iters", "99"], "optimizer.lr_decay_iters", 99),
    (["--weight-decay", "0.2"], "optimizer.weight_decay", 0.2),
    (["--adam-beta1", "0.8"], "optimizer.adam_beta1", 0.8),
    (["--adam-beta2", "0.95"], "optimizer.adam_beta2", 0.95),
    (["--adam-eps", "1e-6"], "optimizer.adam_eps", 1e-6),
    (["--sgd-momentum", "0.5"], "optimizer.sgd_momentum", 0.5),
    (["--clip-grad", "0.7"], "optimizer.clip_grad", 0.7),
    (["--fp16"], "precision.dtype", "fp16"),
    (["--bf16"], "precision.dtype", "bf16"),
    (["--fp16", "--loss-scale", "128"], "precision.loss_scale", 128.0),
    (["--fp16", "--initial-loss-scale", "1024"], "precision.initial_loss_scale", 1024.0),
    (["--fp16", "--min-loss-scale", "2"], "precision.min_loss_scale", 2.0),
    (["--fp16", "--loss-scale-window", "50"], "precision.loss_scale_window", 50),
    (["--fp16", "--hysteresis", "3"], "precision.hysteresis", 3),
    (["--fp16", "--max-skipped-steps", "5"], "precision.max_skipped_steps", 5),
]


@pytest.mark.parametrize("flags,field,expected", TABLE, ids=[" ".join(t[0]) for t in TABLE])
def test_flag_reaches_the_config(flags, field, expected):
    args = build_parser("gpt").parse_args(["--mock-data"] + flags)
    assert config_from_args(args, "gpt").get(field) == expected


@pytest.mark.parametrize("flags,world,iters", [
    (["--train-samples", "100", "--global-batch-size", "8"], 8, 13),
    (["--train-samples", "100", "--micro-batch-size", "2"], 4, 13),  # default B = b x w = 8
])
def test_train_samples_become_iterations_of_the_global_batch(flags, world, iters):
    args = build_parser("gpt").parse_args(["--mock-data"] + flags)
    assert build_config(args, "gpt", world).config.train.train_iters == iters


def test_bert_only_flag():
    args = build_parser("bert").parse_args(["--mock-data", "--bert-no-binary-head"])
    assert args.bert_no_binary_head


def _lr(style, **kw):
    return LRSchedule(OptimizerConfig(lr=1.0, min_lr=0.1, lr_decay_style=style, **kw),
                      train_iters=100)


def test_lr_schedules_closed_forms():
    const = _lr("constant", lr_warmup_iters=10)
    assert [const(i) for i in (0, 4, 9, 10, 99)] == [0.1, 0.5, 1.0, 1.0, 1.0]
    lin = _lr("linear", lr_warmup_iters=10)
    for i in range(100):
        step = i + 1
        want = step / 10 if step <= 10 else 0.1 + (1 - (step - 10) / 90) * 0.9
        assert lin(i) == pytest.approx(want)
    cos = _lr("cosine", lr_decay_iters=50)
    for i in range(100):
        frac = min((i + 1) / 50, 1.0)
        assert cos(i) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
