#!/usr/bin/env bash
# Run from the project root after ../shared/device/stage.sh: adds the wheels of the project's
# runtime dependencies that the device kit lacks (the GPU machine has no package index; its
# python3 is 3.12): uvloop and httptools (uvicorn), aiohttp and its dependencies (bench_serving's
# client), and py-spy's (benchmark/spy_serving.py), so that `source .device/env.sh` installs them too.
set -euo pipefail
[ -d .device/wheels ] || { echo "run ../shared/device/stage.sh first" >&2; exit 1; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .device/wheels uvloop httptools py-spy \
  aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna
du -sh .device
