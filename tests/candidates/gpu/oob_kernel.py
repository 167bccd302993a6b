"""EXPECT: crash -- a Triton RMSNorm that stores far past the end of its output (no mask,
huge offset): an illegal memory access, which spoils the CUDA context of its worker."""
import torch
import triton
import triton.language as tl


@triton.jit
def _bad(x_ptr, y_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + cols)
    tl.store(y_ptr + row * n_cols + cols + (1 << 40), x)


def forward(module, x):
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    y = torch.empty_like(x2)
    _bad[(x2.shape[0],)](x2, y, n, BLOCK=triton.next_power_of_2(n))
    return y.view_as(x)
