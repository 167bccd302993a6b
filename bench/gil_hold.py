"""A lane's judge beside another thread of the tuner that zeroes a received frame's buffer: once
holding the GIL (`bytearray(n)`, as sandbox/protocol.py allocated frames until 2026-12-06) and
once not (torch's fill, the same memory work). Only the GIL differs between the two.

    python bench/gil_hold.py [--mb 300] [--elements 33554432] [--rounds 2]

Prints the median time of `tools.verify.diff` over a bf16 output of `--elements` (a long
prefill's is 67M) alone and beside each kind of zeroing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

from tools import verify  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=300, help="size of each zeroed buffer")
    ap.add_argument("--elements", type=int, default=1 << 25)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = torch.randn(args.elements, dtype=torch.bfloat16)
    ref = out.clone()

    def judge(k: int = 6) -> float:
        times = []
        for _ in range(k):
            t0 = time.perf_counter()
            verify.diff([out], [ref])
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    def beside(zero) -> float:
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                zero()
                time.sleep(0.05)
        t = threading.Thread(target=loop, daemon=True)
        t.start()
        try:
            return judge()
        finally:
            stop.set()
            t.join()
    n = args.mb << 20
    judge(2)  # warm
    print(f"diff of {args.elements:,} bf16 elements alone: {judge():.0f} ms")
    for _ in range(args.rounds):
        print(f"  beside bytearray({args.mb} MB), GIL held while zeroing: {beside(lambda: bytearray(n)):.0f} ms")
        print(f"  beside torch.empty({args.mb} MB).zero_(), GIL free: "
              f"{beside(lambda: torch.empty(n, dtype=torch.uint8).zero_()):.0f} ms")


if __name__ == "__main__":
    main()
