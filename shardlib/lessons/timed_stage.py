"""A pipeline stage of known cost, for timelines with a GPU's shape on CPU ranks (lessons 05 and 13).

On a CPU, p ranks share the cores: a busy stage runs slower while its neighbours are busy too, which
distorts a pipeline's timeline. A TimedStage sleeps t_forward seconds in forward and t_backward in
backward, without using a core, as a GPU kernel looks from the host; its timeline measures the
schedule and the messages alone, so the bubble can be held against (p-1)/(m+p-1).
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

__all__ = ["TimedStage"]


class _Sleep(torch.autograd.Function):
    """Identity that takes t_forward seconds forward and t_backward backward, without using a core."""

    @staticmethod
    def forward(ctx, x, t_forward: float, t_backward: float):
        time.sleep(t_forward)
        ctx.t_backward = t_backward
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.t_backward)
        return grad, None, None


class TimedStage(nn.Module):
    """A stage of known cost: a small Linear, then t_forward seconds forward, t_backward backward."""

    def __init__(self, stage_index: int, num_stages: int, width: int = 64, t_forward: float = 0.03,
                 t_backward: float = 0.06):
        super().__init__()
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.linear, self.t_forward, self.t_backward = nn.Linear(width, width), t_forward, t_backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, width)
        return _Sleep.apply(self.linear(x), self.t_forward, self.t_backward)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    def activation_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(x.shape)  # (b, width)
