"""CIFAR10 without a download: a seeded synthetic set of CIFAR-10's shapes.

`data` is N x 32 x 32 x 3 uint8 and `targets` a list of N ints in [0, 10), as torchvision's
CIFAR10 holds them; an item is (3 x 32 x 32 uint8 tensor after `transform`, target). N is
FAKE_CIFAR10_SIZE (default 256), set by the tests; the train and test splits differ by seed.
`root` is never read or written and `download` does nothing."""
import os

import torch

__all__ = ["CIFAR10"]


class CIFAR10(torch.utils.data.Dataset):
    classes = ["airplane", "automobile", "bird", "cat", "deer",
               "dog", "frog", "horse", "ship", "truck"]

    def __init__(self, root, train=True, transform=None, target_transform=None,
                 download=False):
        self.root, self.train = root, train
        self.transform, self.target_transform = transform, target_transform
        size = int(os.environ.get("FAKE_CIFAR10_SIZE", "256"))
        g = torch.Generator().manual_seed(0 if train else 1)
        self.data = torch.randint(0, 256, (size, 32, 32, 3), dtype=torch.uint8, generator=g)
        self.targets = torch.randint(0, 10, (size,), generator=g).tolist()

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        img, target = self.data[index].permute(2, 0, 1).contiguous(), self.targets[index]
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target
