"""tools/preprocess_data.py: JSONL in, Megatron's indexed dataset out, read back token for token
(helpers in tests/unit/test_data_format.py)."""
import json

import numpy as np

from megatron_2bw.data.indexed_dataset import MMapIndexedDataset
from megatron_2bw.data.tokenizer import GPTSentencePieceTokenizer
from test_data_format import parse_idx, sp_model  # noqa: F401  (sp_model: a fixture)
import preprocess_data  # noqa: E402  (tools/, on sys.path through test_data_format)


def test_jsonl_preprocess_round_trip(tmp_path, sp_model, capsys):
    texts = ["The \"if\" statement is used for conditional execution.",
             "Unicode: naïve café — ok. Second sentence here! And a third?", "",
             "for x in range(3): print(x)"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
            "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model, "--append-eod",
            "--workers", "2", "--log-interval", "2"]
    assert preprocess_data.main(argv) == 0
    err = capsys.readouterr().err
    assert "processed 4 documents" in err and "docs/s" in err and "MB/s" in err
    tok = GPTSentencePieceTokenizer(sp_model)
    expected = [tok.tokenize(t) + [tok.eod] if t else [] for t in texts]
    prefix = str(tmp_path / "out_text_document")
    version, code, lengths, pointers, doc_idx = parse_idx(prefix + ".idx")
    assert code == 8 and lengths.tolist() == [len(e) for e in expected if e]
    assert doc_idx.tolist() == [0, 1, 2, 2, 3]  # the empty document has no sequence
    tokens = np.fromfile(prefix + ".bin", dtype="<u2").tolist()
    assert tokens == [t for e in expected for t in e]
    ds = MMapIndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [e for e in expected if e]


def test_megatron_tokenizer_flags(tmp_path, capsys):
    """Megatron's tokenizer flags reach every worker: GPT2BPETokenizer (--vocab-file vocab.json
    --merge-file merges.txt, eod <|endoftext|>) and BertWordPieceLowerCase (--vocab-file)."""
    from test_data_tokenizer_megatron import BERT_VOCAB, GPT2_MERGES, GPT2_VOCAB
    vocab, merges, bert = tmp_path / "vocab.json", tmp_path / "merges.txt", tmp_path / "b.txt"
    vocab.write_text(json.dumps({t: i for i, t in enumerate(GPT2_VOCAB)}), encoding="utf-8")
    merges.write_text("#version: 0.2\n" + "\n".join(GPT2_MERGES) + "\n", encoding="utf-8")
    bert.write_text("".join(t + "\n" for t in BERT_VOCAB), encoding="utf-8")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n"
                           for t in ["hello world", "he's é", "The fox. Brown fox jumps."]))
    assert preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "g"),
                                 "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                 str(vocab), "--merge-file", str(merges), "--append-eod",
                                 "--workers", "2"]) == 0
    ds = MMapIndexedDataset(str(tmp_path / "g_text_document"))
    assert ds[0].tolist() == [11, 14, 2, 7, 18] and ds[1].tolist() == [8, 15, 16, 4, 17, 18]
    assert preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "b"),
                                 "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
                                 str(bert), "--split-sentences", "--workers", "1"]) == 0
    ds = MMapIndexedDataset(str(tmp_path / "b_text_sentence"))
    assert [ds[i].tolist() for i in range(len(ds))][-2:] == [[5, 8, 16], [7, 8, 9, 10, 16]]
    assert preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "x"),
                                 "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                 str(vocab)]) == 2
    assert "GPT2BPETokenizer needs --merge-file" in capsys.readouterr().err
