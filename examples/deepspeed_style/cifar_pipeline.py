#!/usr/bin/env python3
"""A CIFAR-shaped image classifier trained the way DeepSpeedExamples'
training/pipeline_parallelism script trains AlexNet: a layer list (convolutions, a flatten
lambda, the classifier) in a PipelineModule, `deepspeed.runtime.utils.set_random_seed`,
`deepspeed.initialize(args=..., training_data=...)` and `engine.train_batch()` with no iterator.
It uses the `from deepspeed.x import y` forms, so the drop-in comes in through the opt-in alias;
that import line is the only line that differs from the real DeepSpeed version of this script:

    import deepspeed                                    # DeepSpeed's engine
    import megatron_2bw.deepspeed.alias as deepspeed    # the same script on megatron_2bw

Nothing is downloaded: the images are a seeded synthetic set of CIFAR-10's shapes (3 x 32 x 32,
10 classes). Run it with either launcher (the JSON picks the schedule; flush is DeepSpeed's):

    torchrun --standalone --nproc_per_node 2 examples/deepspeed_style/cifar_pipeline.py \\
        --backend gloo --deepspeed_config ds.json -p 2 --steps 20
    deepspeed --num_gpus 2 examples/deepspeed_style/cifar_pipeline.py --backend gloo ...

Rank 0 prints one line per step, `step: N loss: L` (loss as repr, for exact comparison).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import megatron_2bw.deepspeed.alias as deepspeed  # noqa: E402  (DeepSpeed: import deepspeed)
from deepspeed.pipe import PipelineModule  # noqa: E402
from deepspeed.utils import RepeatingLoader  # noqa: E402,F401  (as the original imports it)


class SyntheticCIFAR(torch.utils.data.Dataset):
    """CIFAR-10's shapes with seeded random pixels: (3 x 32 x 32 float image, class index)."""

    def __init__(self, size=256, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.rand(size, 3, 32, 32, generator=g) * 2 - 1
        self.labels = torch.randint(0, 10, (size,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


def small_alexnet(num_classes=10):
    """AlexNet's structure (features, avgpool, classifier) scaled to 32 x 32 inputs."""
    features = nn.Sequential(
        nn.Conv2d(3, 16, kernel_size=3, stride=2, padding=1), nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=2),
        nn.Conv2d(16, 32, kernel_size=3, padding=1), nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=2),
        nn.Conv2d(32, 32, kernel_size=3, padding=1), nn.ReLU(inplace=True))
    avgpool = nn.AdaptiveAvgPool2d((2, 2))
    classifier = nn.Sequential(nn.Linear(32 * 2 * 2, 64), nn.ReLU(inplace=True),
                               nn.Linear(64, num_classes))
    return features, avgpool, classifier


def join_layers(features, avgpool, classifier):
    return [*features, avgpool, lambda x: torch.flatten(x, 1), *classifier]


def get_args(argv=None):
    parser = argparse.ArgumentParser(description="CIFAR-shaped pipeline")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=20, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2,
                        help="pipeline parallelism")
    parser.add_argument("--backend", type=str, default="nccl", help="distributed backend")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def train_pipe(args):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)
    net = PipelineModule(layers=join_layers(*small_alexnet()),
                         loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size,
                         partition_method="parameters", activation_checkpoint_interval=0)
    trainset = SyntheticCIFAR()
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset)
    for step in range(args.steps):
        loss = engine.train_batch()
        if dist.get_rank() == 0:
            print(f"step: {step + 1} loss: {float(loss)!r}", flush=True)


if __name__ == "__main__":
    args = get_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(args.local_rank)
    train_pipe(args)
