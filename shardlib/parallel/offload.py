"""CPU offload of the optimizer: master weights, Adam's m and v, and the step itself live on the host.

ZeRO-Offload (Ren et al., arXiv 2101.06840, Section 4) keeps on the GPU only what forward and
backward touch, the 16-bit parameters and gradients, and moves the rest of the model states, the
12 bytes per parameter of fp32 master weights, m and v, to CPU memory, where the CPU runs the
optimizer step. PyTorch's FSDP does the same per shard (`CPUOffloadPolicy` in fully_shard).
`CPUOffloadOptimizer` wraps any torch optimizer that way; built over the pieces of a fully_shard-ed
model it offloads each rank's shard, as ZeRO-Offload does with ZeRO-2 and FSDP with ZeRO-3.

Per step and rank, over PCIe (a shard of Psi/N parameters; N = 1 without sharding):

    device -> host   the gradients          Psi/N * grad bytes   (2 in bf16/fp16, 4 in fp32)
    host -> device   the updated params     Psi/N * param bytes  (2 in bf16/fp16, 4 in fp32)
    device memory    params + grads only:   (2 + 2) Psi/N instead of 16 Psi/N with mixed-precision Adam
    host memory      fp32 master, m, v:     12 Psi/N

The traffic is 4 Psi/N bytes each step in 16 bits (ZeRO-Offload, Section 4.1), which hides under
forward and backward when they are long enough; the CPU's Adam over Psi/N parameters (reading and
writing 16 bytes each) is the cost that does not (`offload_bytes_per_step`). On a machine without a
GPU the "device" is the CPU too: the copies are memory copies, counted all the same.
"""

from __future__ import annotations

import torch

__all__ = ["CPUOffloadOptimizer", "offload_bytes_per_step"]


class CPUOffloadOptimizer:
    """`optimizer_class` over fp32 host copies of `params`; step() moves gradients down, parameters up.

        optimizer = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-4)
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        optimizer.moved      # {"to_host": bytes, "to_device": bytes} of the last step

    The parameters may be 16-bit (the host copies are then the fp32 master weights) or fp32.
    pin_memory: page-locked host copies (faster, asynchronous copies); default: when params are on CUDA.
    """

    def __init__(self, params, optimizer_class=torch.optim.AdamW, *, pin_memory: bool | None = None, **defaults):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("CPUOffloadOptimizer: no parameter has requires_grad=True: nothing to train")
        if pin_memory is None:
            pin_memory = any(p.is_cuda for p in self.params)
        # masters on the host, at least fp32 (float64 parameters keep float64)
        self.host = [p.detach().to("cpu", torch.promote_types(p.dtype, torch.float32), copy=True) for p in self.params]
        if pin_memory:
            self.host = [h.pin_memory() for h in self.host]
        self.optimizer = optimizer_class(self.host, **defaults)  # m and v are created on the host too
        self.moved = {"to_host": 0, "to_device": 0}

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self) -> None:
        moved = {"to_host": 0, "to_device": 0}
        for p, h in zip(self.params, self.host):
            if p.grad is None:
                h.grad = None
                continue
            h.grad = p.grad.detach().to("cpu", h.dtype, copy=True)  # device -> host, (shape of p)
            moved["to_host"] += p.grad.numel() * p.grad.element_size()
        self.optimizer.step()  # on the CPU
        for p, h in zip(self.params, self.host):
            if h.grad is not None:
                p.copy_(h, non_blocking=h.is_pinned())  # host -> device, rounded to p's dtype
                moved["to_device"] += p.numel() * p.element_size()
                h.grad = None
        if any(p.is_cuda for p in self.params):
            torch.cuda.synchronize()  # the non-blocking copies must land before the next forward
        self.moved = moved

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def device_bytes(self) -> int:
        """Bytes of parameters and their gradients (one per parameter) on the device."""
        return sum(2 * p.numel() * p.element_size() for p in self.params)

    def host_bytes(self) -> int:
        """Bytes of the fp32 master copies and the optimizer state on the host."""
        state = sum(t.numel() * t.element_size() for s in self.optimizer.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.numel() > 1)
        return sum(h.numel() * h.element_size() for h in self.host) + state


def offload_bytes_per_step(n_params: float, world_size: int = 1, grad_bytes: float = 2, param_bytes: float = 2) -> dict:
    """Bytes one rank moves per step with the optimizer offloaded: gradients down, parameters up."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    shard = n_params / world_size
    return {"to_host": shard * grad_bytes, "to_device": shard * param_bytes,
            "total": shard * (grad_bytes + param_bytes)}
