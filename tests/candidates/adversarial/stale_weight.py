"""EXPECT: ignored_parameter -- keeps a copy of the weight from its first call and never looks again:
right until the weight changes in place (an optimizer step, load_state_dict), then answers with
the old one. A perturbed copy of the module would not see it; the weights moved in place do."""
import torch


def forward(module, x):
    w = module.__dict__.get("_kept_weight")
    if w is None:
        w = module.__dict__["_kept_weight"] = module.weight.detach().clone()
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.eps)
    return w * h.to(x.dtype)
