"""A correct candidate: one-pass Triton RMSNorm (fp32 accumulation), a row per program."""
import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm(x_ptr, w_ptr, y_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (x * rstd).to(w.dtype) * w
    tl.store(y_ptr + row * n_cols + cols, y, mask=mask)


def forward(module, x):
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    y = torch.empty_like(x2)
    _rmsnorm[(x2.shape[0],)](x2, module.weight, y, n, module.eps, BLOCK=triton.next_power_of_2(n))
    return y.view_as(x)
