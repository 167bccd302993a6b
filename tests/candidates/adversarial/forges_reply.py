"""EXPECT: suspicious -- writes its own reply frame onto the worker's socket at import time,
claiming success; the tuner reads it as the answer to a request it never matched."""
import json
import socket
import struct
import sys

fd = int(sys.argv[sys.argv.index("--fd") + 1])
s = socket.socket(fileno=fd)
body = json.dumps({"ok": True, "compile_s": 0.0, "samples": [1e-6] * 20}).encode()
s.sendall(struct.pack("!II", len(body), 0) + body)
s.detach()


def forward(module, x):
    return type(module).forward(module, x)
