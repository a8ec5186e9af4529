"""Model flavours, parameter counts and BERT specifics."""
import pytest
import torch

from megatron_2bw.config import ConfigError, ModelConfig
from megatron_2bw.config.flags import config_from_args
from megatron_2bw.config.flavours import FLAVOURS
from megatron_2bw.data.bert_mock import BertBatches, MockBertDataset
from megatron_2bw.models.bert import bert_layer_specs, make_bert_loss
from megatron_2bw.models.gpt import gpt_layer_specs
from megatron_2bw.models.stage import StageModule
from megatron_2bw.pretrain import build_parser


def _count(family, argv):
    cfg = config_from_args(build_parser(family).parse_args(argv), family)
    specs_fn = gpt_layer_specs if family == "gpt" else bert_layer_specs
    with torch.device("meta"):
        model = StageModule(specs_fn(cfg.model), 0, cfg.model.num_layers + 2)
    return cfg, sum(p.numel() for p in model.parameters())


def test_gpt_1_3b_parameter_count_matches_the_standard_formula():
    cfg, n = _count("gpt", ["--model", "gpt-1.3b", "--vocab-size", "50304",
                            "--mock-data"])
    L, h, V, s = 24, 2048, 50304, 2048
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads) == \
        (24, 2048, 16)
    formula = 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))
    assert abs(n - formula) / formula < 0.01


def test_explicit_flags_override_the_flavour():
    cfg = config_from_args(build_parser("gpt").parse_args(
        ["--model", "gpt-125m", "--num-layers", "3", "--mock-data"]), "gpt")
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_length) == (3, 768, 2048)


def test_every_flavour_resolves_and_families_are_checked():
    for name, (family, *_rest) in FLAVOURS.items():
        fam = "gpt" if family == "any" else family
        cfg = config_from_args(build_parser(fam).parse_args(["--model", name, "--mock-data"]),
                               fam)
        assert cfg.model.num_layers >= 2
    with pytest.raises(ConfigError, match="pretrain_bert.py"):
        config_from_args(build_parser("gpt").parse_args(["--model", "bert-base"]), "gpt")
    with pytest.raises(ConfigError, match="unknown --model"):
        config_from_args(build_parser("gpt").parse_args(["--model", "gpt-9t"]), "gpt")


@pytest.mark.parametrize("binary", [True, False])
def test_bert_forward_loss_and_padding(binary):
    cfg = ModelConfig(family="bert", num_layers=2, hidden_size=32, num_attention_heads=4,
                      vocab_size=64, seq_length=16, bert_binary_head=binary)
    model = StageModule(bert_layer_specs(cfg), 0, 4)
    inputs, labels = next(BertBatches(MockBertDataset(64, 16, short_seq_prob=1.0), 4, 1))
    lm, bin_logits = model(*inputs)
    assert lm.shape == (4, 16, 64) and (bin_logits is not None) == binary
    loss = make_bert_loss()((lm, bin_logits), labels)
    assert torch.isfinite(loss)
    # padding is masked out: changing padded tokens does not change real positions' outputs
    tokens, types, pad = inputs
    assert (~pad).any(), "short samples must be padded for this check"
    tokens2 = tokens.masked_fill(~pad, 7)
    lm2, _ = model(tokens2, types, pad)
    assert torch.allclose(lm[pad], lm2[pad], atol=1e-6)


def test_mock_bert_masking_statistics():
    ds = MockBertDataset(512, 64, seed=3, short_seq_prob=0.0)
    masked = replaced = kept = total = 0
    from megatron_2bw.data.bert_mock import MASK, NUM_SPECIAL
    for i in range(400):
        smp = ds[i]
        sel = smp["loss_mask"].bool()
        total += int((smp["tokens"] >= NUM_SPECIAL).sum() + (smp["tokens"] == MASK).sum())
        masked += int(sel.sum())
        tok, lab = smp["tokens"][sel], smp["labels"][sel]
        replaced += int((tok == MASK).sum())
        kept += int((tok == lab).sum())
    assert abs(masked / total - 0.15) < 0.02
    assert abs(replaced / masked - 0.8) < 0.05 and abs(kept / masked - 0.1) < 0.05
