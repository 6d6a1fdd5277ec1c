#!/usr/bin/env bash
# Fetch, on a machine that reaches a package index, the wheels scripts/gpu_check.py needs on the
# project's lent H200 (IPython, ipywidgets, and pytest for its `pytest -m gpu` check), into the
# git-ignored .whl/ that the device tool carries (`carry: [".whl"]`).
#
# Why a script: the H200's image has Python 3.12, torch, numpy and pandas but not IPython or ipywidgets,
# nothing outside it can be reached from it, and a session gets 15 minutes of it: the list is kept here,
# not rediscovered. The device-side commands are in docs/benchmarks.md ("Running the GPU check").
#
#   bash scripts/gpu_wheels.sh            # Python 3.12 on x86_64 Linux, as the image has
#   PYVER=3.11 bash scripts/gpu_wheels.sh  # another image's Python
set -euo pipefail
cd "$(dirname "$0")/.."
pyver="${PYVER:-3.12}"
rm -rf .whl
# --only-binary with --python-version/--platform: the image cannot build an sdist; IPython's few compiled
# dependencies (psutil, wcwidth) ship abi3 manylinux wheels.
python3 -m pip download --quiet --only-binary=:all: --python-version "$pyver" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --dest .whl ipython ipywidgets pytest 2>&1 | { grep -v "^WARNING: Location" || true; }
shopt -s nullglob
wheels=(.whl/*.whl)
count=${#wheels[@]}
if [ "$count" -eq 0 ]; then
    echo "gpu_wheels: no wheel was downloaded (is a package index reachable?)" >&2
    exit 1
fi
echo "gpu_wheels: $count wheels, $(du -sh .whl | cut -f1), in .whl/ for Python $pyver"
