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
