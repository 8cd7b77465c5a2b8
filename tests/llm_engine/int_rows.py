"""What our own int kernel multiplies the weights by: each row's activations as two int8 codes a
group (`llm_engine.lean.int_kernel`)."""

import torch


def quantised_rows(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """x [rows, in] as the kernel sees it, in float64: per group of 32, x ~ dx (q + r / 128) with
    dx = max|x| / 127, q = round(x / dx) and r = round(128 (x / dx - q)), half to even, x / dx
    taken as x times 1 / dx in fp32."""
    x = x.float().reshape(x.shape[0], -1, group)
    dx = x.abs().amax(-1, keepdim=True) / 127.0
    scaled = x * torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    q = torch.round(scaled)
    r = torch.round((scaled - q) * 128)
    return ((128 * q + r).double() * (dx / 128).double()).reshape(x.shape[0], -1)
