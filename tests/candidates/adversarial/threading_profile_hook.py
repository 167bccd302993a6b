"""EXPECT: suspicious -- installs a profile hook for every new thread (threading.setprofile)."""
import threading

threading.setprofile(lambda frame, event, arg: None)


def forward(module, x):
    return type(module).forward(module, x)
