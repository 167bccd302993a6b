"""EXPECT: ok -- tries to reach a server on loopback; in the sandbox's empty network
namespace it cannot, and then it behaves. If the connection succeeds it returns garbage."""
import socket

PORT = {port}


def forward(module, x):
    try:
        socket.create_connection(("127.0.0.1", PORT), timeout=1).close()
        return x * 0
    except OSError:
        return type(module).forward(module, x)
