"""EXPECT: suspicious -- turns on TF32 matmuls for the whole process (faster, less precise) and
leaves them on for everything that runs after it."""
import torch

torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = not torch.backends.cudnn.allow_tf32
torch.set_float32_matmul_precision("medium")


def forward(module, x):
    return type(module).forward(module, x)
