"""Image transforms on tensors: C x H x W (uint8 or float) or an H x W x C uint8 array.

Resize and CenterCrop follow torchvision's rules for tensors: an int size matches the smaller
edge (the other keeps the aspect ratio, truncated), bilinear with antialias, and a uint8 image is
resized in float then rounded back to uint8; the crop's top-left corner is
round((H - h) / 2), round((W - w) / 2), zero-padded when the image is smaller."""
import numbers

import torch
import torch.nn.functional as F

__all__ = ["Compose", "Resize", "CenterCrop", "ToTensor", "Normalize"]


def _as_chw(img):
    if not torch.is_tensor(img):
        img = torch.as_tensor(img).permute(2, 0, 1)   # H x W x C array
    if img.dim() < 3:
        raise TypeError(f"image must be C x H x W, got shape {tuple(img.shape)}")
    return img


def _pair(size, name):
    if isinstance(size, numbers.Number):
        return int(size), int(size)
    if len(size) == 1:
        return int(size[0]), int(size[0])
    if len(size) != 2:
        raise ValueError(f"{name}: size must be an int or (h, w), got {size!r}")
    return int(size[0]), int(size[1])


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, img):
        for t in self.transforms:
            img = t(img)
        return img


class Resize:
    def __init__(self, size, antialias=True):
        self.size = size
        self.antialias = antialias

    def _target(self, h, w):
        if isinstance(self.size, numbers.Number) or len(self.size) == 1:
            s = int(self.size if isinstance(self.size, numbers.Number) else self.size[0])
            if h <= w:
                return s, int(s * w / h)
            return int(s * h / w), s
        return int(self.size[0]), int(self.size[1])

    def __call__(self, img):
        img = _as_chw(img)
        h, w = self._target(*img.shape[-2:])
        if (h, w) == tuple(img.shape[-2:]):
            return img
        x = img.to(torch.float32) if not img.is_floating_point() else img
        squeeze = x.dim() == 3
        x = x.unsqueeze(0) if squeeze else x
        out = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False,
                            antialias=self.antialias)
        out = out.squeeze(0) if squeeze else out
        if not img.is_floating_point():
            out = out.round_().clamp_(0, 255).to(img.dtype)
        return out


class CenterCrop:
    def __init__(self, size):
        self.size = _pair(size, "CenterCrop")

    def __call__(self, img):
        img = _as_chw(img)
        ch, cw = self.size
        h, w = img.shape[-2:]
        if ch > h or cw > w:
            ph, pw = max(ch - h, 0), max(cw - w, 0)
            img = F.pad(img, [pw // 2, (pw + 1) // 2, ph // 2, (ph + 1) // 2])
            h, w = img.shape[-2:]
        top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
        return img[..., top:top + ch, left:left + cw]


class ToTensor:
    """uint8 -> float32 in [0, 1] (C x H x W); a float tensor is returned as it is."""

    def __call__(self, pic):
        img = _as_chw(pic)
        if img.dtype == torch.uint8:
            return img.to(torch.float32).div_(255)
        return img.to(torch.float32) if not img.is_floating_point() else img


class Normalize:
    def __init__(self, mean, std, inplace=False):
        self.mean, self.std, self.inplace = list(mean), list(std), inplace

    def __call__(self, tensor):
        if not tensor.is_floating_point():
            raise TypeError(f"Normalize needs a float tensor, got {tensor.dtype}")
        mean = torch.as_tensor(self.mean, dtype=tensor.dtype).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=tensor.dtype).view(-1, 1, 1)
        if (std == 0).any():
            raise ValueError(f"Normalize: std has a zero: {self.std}")
        out = tensor if self.inplace else tensor.clone()
        return out.sub_(mean).div_(std)
