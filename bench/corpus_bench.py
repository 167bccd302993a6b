"""One corpus on one device (issue 50): many model files in one `agent tune`, each distinct problem
searched once, then every model against eager and every torch.compile mode.

    python bench/corpus_bench.py OUT_DIR [MODEL.py ...] [--gpu-hours H] [--candidates N]
        [--planner P] [--modes all|torch.compile,...] [--alone ROWS.jsonl] [--deadline-s S] [--devices D]

Without model files: the five transformers models and four KernelBench-style files of
tests/problems/ (full size on a GPU). Runs `agent tune --model ... --json` (the compile baselines
on), or `--resume` of the corpus OUT_DIR/corpus.txt names, so a set too long for one lease goes on
in the next with the same OUT_DIR. At `--deadline-s` (default 1380: a 25-minute lease less its
start) the tune gets SIGTERM, stops cleanly and stays resumable.

Prints one row per model (eager, the best compile mode, our fastest way, ours against the best
compile mode, fast_1), one per problem class shared by several files, and the corpus's trials and
device time against tuning the files one by one: estimated (every member searched as its leader
was) and, with `--alone ROWS.jsonl` (bench/problem_set_bench.py's rows of the same files), as
measured. Writes OUT_DIR/corpus_rows.json.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

SET = ROOT / "tests" / "problems"
DEFAULT = [SET / f"{stem}.py" for stem in ("hf_llama", "hf_qwen2", "hf_mistral", "hf_qwen3", "hf_gpt2", "l1_softmax",
                                           "l1_layernorm", "l2_gemm_gelu_layernorm", "l3_swiglu_mlp")]


def _options(argv: list[str]) -> tuple[Path, list[Path], dict]:
    args = list(argv)
    if not args:
        sys.exit(__doc__)
    out_dir = Path(args.pop(0))
    opts = {"--gpu-hours": "0.25", "--candidates": "200", "--planner": "auto", "--modes": "all", "--alone": "",
            "--deadline-s": "1380", "--devices": ""}
    for key in list(opts):
        if key in args:
            i = args.index(key)
            opts[key] = args[i + 1]
            del args[i:i + 2]
    models = [Path(a) for a in args] or DEFAULT
    if missing := [str(m) for m in models if not m.is_file()]:
        sys.exit(f"no such model file: {', '.join(missing)}")
    return out_dir, models, opts


def tune(out_dir: Path, models: list[Path], opts: dict, con: Console) -> dict | None:
    """The corpus's `agent tune` (or its resume): its --json summary, or None."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    marker = out_dir / "corpus.txt"
    common = ["--json", "--gpu-hours", opts["--gpu-hours"], "--max-candidates", opts["--candidates"]]
    common += ["--devices", opts["--devices"]] if opts["--devices"] else []
    if marker.is_file() and Path(marker.read_text().strip()).is_dir():
        cmd = ["--resume", marker.read_text().strip()]
    else:
        cmd = [a for m in models for a in ("--model", str(m))] + ["--runs-dir", str(out_dir / "runs"),
                                                                 "--planner", opts["--planner"], "--baselines"]
        cmd += [] if opts["--modes"] == "all" else ["--compile-modes", opts["--modes"]]
    con.print(f"[{time.strftime('%H:%M:%S')}] agent tune {' '.join(cmd + common)}", markup=False)
    with open(out_dir / "tune.log", "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "agent", "tune", *cmd, *common], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            stdout, _ = proc.communicate(timeout=float(opts["--deadline-s"]))
        except subprocess.TimeoutExpired:  # a clean stop: the corpus stays resumable with the same OUT_DIR
            proc.send_signal(signal.SIGTERM)
            stdout, _ = proc.communicate()
    try:
        summary = json.loads(stdout)
    except ValueError:
        con.print(f"agent tune exit {proc.returncode}; see {out_dir / 'tune.log'}", markup=False)
        found = sorted((out_dir / "runs").glob("corpus-*"))
        if found:
            marker.write_text(str(found[-1]))
        return None
    marker.write_text(summary["corpus"])
    return summary


def rows(corpus: Path) -> tuple[list[dict], object]:
    """Per model its numbers (agent/report/corpus_view.py), and the corpus's view."""
    from agent.report.corpus_view import build_corpus, model_numbers
    from tools.corpus import CorpusFolder
    from tools.e2e import IntegrationResult
    folder = CorpusFolder.open(corpus)
    view = build_corpus(folder)
    out = []
    for m, shown in zip(folder.info().models, view.models):
        res = IntegrationResult.load(folder.models_dir / m.run) if m.run else None
        out.append({"model": m.name, "state": m.state, "trials": shown["trials"], "device_s": float(shown["device_s"]),
                    "why": shown["why"], **(model_numbers(res) if res else {})})
    return out, view


def alone(path: str, names: list[str]) -> dict:
    """Trials and seconds of the same files tuned one by one (bench/problem_set_bench.py's rows)."""
    if not path:
        return {}
    kept = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            kept[r["problem"]] = r
    have = [n for n in names if n in kept and "error" not in kept[n]]
    return {"files": have, "missing": [n for n in names if n not in have],
            "trials": sum(kept[n].get("trials") or 0 for n in have),
            "seconds": sum(kept[n].get("seconds") or 0 for n in have)}


def show(con: Console, table_rows: list[dict], view, measured: dict) -> None:
    table = Table(title="corpus, end to end per model (weighted over workloads), one device")
    for col in ("model", "trials", "device s", "eager ms", "best compile mode", "ours", "ours vs compile", "fast_1",
                "why not"):
        table.add_column(col)
    for r in table_rows:
        cpu = r.get("cpu")
        table.add_row(r["model"], str(r["trials"]), f"{r['device_s']:.0f}", f"{r['eager_ms']:.4f}" if "eager_ms" in r
                      else "-", f"{r['compile_ms']:.4f} ({r['compile_mode']})" if r.get("compile_mode") else "-",
                      f"{r['ours_ms']:.4f} ({r['way']})" if r.get("way") else "-",
                      "CPU" if cpu else (f"{r['vs_compile']:.2f}x" if r.get("vs_compile") else "-"),
                      "-" if cpu or "fast_1" not in r else ("yes" if r["fast_1"] else "no"), r["why"][:50] or "-")
    con.print(table)
    for c in view.classes:
        if len(c["members"]) > 1:
            con.print(f"class {c['name']} ({c['share']}), winner {c['winner']}: "
                      + "; ".join(f"{m['member']}: {m['result']}" for m in c["members"]), markup=False)
    t = view.totals
    ok = [r for r in table_rows if "fast_1" in r and not r.get("cpu")]
    con.print(f"corpus: {t['trials']} trials, {t['device_s']} device s; one by one (estimated from the leaders' "
              f"searches): {t['alone_trials']} trials, {t['alone_s']} device s; saved {t['saved_trials']} trials, "
              f"{t['saved_s']} s. fast_1 against the best compile mode: {sum(r['fast_1'] for r in ok)}/{len(ok)}",
              markup=False)
    if measured:
        con.print(f"one by one, measured (problem_set_bench rows of {len(measured['files'])} files; none for "
                  f"{', '.join(measured['missing']) or 'none'}): {measured['trials']} trials, {measured['seconds']} s "
                  "wall per tune", markup=False)


def main() -> None:
    out_dir, models, opts = _options(sys.argv[1:])
    out_dir.mkdir(parents=True, exist_ok=True)
    con = Console(width=220)
    summary = tune(out_dir, models, opts, con)
    marker = out_dir / "corpus.txt"
    if not marker.is_file():
        sys.exit("no corpus was made; see tune.log")
    table_rows, view = rows(Path(marker.read_text().strip()))
    measured = alone(opts["--alone"], [r["model"] for r in table_rows])
    show(con, table_rows, view, measured)
    (out_dir / "corpus_rows.json").write_text(json.dumps({"rows": table_rows, "classes": view.classes,
                                                          "totals": view.totals, "alone": measured,
                                                          "exit_code": summary and summary["exit_code"]}, indent=1))


if __name__ == "__main__":
    main()
