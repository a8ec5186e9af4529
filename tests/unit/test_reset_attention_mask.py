"""--reset-attention-mask (issue 34): Megatron's meaning (get_ltor_masks_and_position_ids: for an
eod at i, the rows after i lose the columns up to i, so an eod belongs to the document it ends),
a packed sample equal to its documents run one by one (1 layer, with --reset-position-ids), the
default path unchanged, and its one-line errors."""
import pytest
import torch

from megatron_2bw.config import ConfigError
from megatron_2bw.config.build import build_config
from megatron_2bw.models.documents import DocumentMasks, document_ids, document_mask
from megatron_2bw.models.families import model_parts
from megatron_2bw.models.stage import StageModule
from megatron_2bw.pretrain import build_parser

EOD = 5
EXACT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
SMALL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "64"]


def built(argv, eod=EOD, family="gpt"):
    args = build_parser(family).parse_args(["--mock-data"] + argv)
    return build_config(args, family, 1, eod=eod).config


def megatron_rule(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """The mask as Megatron's loop writes it: lower triangular, then for each eod at i the rows
    i+1.. lose the columns ..i (True = attend)."""
    b, s = tokens.shape
    keep = torch.ones(b, 1, s, s).tril()
    for row in range(b):
        for i in (tokens[row] == eod).nonzero().flatten().tolist():
            keep[row, 0, i + 1:, :i + 1] = 0
    return keep > 0.5


def test_the_mask_follows_megatrons_eod_rule():
    tokens = torch.tensor([[5, 1, 2, 5, 3, 4, 5],     # eod first, in the middle and last
                           [1, 2, 3, 4, 6, 7, 8],     # one document
                           [5, 5, 1, 5, 5, 2, 3]])    # consecutive eods: one-token documents
    assert document_ids(tokens, EOD).tolist() == [[0, 1, 1, 1, 2, 2, 2], [0] * 7,
                                                  [0, 1, 2, 2, 3, 4, 4]]
    assert torch.equal(document_mask(document_ids(tokens, EOD)), megatron_rule(tokens, EOD))
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(0, 8, (4, 24), generator=g)  # eod about one token in 8
    assert torch.equal(document_mask(document_ids(rand, EOD)), megatron_rule(rand, EOD))
    # the eod itself attends to its own document (row 3 sees columns 1..3), the next token not
    mask = document_mask(document_ids(tokens, EOD))[0, 0]
    assert mask[3].tolist() == [False, True, True, True, False, False, False]
    assert mask[4].tolist() == [False, False, False, False, True, False, False]


def test_a_stage_builds_one_mask_per_microbatch():
    masks = DocumentMasks()
    buffer = document_ids(torch.tensor([[1, 5, 2, 3]]), EOD)  # a received (pooled) buffer
    first, passed = masks(buffer)
    assert torch.equal(first, document_mask(buffer))
    again, passed_on = masks(passed)
    assert again is first and passed_on is passed  # the stage's next layers: the same mask
    buffer.copy_(document_ids(torch.tensor([[1, 2, 5, 3]]), EOD))  # the next microbatch
    mask, _ = masks(buffer)  # lands in the same buffer: built anew, not the stale mask
    assert mask is not first and torch.equal(mask, document_mask(buffer))


def model(argv):
    cfg = built(SMALL + EXACT + argv)
    specs, _, _ = model_parts(cfg)
    return StageModule(specs, 0, len(specs), seed=cfg.train.seed), cfg


@pytest.mark.parametrize("extra", [[], ["--recompute-activations"],
                                   ["--recompute-granularity", "full", "--recompute-method",
                                    "uniform", "--recompute-num-layers", "1"]],
                         ids=["plain", "selective", "full"])
def test_a_packed_sample_equals_its_documents_run_alone(extra):
    packed_model, cfg = model(["--reset-position-ids", "--reset-attention-mask"] + extra)
    assert cfg.model.reset_attention_mask and cfg.model.eod_token == EOD
    docs = [torch.tensor([9, 10, 11, EOD]), torch.tensor([12, 13, 14, 15, 16, EOD]),
            torch.tensor([17, 18, 19, 20, 21, 22])]  # the last one runs to the sample's end
    packed = torch.cat(docs)[None]
    want = torch.cat([packed_model(d[None]) for d in docs], dim=1)  # each document alone
    got = packed_model(packed)
    assert got.shape == (1, 16, 64)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    got.square().sum().backward()  # the backward runs (recomputed or not) through the mask
    assert all(p.grad is not None for p in packed_model.parameters())
    # without the mask the later documents see the earlier ones: different logits
    plain, _ = model(["--reset-position-ids"] + extra)
    plain.load_state_dict(packed_model.state_dict())
    leak = plain(packed)
    assert torch.allclose(leak[:, :4], want[:, :4], atol=1e-5)
    assert not torch.allclose(leak[:, 4:], want[:, 4:], atol=1e-3)


def test_without_the_flag_the_layers_see_the_hidden_state_alone():
    from megatron_2bw.models.transformer import TransformerLayer
    plain, _ = model([])
    assert type(plain.layers["1"]) is TransformerLayer  # the default path is untouched
    out = plain.layers["0"](torch.tensor([[1, 5, 2]]))
    assert isinstance(out, torch.Tensor)
    masked, _ = model(["--reset-attention-mask"])
    x, ids = masked.layers["0"](torch.tensor([[1, 5, 2]]))
    assert ids.tolist() == [[0, 0, 1]]


def test_reset_attention_mask_needs_an_eod_and_a_gpt():
    with pytest.raises(ConfigError, match=r"^--reset-attention-mask needs a GPT and a tokenizer "
                                          r"with an end-of-document id"):
        built(["--reset-attention-mask"], eod=None)
    with pytest.raises(ConfigError, match="--reset-attention-mask is a GPT flag: drop it for BERT"):
        built(["--reset-attention-mask"], family="bert")


def test_pretrain_takes_the_eod_from_the_tokenizer(tmp_path):
    """A GPT-2 BPE of the 256 byte symbols and <|endoftext|> (id 256), no merges."""
    import json

    from megatron_2bw.pretrain import parse
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's printable bytes
    others = iter(range(256, 512))
    vocab = {(chr(b) if b in keep else chr(next(others))): b for b in range(256)}
    vocab["<|endoftext|>"] = 256
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    got = parse("gpt", ["--mock-data", "--vocab-file", str(tmp_path / "vocab.json"),
                        "--merge-file", str(tmp_path / "merges.txt"), "--reset-attention-mask",
                        "--train-iters", "1"]).cfg.model
    assert got.reset_attention_mask and got.eod_token == 256


def test_the_kernels_line_asks_the_dispatcher_with_the_document_mask(monkeypatch):
    from megatron_2bw.training import kernels
    asked = []
    monkeypatch.setattr(torch, "_fused_sdp_choice",
                        lambda q, k, v, mask, p, causal, **kw: asked.append((mask, causal)) or 0)
    kernels.attention_backend(built(SMALL), 1, "cpu")
    kernels.attention_backend(built(SMALL + ["--reset-attention-mask"]), 1, "cpu")
    (plain_mask, plain_causal), (mask, causal) = asked
    assert plain_mask is None and plain_causal
    assert mask.shape == (1, 1, 16, 16) and mask.dtype == torch.bool and not causal
