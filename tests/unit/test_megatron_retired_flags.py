"""Megatron-LM's retired flags that Megatron-DeepSpeed retired too (both arguments.py refuse
--batch-size, --warmup and --model-parallel-size with the replacement): refused in one line that
gives Megatron's replacement, not a closest-name guess (--warmup took a fraction,
--lr-warmup-iters takes iterations), with the rest of the command's refusals. The ones
Megatron-DeepSpeed still uses (--checkpoint-activations, --data-impl, --DDP-impl, ...) are taken
with its meaning (tests/unit/test_mds_flags.py); --distribute-saved-activations, a current
memory-placement flag, is accepted and stated."""
import pytest

from megatron_2bw.config import ConfigError
from megatron_2bw.config.build import build_config
from megatron_2bw.config.compat import RETIRED
from megatron_2bw.pretrain import build_parser

VALUES = {"--batch-size": ["8"], "--warmup": [".01"], "--model-parallel-size": ["2"]}


@pytest.mark.parametrize("flag", sorted(RETIRED))
@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_a_retired_megatron_flag_is_refused_with_its_replacement(flag, family, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser(family).parse_args(["--mock-data", flag] + VALUES.get(flag, []))
    assert e.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"pretrain_{family}.py: error: {flag} is a retired Megatron-LM flag: "
                     f"{RETIRED[flag]}"], lines


def test_the_replacements_are_flags_that_parse():
    """Every flag a replacement names is taken by the parser (no fix that fails in turn)."""
    parser = build_parser("gpt")
    named = {w.strip("(),") for fix in RETIRED.values() for w in fix.split()
             if w.startswith("--")}
    assert named and named <= set(parser._option_string_actions), \
        named - set(parser._option_string_actions)
    args = parser.parse_args(["--mock-data", "--recompute-granularity", "full",
                              "--recompute-method", "uniform", "--lr-warmup-fraction", "0.01",
                              "--micro-batch-size", "2", "--tensor-model-parallel-size", "1",
                              "--recompute-num-layers", "1"])
    assert (args.recompute_granularity, args.recompute_method) == ("full", "uniform")


def test_retired_flags_come_with_the_commands_other_refusals(capsys):
    with pytest.raises(SystemExit):
        build_parser("gpt").parse_args(["--mock-data", "--batch-size", "4",
                                        "--num-layerz", "2", "--warmup", "0.01"])
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3, lines
    assert "--batch-size is a retired Megatron-LM flag: use --micro-batch-size" in lines[0]
    assert lines[1].endswith("unknown flag --num-layerz (did you mean --num-layers?)")
    assert "--warmup is a retired Megatron-LM flag: use --lr-warmup-fraction" in lines[2]


def test_distribute_saved_activations_is_accepted_and_stated():
    args = build_parser("gpt").parse_args(["--mock-data", "--distribute-saved-activations"])
    notes = "\n".join(build_config(args, "gpt", 1).notes)
    assert "megatron-2bw: --distribute-saved-activations: each tensor rank keeps the whole " \
           "input of a recomputed layer" in notes


@pytest.mark.parametrize("argv,order", [([], "tp-dp-pp"), (["--use-tp-pp-dp-mapping"], "tp-pp-dp"),
                                        (["--rank-order", "tp-pp-dp"], "tp-pp-dp"),
                                        (["--rank-order", "tp-pp-dp", "--use-tp-pp-dp-mapping"],
                                         "tp-pp-dp")])
def test_megatrons_tp_pp_dp_mapping_is_the_rank_order_tp_pp_dp(argv, order):
    args = build_parser("gpt").parse_args(["--mock-data"] + argv)
    assert build_config(args, "gpt", 1).config.parallel.rank_order == order


def test_the_mapping_against_another_rank_order_is_one_line():
    args = build_parser("gpt").parse_args(["--mock-data", "--use-tp-pp-dp-mapping",
                                           "--rank-order", "tp-dp-pp"])
    with pytest.raises(ConfigError, match="--use-tp-pp-dp-mapping with --rank-order tp-dp-pp: "
                                          "the mapping is --rank-order tp-pp-dp; give one"):
        build_config(args, "gpt", 1)
