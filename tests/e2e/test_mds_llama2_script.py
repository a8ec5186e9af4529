"""Megatron-DeepSpeed's Llama-2 example trains here (issue 49's acceptance): the flag set of
examples_deepspeed/pretrain_llama2_distributed.sh (deepspeedai/Megatron-DeepSpeed, the version
with --num-key-value-heads and `ds_args=" --zero-stage=$ZERO_STAGE ${ds_args}"`) as the script
builds it, and the DeepSpeed JSON it writes with `cat <<EOT > $DS_CONFIG`. Changed, and only
these: the sizes (TP and PP stay 2, 4 processes on one node instead of 8, a tiny model, micro
and global batch), the paths (a sentencepiece model and an indexed dataset built here), the
iterations (TRAIN_STEPS, --eval-iters) and --distributed-backend nccl -> gloo. The flush runs
add the one flag that picks the schedule (--pipeline-schedule flush); the 2bw runs take the
default of two stages.

It runs under torchrun with the script's DISTRIBUTED_ARGS, and under the real DeepSpeed's
`deepspeed` launcher (`deepspeed --num_gpus 4 ...` and `deepspeed --num_nodes 1 --num_gpus 4`,
DS_ACCELERATOR=cpu), which passes --local_rank=N and sets the ranks' environment. The default
run trains one of the four (the DeepSpeed launcher with 2bw); the others are slow.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIZES = dict(TP=2, PP=2, ZERO_STAGE=0, GPUS_PER_NODE=4, NNODES=1, NODE_RANK=0,
             MASTER_ADDR="localhost", HIDDEN_SIZE=32, FFN_HIDDEN_SIZE=64, NUM_LAYERS=2,
             NUM_HEADS=4, SEQ_LENGTH=16, NUM_KV_HEADS=2, MICRO_BATCH_SIZE=2,
             GLOBAL_BATCH_SIZE=8, TRAIN_STEPS=3, LR="3e-4", MIN_LR="3e-5",
             LR_WARMUP_STEPS=2000, WEIGHT_DECAY=0.1, GRAD_CLIP=1)


def ds_config(v) -> dict:
    """The JSON the script writes (its heredoc, with the sizes above)."""
    return {"train_batch_size": v["GLOBAL_BATCH_SIZE"],
            "train_micro_batch_size_per_gpu": v["MICRO_BATCH_SIZE"], "steps_per_print": 1,
            "zero_optimization": {"stage": v["ZERO_STAGE"]}, "bf16": {"enabled": True}}


def script_args(v, ds_json, dataset, tokenizer, ckpt) -> list[str]:
    """pretrain_gpt.py's arguments as the script passes them (WANDB_ARGS empty: LOG_TO_WANDB=0;
    activation_checkpoint="false"), $DATASET = "1 ${DATASET_1}" word-split into two."""
    ds_args = ["--zero-stage=" + str(v["ZERO_STAGE"]), "--deepspeed_config=" + str(ds_json),
               "--deepspeed"]
    return [
        "--tensor-model-parallel-size", str(v["TP"]),
        "--pipeline-model-parallel-size", str(v["PP"]),
        "--num-layers", str(v["NUM_LAYERS"]), "--hidden-size", str(v["HIDDEN_SIZE"]),
        "--ffn-hidden-size", str(v["FFN_HIDDEN_SIZE"]),
        "--num-attention-heads", str(v["NUM_HEADS"]),
        "--micro-batch-size", str(v["MICRO_BATCH_SIZE"]),
        "--global-batch-size", str(v["GLOBAL_BATCH_SIZE"]),
        "--seq-length", str(v["SEQ_LENGTH"]), "--max-position-embeddings", str(v["SEQ_LENGTH"]),
        "--train-iters", str(v["TRAIN_STEPS"]), "--save", str(ckpt), "--load", str(ckpt),
        "--data-path", "1", str(dataset), "--data-impl", "mmap",
        "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", str(tokenizer),
        "--split", "949,50,1", "--distributed-backend", "gloo", "--lr", v["LR"],
        "--lr-decay-style", "cosine", "--min-lr", v["MIN_LR"],
        "--weight-decay", str(v["WEIGHT_DECAY"]), "--clip-grad", str(v["GRAD_CLIP"]),
        "--lr-warmup-iters", str(v["LR_WARMUP_STEPS"]), "--optimizer", "adam",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--log-interval", "1",
        "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "2", "--bf16",
        "--no-query-key-layer-scaling", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights",
        "--swiglu", "--normalization", "rmsnorm", "--disable-bias-linear",
        "--num-key-value-heads", str(v["NUM_KV_HEADS"]), *ds_args]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A sentencepiece tokenizer.model and a document dataset of Python's help topics."""
    from pydoc_data.topics import topics
    from megatron_2bw.data.tokenizer import train_sentencepiece
    sys.path.insert(0, str(ROOT / "tools"))
    import preprocess_data
    d = tmp_path_factory.mktemp("llama2-data")
    docs = [t for k in sorted(topics)[:60] for t in topics[k].split("\n\n") if t.strip()]
    model = train_sentencepiece(docs, str(d / "tokenizer.model"), 500, "bpe")
    (d / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    assert preprocess_data.main(["--input", str(d / "corpus.jsonl"), "--output-prefix",
                                 str(d / "bookcorpus_train_1m"), "--tokenizer-type",
                                 "GPTSentencePieceTokenizer", "--tokenizer-model", model,
                                 "--append-eod"]) == 0
    return d / "bookcorpus_train_1m_text_document", model


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher() -> str:
    found = Path(sys.executable).parent / "deepspeed"
    launcher = str(found) if found.exists() else shutil.which("deepspeed")
    if launcher is None:
        pytest.skip("DeepSpeed's `deepspeed` launcher is not installed")
    return launcher


def run(tmp_path, data, launch: str, schedule: str) -> str:
    dataset, tokenizer = data
    tmp_path.mkdir(parents=True, exist_ok=True)
    ds_json = tmp_path / "deepspeed.json"
    ds_json.write_text(json.dumps(ds_config(SIZES)))
    ckpt = tmp_path / "ckpt"
    args = script_args(SIZES, ds_json, dataset, tokenizer, ckpt)
    args += ["--pipeline-schedule", "flush"] if schedule == "flush" else []
    port, n = _port(), str(SIZES["GPUS_PER_NODE"])
    if launch == "torchrun":  # the script's DISTRIBUTED_ARGS
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", n,
               "--nnodes", "1", "--node_rank", "0", "--master_addr", "localhost",
               "--master_port", str(port)]
    else:
        cmd = [_launcher()] + (["--num_nodes", "1"] if launch == "deepspeed-nodes" else []) + \
            ["--num_gpus", n, "--master_port", str(port)]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "CROSS_"))}
    env.update(WANDB_MODE="offline", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    proc = subprocess.run(cmd + [str(ROOT / "pretrain_gpt.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert f"megatron-2bw: gpt schedule={schedule} t=2 d=2 w=1 micro-batch=2 global-batch=8 " \
           "m=4 precision=bf16 backend=gloo" in out, out[-3000:]
    for line in ("--data-impl mmap: ", "--no-query-key-layer-scaling: ",
                 "--use-rotary-position-embeddings: RoPE", "--num-key-value-heads 2: grouped",
                 "--zero-stage 0: no sharding", "--clip-grad 1: no effect with --deepspeed"):
        assert f"megatron-2bw: {line}" in out, line
    assert re.search(r"iteration +3/ +3 \|.*\| lm loss: [0-9.E+-]+ \|", out), out[-3000:]
    assert f"successfully saved checkpoint at iteration 3 to {ckpt}" in out, out[-3000:]
    assert "run summary | iterations 3 (0->3) | samples 24 | tokens 384" in out
    if launch != "torchrun":  # DeepSpeed's launcher started the ranks, with --local_rank=N
        assert "--local_rank=3" in proc.stderr + out
    return "\n".join(re.findall(r"iteration .*lm loss: [0-9.E+-]+", out))


def _losses(log: str) -> list[str]:
    return re.findall(r"lm loss: ([0-9.E+-]+)", log)


def test_the_llama2_script_trains_under_the_deepspeed_launcher(tmp_path, data):
    run(tmp_path, data, "deepspeed", "2bw")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["2bw", "flush"])
def test_the_llama2_script_trains_under_torchrun_and_either_deepspeed_form(tmp_path, data,
                                                                           schedule):
    """The same run whoever starts it: torchrun's and the DeepSpeed launcher's losses agree."""
    by_torchrun = run(tmp_path / "torchrun", data, "torchrun", schedule)
    by_deepspeed = run(tmp_path / "deepspeed", data, "deepspeed-nodes", schedule)
    assert _losses(by_torchrun) == _losses(by_deepspeed) and len(_losses(by_torchrun)) == 3
