from .lr import LRSchedule
from .loss_scale import make_loss_scaler
from .optimizer import make_optimizer

__all__ = ["LRSchedule", "make_loss_scaler", "make_optimizer"]
