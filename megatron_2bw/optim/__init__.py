from megatron_2bw.optim.lr import LRSchedule
from megatron_2bw.optim.loss_scale import make_loss_scaler
from megatron_2bw.optim.optimizer import make_optimizer

__all__ = ["LRSchedule", "make_loss_scaler", "make_optimizer"]
