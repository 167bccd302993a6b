#!/usr/bin/env bash
# A new user's evening and morning, on a fresh clone: the README's first command,
# a nohup'd tune, kill -9, resume, apply, and the patched model run. CPU is enough.
#   bench/new_user_walkthrough.sh [WORK_DIR]
set -uo pipefail
SRC="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${1:-$(mktemp -d /tmp/nightshift-walk-XXXX)}"
step() { echo; echo "== $*  ($(date +%T))"; }
fail() { echo "FAILED: $*"; exit 1; }
git clone -q "$SRC" "$WORK/repo" && cd "$WORK/repo" || fail "clone"
export LLAMA_PRESET=small LLAMA_LAYERS=1

step "README quickstart, first command"
python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e . || fail "install"
.venv/bin/agent tune --model examples/llama.py --max-candidates 16 > quick.out 2>&1; rc=$?
tail -5 quick.out; [ $rc -eq 0 ] || fail "quickstart exit $rc"

step "nohup agent tune ... &, then kill -9 mid-run"
nohup .venv/bin/agent tune --model examples/llama.py --max-candidates 30 --no-integrate > night.out 2>&1 &
pid=$!
for _ in $(seq 1 150); do sleep 2; run=$(ls -d runs/llama-* 2>/dev/null | sort | tail -1)
  [ -n "$run" ] && [ "$run" != "$(ls -d runs/llama-* | sort | head -1)" ] && [ -f "$run/trials.sqlite" ] && \
    [ "$(grep -o "running: [0-9]* trials" "$run/log.txt" 2>/dev/null | tail -1 | grep -o "[0-9]\+" || echo 0)" -ge 3 ] && break; done
kill -9 $pid; wait $pid 2>/dev/null
echo "killed after: $(grep -c trial "$run/log.txt") log lines"; tail -2 night.out

step "resume the killed run"
.venv/bin/agent tune --resume "$run" --no-integrate > resume.out 2>&1; rc=$?
tail -4 resume.out; [ $rc -eq 0 ] || fail "resume exit $rc"

step "a second tuner on the same run while one runs is refused"
.venv/bin/agent tune --resume "$run" --gpu-hours 2 --max-candidates 60 --no-integrate > second_a.out 2>&1 & a=$!
sleep 8; .venv/bin/agent tune --resume "$run" --no-integrate > second_b.out 2>&1; rc=$?
kill -INT $a; wait $a 2>/dev/null
tail -1 second_b.out; [ $rc -ne 0 ] || fail "second tuner was not refused"

step "agent apply, then run the patched model"
.venv/bin/agent integrate "$run" > integrate.out 2>&1; echo "integrate exit $?"; tail -3 integrate.out
.venv/bin/agent apply "$run" --allow-slower > apply.out 2>&1; rc=$?  # CPU: nothing beats eager
tail -4 apply.out; [ $rc -eq 0 ] || fail "apply exit $rc"
cmd=$(grep -o 'git apply [^`]*' apply.out | head -1)
if [ -n "$cmd" ]; then echo "+ $cmd"; bash -c "$cmd" || fail "$cmd"; else echo "(no winner to apply: nothing faster than the original)"; fi
TRITON_INTERPRET=1 .venv/bin/python - <<'PY' || fail "patched model"
import importlib.util, sys, torch
sys.path.insert(0, "examples")
spec = importlib.util.spec_from_file_location("llama", "examples/llama.py")
m = importlib.util.module_from_spec(spec); sys.modules["llama"] = m; spec.loader.exec_module(m)
model = m.Model(*m.get_init_inputs()).eval()
with torch.no_grad():
    out = model(*m.get_inputs())
out = out[0] if isinstance(out, (tuple, list)) else out
print("patched model ran:", tuple(out.shape), "finite:", bool(torch.isfinite(out).all()))
PY
git status --short | head
step "walkthrough done in $WORK"
