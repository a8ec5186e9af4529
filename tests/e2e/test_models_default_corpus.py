"""pretrain_bert.py on the embedded default corpus, two processes: the masked-LM loss goes down."""


def test_pretrain_bert_on_the_default_corpus_lowers_the_mlm_loss():
    import re
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(root / "pretrain_bert.py"), "--pipeline-model-parallel-size", "2",
           "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
           "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "16",
           "--train-iters", "60", "--lr", "3e-3", "--init-method-std", "0.1",
           "--log-interval", "10"]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"M parameters \(2 layers, hidden 64", proc.stdout)
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", proc.stdout)]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, losses
