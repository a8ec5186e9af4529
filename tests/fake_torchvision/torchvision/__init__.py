"""Test-only torchvision stand-in (see tests/fake_torchvision/README.md): transforms, a synthetic
CIFAR10 and AlexNet / VGG-19 with torchvision's structure. Not torchvision."""
from torchvision import datasets, models, transforms  # noqa: F401

__version__ = "0.0+fake"
