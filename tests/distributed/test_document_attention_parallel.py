"""--reset-attention-mask on real gloo processes (issue 34): two pipeline stages (the second gets
the document ids with the hidden state), two tensor ranks with sequence parallelism and grouped
queries equal the single-process reference (testing/verify.py, fp32, rtol 1e-5). The data's
documents are real ones: the mock token chosen as the eod ends documents inside the samples.
lr 1e-3: at 1e-2 Adam magnifies the tensor ranks' reassociation to 7e-6 here and 2.4e-5 on
another CPU (CI); at 1e-3 it is 8e-7, and a wrong mask still shows in the first loss."""
import torch

from megatron_2bw.testing.verify import parse, run
from megatron_2bw.training.build import mock_batches

EOD = 5
FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention "
         "--num-query-groups 2 --seq-length 16 --max-position-embeddings 16 --vocab-size 32 "
         "--micro-batch-size 2 --global-batch-size 8 "
         "--train-iters 3 --lr 1e-3 --schedule 2bw "
         "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
         "--sequence-parallel").split()


def test_reset_attention_mask_pipelined_and_tensor_parallel_matches_the_reference():
    cfg, _ = parse(FLAGS)
    # the judge's parser has no tokenizer: the eod comes as the tokenizer's would (build.py)
    cfg = cfg.replace(model={"reset_attention_mask": True, "reset_position_ids": True,
                             "eod_token": EOD}).validate(4)
    tokens = torch.cat([x for x, _ in (next(mock_batches(cfg, 1, 0)) for _ in range(12))])
    inside = (tokens[:, :-1] == EOD).any(dim=1)
    assert inside.sum() >= 4, "the data must end documents inside its samples"
    rep = run(cfg, timeout_minutes=2)
    assert rep.passed(1e-5), rep
    assert rep.tied_equal and not rep.problems
