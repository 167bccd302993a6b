"""Seeds for the fresh inputs and perturbed parameters a trial draws, shared by the runner (which
verifies) and the timing (which draws new inputs per workload) without importing each other."""

from __future__ import annotations

import os


def seed() -> int:
    return int.from_bytes(os.urandom(7), "little")
