"""EXPECT: ok -- the same side-stream work, correctly joined: the caller's stream waits."""
import torch

_stream = None


def forward(module, x):
    global _stream
    if _stream is None:
        _stream = torch.cuda.Stream()
    _stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(_stream):
        y = type(module).forward(module, x)
    torch.cuda.current_stream().wait_stream(_stream)
    y.record_stream(torch.cuda.current_stream())
    return y
