"""Mixed precision: 16-bit compute, fp32 master weights, and dynamic loss scaling for fp16.

Micikevicius et al., "Mixed Precision Training", arXiv 1710.03740. The model's parameters are cast
to a 16-bit dtype and forward and backward run in it (half the bytes of every weight, activation
and gradient, and the tensor cores' speed on GPUs). The optimizer steps fp32 **master** copies of
the parameters and writes them back, rounded, after every step. Two problems, two remedies:

- An update smaller than half the spacing of 16-bit numbers near a weight is rounded away: bf16
  keeps 8 significant bits, so a weight of 1.0 ignores any update below 2^-8 = 0.0039. The master
  copy accumulates such updates in fp32 (24 bits) until they show. `master_weights=False` steps
  the 16-bit parameters directly (what `model.to(torch.bfloat16)` + an optimizer does) to show the loss.
- fp16 has 5 exponent bits: gradients below 2^-24 (6e-8) become zero, below 2^-14 lose bits.
  Dynamic loss scaling multiplies the loss by S before backward, so every gradient is S times
  larger, and divides the fp32 master gradients by S. When a gradient overflows (inf or nan) the
  step is skipped and S halved; after `growth_interval` clean steps S doubles. The constants are
  torch.amp.GradScaler's (2^16, x2, x0.5, 2000 steps), and the tests hold the two against each
  other. bf16 has fp32's 8 exponent bits: no scaling needed (`loss_scale=None` by default there).

Per rank, in bytes per parameter (shardlib.memory.TRAINING_RECIPES), with Adam:

    16-bit params 2 + 16-bit grads 2 + fp32 master 4 + fp32 m, v 8   = 16 Psi  ("mixed_adam")
    fp32 training: params 4 + grads 4 + m, v 8                       = 16 Psi  ("fp32_adam")
    no master (16-bit params stepped directly, m and v 16-bit too)    =  8 Psi  ("pure_bf16_adam")

The master copy costs 4 Psi: mixed precision saves activation bytes and time, not model-state bytes.
The fp32 gradients made for the master step (4 Psi) exist only during step().
With `group=`, the fp32 gradients are averaged over the group's ranks before the step (data
parallelism, 2(N-1)/N * 4 Psi bytes sent per rank and step, in fp32 so that the sum loses nothing),
which also makes every rank see the same overflow and skip the same steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlib.comm import ops

__all__ = ["DynamicLossScaler", "MixedPrecisionOptimizer", "underflow_fraction", "lost_update_fraction"]


class DynamicLossScaler:
    """The loss scale S: halve it on overflow, double it after `growth_interval` clean steps."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError("need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1; "
                             f"got {init_scale}, {growth_factor}, {backoff_factor}, {growth_interval}")
        self.scale, self.growth_factor, self.backoff_factor = float(init_scale), growth_factor, backoff_factor
        self.growth_interval, self.clean_steps = growth_interval, 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0


class MixedPrecisionOptimizer:
    """16-bit parameters in the model, fp32 master copies in the optimizer.

        model = build_gpt(...)
        optimizer = MixedPrecisionOptimizer(model, torch.optim.AdamW, dtype=torch.float16, lr=3e-4)
        loss = model_loss(model, batch)
        optimizer.backward(loss)          # (loss * S).backward()
        stepped = optimizer.step()        # False when an overflow skipped the step
        optimizer.zero_grad()

    dtype: torch.bfloat16 or torch.float16 (the model's floating parameters and buffers are cast).
    loss_scale: "dynamic" (default for fp16), None (default for bf16) or a fixed number.
    master_weights: False steps the 16-bit parameters directly (to show what the master copy saves).
    group: average the gradients over this process group's ranks (data parallelism), in fp32;
        None: no averaging (one device, or gradients already averaged).
    The outputs of `model.lm_head`, when there is one, are cast to fp32 (a forward hook), so that
    softmax and the loss run in fp32 as in Megatron-LM: in fp16 a loss of 5.5 times S = 2^16
    would overflow before backward starts.
    """

    def __init__(self, model: nn.Module, optimizer_class=torch.optim.AdamW, *, dtype: torch.dtype = torch.bfloat16,
                 loss_scale="auto", master_weights: bool = True, group=None, **defaults):
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        if loss_scale == "auto":
            loss_scale = "dynamic" if dtype == torch.float16 else None
        if not (loss_scale is None or loss_scale == "dynamic" or (isinstance(loss_scale, (int, float)) and loss_scale > 0)):
            raise ValueError(f"loss_scale must be 'dynamic', None or a positive number, got {loss_scale!r}")
        self.model, self.dtype, self.group, self.master_weights = model.to(dtype), dtype, group, master_weights
        self.params = [p for p in model.parameters() if p.requires_grad]
        if master_weights:
            self.masters = [p.detach().float().clone() for p in self.params]  # fp32, 4 bytes per parameter
            self.optimizer = optimizer_class(self.masters, **defaults)
        else:
            self.masters = None
            self.optimizer = optimizer_class(self.params, **defaults)
        if isinstance(getattr(model, "lm_head", None), nn.Module):
            model.lm_head.register_forward_hook(lambda module, args, out: out.float())  # logits (B, s, V) in fp32
        self.scaler = DynamicLossScaler() if loss_scale == "dynamic" else None
        self.fixed_scale = float(loss_scale) if isinstance(loss_scale, (int, float)) else 1.0
        self.skipped_steps = 0

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else self.fixed_scale

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of loss * S (S = 1 without loss scaling)."""
        (loss * self.loss_scale).backward()

    @torch.no_grad()
    def step(self) -> bool:
        """Unscale, check for overflow, step the fp32 masters and copy them into the model. True if stepped."""
        world_size = dist.get_world_size(self.group) if self.group is not None else 1
        grads = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) if p.grad is None else p.grad.float()
                 for p in self.params]  # fp32 copies, (shape of p) each
        if world_size > 1:
            for g in grads:
                ops.all_reduce(g, group=self.group)  # sum over ranks, fp32, in place, same shape
        divisor = self.loss_scale * world_size
        found_inf = not all(g.is_meta or torch.isfinite(g).all() for g in grads)  # meta: shapes only, no values
        if self.scaler is not None:
            self.scaler.update(found_inf)
        if found_inf:
            self.skipped_steps += 1
            return False
        if self.master_weights:
            for master, g in zip(self.masters, grads):
                master.grad = g.div_(divisor)
            self.optimizer.step()
            for p, master in zip(self.params, self.masters):
                p.copy_(master)  # fp32 -> 16 bits, rounded to nearest
                master.grad = None  # the fp32 gradients live only during the step
        else:
            for p, g in zip(self.params, grads):
                p.grad = g.div_(divisor).to(self.dtype)
            self.optimizer.step()
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state with the trainable parameters at master precision (fp32), when there are masters."""
        state = {name: t.detach().clone() for name, t in self.model.state_dict().items()}
        if self.master_weights:
            names = {id(p): name for name, p in self.model.named_parameters()}
            for p, master in zip(self.params, self.masters):
                state[names[id(p)]] = master.clone()
        return state

    def state_bytes(self) -> dict:
        """Bytes held between steps: 16-bit params, 16-bit grads (as after backward), fp32 masters, optimizer state."""
        params = sum(p.numel() * p.element_size() for p in self.params)
        grads = sum(p.numel() * p.element_size() for p in self.params)  # one 16-bit gradient per parameter
        masters = sum(m.numel() * m.element_size() for m in self.masters) if self.master_weights else 0
        state = sum(t.numel() * t.element_size() for s in self.optimizer.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.numel() > 1)
        return dict(params=params, grads=grads, master=masters, optimizer=state,
                    total=params + grads + masters + state)


# ---------------------------------------------------------------------------------
# what 16 bits lose, measured


@torch.no_grad()
def underflow_fraction(fp32_grads: list[torch.Tensor], dtype: torch.dtype = torch.float16, scale: float = 1.0) -> float:
    """Of the non-zero fp32 gradient elements, the fraction that become 0 when (g * scale) is stored in `dtype`."""
    nonzero = lost = 0
    for g in fp32_grads:
        g = g.detach().float().flatten()
        mask = g != 0  # (n,)
        nonzero += int(mask.sum())
        lost += int(((g[mask] * scale).to(dtype) == 0).sum())
    return lost / max(nonzero, 1)


@torch.no_grad()
def lost_update_fraction(weights: torch.Tensor, updates: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> float:
    """Of the non-zero `updates`, the fraction that leave `weights`, stored in `dtype`, unchanged."""
    w = weights.detach().to(dtype)
    moved = (w.float() + updates.float()).to(dtype)  # the 16-bit weight after the update, rounded
    nonzero = updates != 0
    return float(((moved == w) & nonzero).sum()) / max(int(nonzero.sum()), 1)
