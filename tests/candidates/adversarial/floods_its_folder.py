"""EXPECT: ok -- would fill its working folder, a tmpfs held in the host's memory: unsized, it
takes up to half of that memory, enough for one candidate to push the tuner out of it. In the
jail the folder is sized (the worker's memory budget, at most a quarter of the host's), and the
candidate behaves; where its folder could hold more than that, it raises."""
import os


def forward(module, x):
    st = os.statvfs(".")
    room = st.f_blocks * st.f_frsize
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if room > memory // 4 + (1 << 20):
        raise RuntimeError(f"its folder holds {room} bytes of {memory}: a flood there could take the host's memory")
    return type(module).forward(module, x)
