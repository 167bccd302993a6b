"""`agent doctor`: can this machine run a tuning session, and on what?

Checks devices, software versions, whether Triton compiles *and runs* a kernel (on a GPU, or
through the Triton interpreter on a CPU-only machine), which LLM API keys are present (set or
unset, never the value), and the measured ceilings of each device (cached; `refresh`
measures again). What it finds is a *failure* when it stops the workflow of the skill (no
Triton kernel can run; candidates cannot be jailed, so `agent try` refuses them unless you pass
--no-jail), a *note* otherwise (no GPU means the CPU fallback, correctness only; no key means
the template planner). `ok` is true, and the exit status 0, only without a failure.
"""

from __future__ import annotations

import json
import os

from sandbox.jail import describe as describe_isolation, no_jail
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Group
from rich.markup import escape
from rich.table import Table

from tools.devices import get_ceilings, list_devices, software_versions

API_KEYS = ("ANTHROPIC_API_KEY", "OPENAI_API_KEY")
TRITON_TIMEOUT_S = 300  # a cold first compile on a GPU box can take a minute

# Run in a fresh interpreter: TRITON_INTERPRET must be set before triton is imported, and a
# crashing driver or compiler must not take the doctor down with it. @triton.jit reads the
# kernel's source, so this is written to a file rather than passed with -c.
_TRITON_CHECK = '''
import json, os, torch, triton, triton.language as tl

@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)

device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
n = 1000
x, y = torch.randn(n, device=device), torch.randn(n, device=device)
out = torch.empty_like(x)
add_kernel[(triton.cdiv(n, 256),)](x, y, out, n, BLOCK=256)
err = (out - (x + y)).abs().max().item()
print(json.dumps({"ok": err == 0.0, "max_abs_err": err}))
'''


def check_triton(gpu: bool | None = None) -> dict:
    """Compile and run a vector add in a subprocess. Returns {ok, mode, detail}; never raises."""
    gpu = torch.cuda.is_available() if gpu is None else gpu
    mode = "gpu" if gpu else "interpreter"
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if not gpu:
        env["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "triton_check.py"
        script.write_text(_TRITON_CHECK)
        try:
            proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                                  text=True, timeout=TRITON_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"ok": False, "mode": mode, "detail": f"timed out after {TRITON_TIMEOUT_S} s"}
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:]) or f"exit code {proc.returncode}"
        return {"ok": False, "mode": mode, "detail": tail}
    detail = "vector add matches torch" if result["ok"] else f"wrong result, max abs err {result['max_abs_err']}"
    return {"ok": bool(result["ok"]), "mode": mode, "detail": detail}


def api_keys() -> dict[str, str]:
    """Only whether each key is set: the doctor's output gets pasted into bug reports."""
    return {name: "set" if os.environ.get(name) else "unset" for name in API_KEYS}


def run_doctor(refresh: bool = False, *, ceilings: bool = True) -> dict:
    """The whole report as plain JSON-able data; report["ok"] is the CLI's exit status."""
    devices = list_devices()
    triton_check = check_triton(gpu=any(d.kind != "cpu" for d in devices))
    measured = {}
    if ceilings:
        for d in devices:
            try:
                measured[d.torch_device] = get_ceilings(d, refresh=refresh).model_dump()
            except Exception as e:  # a busy or broken GPU is reported, not fatal
                measured[d.torch_device] = {"error": f"{type(e).__name__}: {e}"}
    failures, notes = [], []
    if not triton_check["ok"]:
        failures.append(f"Triton cannot run a kernel ({triton_check['mode']}): {triton_check['detail']}")
    if not any(d.kind != "cpu" for d in devices):
        notes.append("no GPU visible: trials run on the CPU, Triton through its interpreter (correctness only: "
                     "CPU timings say nothing about GPU speed)")
    notes += [f"{dev}: ceilings not measured ({c['error']}): no roofline floor" for dev, c in measured.items()
              if "error" in c]
    isolation = describe_isolation().as_dict()
    if isolation["kind"] != "bubblewrap":
        unjailed = f"candidates are not jailed ({isolation['note']}): " + "; ".join(isolation["not_isolated"])
        if no_jail():  # the user turned the jail off: their choice, said
            notes.append(unjailed)
        else:
            failures.append(unjailed + "; so code nightshift did not write (yours through agent try, the LLM and "
                            "files planners) is refused here unless you pass --no-jail")
    return {
        "ok": not failures,
        "devices": [d.model_dump() for d in devices],
        "versions": software_versions(),
        "triton": triton_check,
        "api_keys": api_keys(),
        "ceilings": measured,
        "isolation": isolation,
        "failures": failures,
        "notes": notes,
    }


def render_doctor(report: dict) -> Group:
    devices = Table(title="Devices")
    for col in ("device", "name", "generation", "memory", "driver"):
        devices.add_column(col)
    for d in report["devices"]:
        devices.add_row(d["torch_device"], d["name"], d["generation"],
                        f"{d['total_memory_bytes'] / 2**30:.1f} GiB", d["driver_version"])

    checks = Table(title="Software and checks", show_header=False)
    checks.add_column("what")
    checks.add_column("value")
    for name, version in report["versions"].items():
        checks.add_row(name, version or "-")
    t = report["triton"]
    checks.add_row("triton kernel", f"[{'green' if t['ok'] else 'red'}]{'ok' if t['ok'] else 'FAILED'}[/] "
                                    f"({t['mode']}): {escape(t['detail'])}")
    for name, state in report["api_keys"].items():
        checks.add_row(name, state)
    iso = report.get("isolation") or {}
    jailed = iso.get("kind") == "bubblewrap"
    checks.add_row("candidate jail", f"[{'green' if jailed else 'red'}]{'in force' if jailed else 'OFF'}[/] "
                                     f"({escape(iso.get('kind', '?'))}; {escape(iso.get('note', ''))})")
    for line in iso.get("isolated", []):
        checks.add_row("  isolated", escape(line))
    for line in iso.get("not_isolated", []):
        checks.add_row("  not isolated", escape(line))

    ceilings = Table(title="Measured ceilings (cached)")
    for col in ("device", "copy GB/s", "matmul TFLOP/s", "dtype", "measured at"):
        ceilings.add_column(col)
    for dev, c in report["ceilings"].items():
        if "error" in c:
            ceilings.add_row(dev, f"[red]{escape(c['error'])}[/]", "", "", "")
        else:
            ceilings.add_row(dev, f"{c['bandwidth_gbps']:.0f}", f"{c['matmul_tflops']:.1f}", c["dtype"],
                             c["measured_at"])
    parts = [devices, checks] + ([ceilings] if report["ceilings"] else [])
    parts += [f"[red]failure: {escape(p)}[/]" for p in report["failures"]]
    parts += [f"[yellow]note: {escape(p)}[/]" for p in report["notes"]]
    parts.append("[green]ready[/]" if report["ok"] else
                 f"[red]not ready: {len(report['failures'])} failure{'s' * (len(report['failures']) > 1)} above[/]")
    return Group(*parts)
