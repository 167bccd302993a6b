#!/usr/bin/env bash
# An overnight run on every idle GPU of this machine: 2 GPU-hours, template planner.
set -euo pipefail
agent doctor
agent tune --model "${1:-examples/llama.py}" --gpu-hours 2 --max-candidates 2000 --patience 80
