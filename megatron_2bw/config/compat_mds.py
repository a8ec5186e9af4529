"""Megatron-DeepSpeed's flags that config/compat.py's tables take (its megatron/arguments.py and
examples_deepspeed/*.sh, deepspeedai/Megatron-DeepSpeed): the same three kinds as compat.py's own.

- NOTED: selectors, memory placements and logging switches that do not change the arithmetic
  (DeepSpeed's activation checkpointing, the ZeRO knobs of its zero group, the memory-opt group,
  its flash-attention variants), stated in one log line each.
- NEUTRAL: features the engine lacks (--num-experts, a list here, is compat.py's), accepted at Megatron-DeepSpeed's neutral value and refused
  at any other (MoE, DeepSpeed's sequence parallelism, curriculum learning, random-LTD, knowledge
  distillation, the zero-bubble pipeline, ...); INSTEAD says what to do instead.
- NEUTRAL_WHEN: settings of a feature that Megatron-DeepSpeed reads only with the feature on
  (the MoE capacity factors with one expert, the FPDT chunk without FPDT): accepted at any value
  then, and stated.

The flags with a meaning of their own (--num-key-value-heads, --checkpoint-activations,
--zero-stage, --train-tokens, ...) are config/mds_flags.py's. compat.py merges these tables into
its own; nothing here is registered twice.
"""
from __future__ import annotations

ON = dict(action="store_true", default=None)

NOTED = {
    "--data-impl": (dict(choices=("mmap", "infer"), default=None),
                    "the .bin/.idx files are read memory-mapped: Megatron-DeepSpeed's mmap "
                    "(infer finds mmap; Megatron-LM retired the flag, mmap is the one format "
                    "it reads)"),
    "--no-query-key-layer-scaling": (
        ON, "the scores are not scaled by 1/layer number (Megatron-DeepSpeed's default scaling "
            "cancels in its fp32 softmax: the same attention)"),
    "--deepspeed-activation-checkpointing": (
        ON, "recomputation runs the engine's own activation checkpointing (the same values); "
            "what it recomputes: --checkpoint-activations or --recompute-granularity, as in "
            "Megatron-DeepSpeed (alone it recomputes nothing)"),
    "--partition-activations": (ON, "each tensor rank keeps the whole input of a recomputed "
                                    "layer (DeepSpeed splits it over the tensor group): more "
                                    "memory, the same arithmetic"),
    "--distribute-checkpointed-activations": (
        ON, "each tensor rank keeps the whole input of a recomputed layer (Megatron-DeepSpeed "
            "splits it over the tensor group): more memory, the same arithmetic"),
    "--contigious-checkpointing": (ON, "the recomputed layers' inputs are ordinary tensors (no "
                                       "contiguous buffer): the same values"),
    "--checkpoint-in-cpu": (ON, "the recomputed layers' inputs stay on the device (not moved "
                                "to the CPU): more device memory, the same values"),
    "--synchronize-each-layer": (ON, "no device synchronization around recomputed layers (a "
                                     "timing aid; the same values)"),
    "--profile-backward": (ON, "recomputed layers are not profiled separately; --profile traces "
                               "every action"),
    "--zero-reduce-scatter": (ON, "with --zero-stage 1 (the distributed optimizer) gradients are "
                                  "always reduce-scattered"),
    "--zero-contigious-gradients": (ON, "gradients always live in one contiguous buffer per "
                                        "stage"),
    "--zero-reduce-bucket-size": (dict(type=int, default=None),
                                  "Megatron-DeepSpeed reads it nowhere either; the buckets are "
                                  "--ddp-bucket-size or the DeepSpeed config's "
                                  "zero_optimization.reduce_bucket_size"),
    "--zero-allgather-bucket-size": (dict(type=int, default=None),
                                     "Megatron-DeepSpeed reads it nowhere either; the "
                                     "distributed optimizer all-gathers each stage's weights "
                                     "as one buffer"),
    "--use-pin-memory": (ON, "a ZeRO-3 placement switch (stage 3 is not in this engine; "
                             "without it Megatron-DeepSpeed ignores it too)"),
    "--scattered-embeddings": (ON, "Megatron-DeepSpeed reads it nowhere either (no effect)"),
    "--split-transformers": (ON, "it only counts DeepSpeed's activation checkpoints in "
                                 "Megatron-DeepSpeed; recomputation here is by layer"),
    "--memory-centric-tiled-linear": (ON, "linear layers are not tiled (Megatron-DeepSpeed "
                                          "reads it nowhere either)"),
    "--tile-factor": (dict(type=int, default=None), "linear layers are not tiled "
                                                    "(Megatron-DeepSpeed reads it nowhere "
                                                    "either)"),
    "--log-optimizer-states-to-tensorboard": (
        ON, "the optimizer-state norms are not written to TensorBoard (the loss, lr, grad "
            "norm and loss scale are); training is the same"),
    "--cpu-optimizer": (ON, "the optimizer steps where the weights are, with the same Adam "
                            "(--optimizer-impl picks the kernel)"),
    "--cpu_torch_adam": (ON, "Adam is the engine's (torch.optim's arithmetic; --optimizer-impl "
                             "picks the kernel)"),
    "--ds_fused_adam": (ON, "Adam is the engine's (torch.optim's arithmetic; --optimizer-impl "
                            "picks the kernel)"),
    "--disable-mem-efficient-ln": (ON, "a kernel switch of the norms: the same values"),
    "--embedding-weights-in-fp32": (ON, "the lookup copies the embedding's values whatever "
                                        "their type (the same embeddings)"),
    "--onnx-safe": (dict(default=None), "no ONNX export here (no effect on training)"),
    "--no-load-lr-state": (ON, "the lr schedule is a function of the iteration and the flags: "
                               "nothing to load"),
    "--repeated-dataloader": (ON, "the loader reads the sample index to the end of the run "
                                  "without restarting (the same samples)"),
    "--mmap-warmup": (ON, "the .bin files are memory-mapped and read on demand (the same "
                          "tokens)"),
    "--return-data-index": (ON, "batches carry no sample index (a data-analysis aid; the same "
                                "training)"),
    "--no-contiguous-buffers-in-local-ddp": (ON, "gradients always live in one contiguous "
                                                 "buffer per stage (the same reduction)"),
    "--overlap-p2p-communication": (ON, "point-to-point transfers are batched and non-blocking "
                                        "as the schedule posts them"),
    "--inference-batch-times-seqlen-threshold": (dict(type=int, default=None),
                                                 "an inference setting: no effect on training"),
    "--max-tokens-to-oom": (dict(type=int, default=None), "an inference setting: no effect on "
                                                          "training"),
    "--use-flash-attn-v1": (ON, "attention runs torch's scaled_dot_product_attention (flash on "
                                "CUDA where it applies)"),
}
for _flag in ("--use-flash-attn-v2", "--use-flash-attn-triton", "--use-flash-attn-builder"):
    NOTED[_flag] = NOTED["--use-flash-attn-v1"]

MOE = "mixture of experts"
SEQ = "DeepSpeed's sequence parallelism (Ulysses, FPDT)"
KD = "knowledge distillation"
# flag -> (argparse keywords, neutral value(s), the feature it selects)
NEUTRAL = {
    "--num-experts-switch": (dict(type=int, default=None), None, MOE),
    "--mlp-type": (dict(choices=("standard", "residual"), default="standard"), "standard", MOE),
    "--topk": (dict(type=int, default=1), 1, MOE),
    "--expert-interval": (dict(type=int, default=2), 2, MOE),
    "--moe-expert-parallel-size": (dict(type=int, default=1), 1, "expert parallelism (MoE)"),
    "--enable-expert-tensor-parallelism": (dict(action="store_true", default=False), False,
                                           "expert tensor parallelism (MoE)"),
    "--moe-train-capacity-factor": (dict(type=float, default=1.0), 1.0, MOE),
    "--moe-eval-capacity-factor": (dict(type=float, default=1.0), 1.0, MOE),
    "--moe-min-capacity": (dict(type=int, default=4), 4, MOE),
    "--moe-loss-coeff": (dict(type=float, default=0.1), 0.1, MOE),
    "--create-moe-param-group": (dict(action="store_true", default=False), False, MOE),
    "--disable-moe-token-dropping": (dict(action="store_true", default=False), False, MOE),
    "--disable-moe-top2-2nd-expert-sampling": (dict(action="store_true", default=False), False,
                                               MOE),
    "--use-tutel": (dict(action="store_true", default=False), False, MOE),
    "--ds-sequence-parallel-size": (dict(type=int, default=1), 1, SEQ),
    "--force-ds-sequence-parallel": (dict(action="store_true", default=False), False, SEQ),
    "--ds-sequence-parallel-fpdt": (dict(action="store_true", default=False), False, SEQ),
    "--ds-sequence-parallel-fpdt-chunk-size": (dict(type=int, default=65536), 65536, SEQ),
    "--ds-sequence-parallel-fpdt-offloading": (dict(action="store_true", default=False), False,
                                               SEQ),
    "--data-efficiency-curriculum-learning": (dict(action="store_true", default=False), False,
                                              "curriculum learning"),
    "--random-ltd": (dict(action="store_true", default=False), False,
                     "random layer token drop (random-LTD)"),
    "--kd": (dict(action="store_true", default=False), False, KD),
    "--mos": (dict(action="store_true", default=False), False, KD),
    "--load-teacher": (dict(default=None), None, KD),
    "--num-layers-teacher": (dict(type=int, default=None), None, KD),
    "--hidden-size-teacher": (dict(type=int, default=None), None, KD),
    "--num-attention-heads-teacher": (dict(type=int, default=None), None, KD),
    "--num-experts-teacher": (dict(type=int, nargs="+", default=None), (None, [1]), KD),
    "--kd-alpha-ce": (dict(type=float, default=1.0), 1.0, KD),
    "--kd-beta-ce": (dict(type=float, default=1.0), 1.0, KD),
    "--kd-temp": (dict(type=float, default=1.0), 1.0, KD),
    "--reset-iteration": (dict(action="store_true", default=False), False, KD),
    "--enable-zbh1-pipeline": (dict(action="store_true", default=False), False,
                               "the zero-bubble (ZB-H1) pipeline schedule"),
    "--enable-zbh1-exact-semantics": (dict(action="store_true", default=False), False,
                                      "the zero-bubble (ZB-H1) pipeline schedule"),
    "--ds-inference": (dict(action="store_true", default=False), False, "DeepSpeed inference"),
    "--inference": (dict(action="store_true", default=False), False, "DeepSpeed inference"),
    "--fp8-e4m3": (dict(action="store_true", default=False), False, "fp8 training"),
    "--fp8-hybrid": (dict(action="store_true", default=False), False, "fp8 training"),
    "--load-tag": (dict(default=None), None, "loading a checkpoint by its tag"),
    "--universal-checkpoint": (dict(action="store_true", default=False), False,
                               "loading DeepSpeed's universal checkpoints"),
    "--remote-device": (dict(choices=("none", "cpu", "nvme"), default="none"), "none",
                        "ZeRO-3 parameter placement"),
    "--DDP-impl": (dict(choices=("local", "torch", "FSDP"), default=None),
                   (None, "local", "torch"), "FSDP"),
    "--train-data-exact-num-epochs": (dict(type=int, default=None), None,
                                      "training on an exact number of data epochs"),
    "--kill-switch-file": (dict(default=None), None, "a kill-switch file"),
    "--lazy-mpu-init": (dict(default=None), None, "an external data-parallel manager"),
    "--use-dataset-only": (dict(default=False), False,
                           "the dataset alone for an external trainer"),
    "--aml-data-download-path": (dict(default=None), None, "Azure ML data mounts"),
    "--sample-rate": (dict(type=float, default=1.0), 1.0, "sub-sampling the training data"),
    "--pipeline-model-parallel-split-rank": (dict(type=int, default=None), None,
                                             "an encoder-decoder pipeline split"),
}
for _name in ("idx", "desc", "doc-idx", "sample-idx", "shuffle-idx"):
    NEUTRAL[f"--train-{_name}-path"] = (dict(default=None), None, "forced dataset index files")


def _no_experts(args) -> bool:
    return getattr(args, "num_experts", None) in (None, [1])


# flag -> (is it neutral here, the line logged): a feature's settings without the feature
NEUTRAL_WHEN = {flag: (_no_experts, "no experts (--num-experts 1): no effect, as in "
                                    "Megatron-DeepSpeed")
                for flag, (_kw, _neutral, feature) in NEUTRAL.items()
                if feature == MOE and flag != "--num-experts-switch"}
NEUTRAL_WHEN["--moe-expert-parallel-size"] = NEUTRAL_WHEN["--topk"]
NEUTRAL_WHEN["--ds-sequence-parallel-fpdt-chunk-size"] = (
    lambda args: not getattr(args, "ds_sequence_parallel_fpdt", False),
    "without --ds-sequence-parallel-fpdt: no effect, as in Megatron-DeepSpeed")

INSTEAD = {
    SEQ: "use --ds-sequence-parallel-size 1 (longer sequences per rank: "
         "--tensor-model-parallel-size > 1 with --sequence-parallel, or pipeline stages)",
    "curriculum learning": "drop it (and the DeepSpeed config's curriculum sections): every "
                           "batch trains at --seq-length",
    "random layer token drop (random-LTD)": "drop it (every layer sees every token)",
    KD: "drop the distillation flags (train the model itself)",
    "the zero-bubble (ZB-H1) pipeline schedule": "use --pipeline-schedule 2bw, flush or gpipe",
    "DeepSpeed inference": "drop it (sample from a checkpoint with tools/generate.py)",
    "loading DeepSpeed's universal checkpoints": "drop it (a torch_dist checkpoint of this "
                                                 "engine loads into any layout)",
    "loading a checkpoint by its tag": "drop it (--load loads the iteration its `latest` file "
                                       "names)",
    "ZeRO-3 parameter placement": "drop it (ZeRO stage 3 is not in this engine)",
    "FSDP": "use --DDP-impl local (the engine's own reduction; --use-distributed-optimizer "
            "shards the optimizer)",
    "training on an exact number of data epochs": "drop it (--train-samples or --train-iters "
                                                  "set the run's length)",
    "a kill-switch file": "drop it (SIGTERM or SIGUSR1 saves a checkpoint with --save and "
                          "exits)",
    "forced dataset index files": "drop them (the index is built from --data-path and --seed "
                                  "and cached in --data-cache-path)",
    "sub-sampling the training data": "drop it (--train-samples sets how many are read)",
}
