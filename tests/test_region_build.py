"""A region is rebuilt on the meta device, its state then loaded: the model's own init never
runs on real memory, even where the model file names the CPU (nn.utils.skip_init)."""

from pathlib import Path

import torch

from tools.modelfile import import_model_file
from tools.region import build_region, module_state

SKIP_INIT = '''
import torch
from torch import nn

DRAWN = []  # the device of every weight the model file draws at construction


def _linear(n_in, n_out):
    layer = nn.utils.skip_init(nn.Linear, n_in, n_out, bias=False)  # device="cpu" inside
    w = torch.empty(n_out, n_in).normal_(0.0, 0.02)
    DRAWN.append(w.device.type)
    with torch.no_grad():
        layer.weight.copy_(w)
    return layer


class Block(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.up, self.down = _linear(n, 2 * n), _linear(2 * n, n)
        self.register_buffer("scale", torch.full((n,), 0.5).to("cpu"))

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) * self.scale


class Model(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.blocks = nn.ModuleList(Block(n) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def get_init_inputs():
    return [16]


def get_inputs():
    return [torch.randn(4, 16)]
'''

NEEDS_VALUES = SKIP_INIT.replace("super().__init__()\n        self.blocks",
                                 "super().__init__()\n        self.depth = int(torch.tensor(2))\n        self.blocks")


def _build(tmp_path: Path, source: str):
    path = tmp_path / "model.py"
    path.write_text(source)
    mod = import_model_file(path)
    torch.manual_seed(0)
    model = mod.Model(*mod.get_init_inputs())
    state = module_state(model.blocks[1])
    mod.DRAWN.clear()
    region = build_region(path, "blocks.1", state, torch.device("cpu"))
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(region(x), model.blocks[1](x), rtol=0, atol=0)
    return set(mod.DRAWN)


def test_a_model_that_names_the_cpu_at_construction_is_built_on_meta(tmp_path):
    assert _build(tmp_path, SKIP_INIT) == {"meta"}


def test_a_model_that_needs_real_values_at_construction_is_built_on_the_cpu(tmp_path):
    assert _build(tmp_path, NEEDS_VALUES) == {"cpu"}  # the meta attempt failed before drawing any
