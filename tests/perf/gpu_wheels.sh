#!/usr/bin/env bash
# The wheels tests/perf/gpu_check.py needs on the GPU machine (Python 3.12, no network; docs/development.md):
# onnxruntime-gpu and what the worker needs beyond what that machine has, into .whl/ (ignored by git), the
# big onnxruntime-gpu wheel split into parts of 60 MB under .whl-partN/ to carry one per call.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .git/info && touch .git/info/exclude
grep -qx '/.whl*/' .git/info/exclude || echo '/.whl*/' >> .git/info/exclude
rm -rf .whl .whl-part*
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$1" "${@:2}"; }
get .whl simplejpeg 'sqlalchemy>=2.0,<2.2' alembic mako markupsafe 'watchdog>=7.0' prometheus-client \
  'matplotlib>=3.8' contourpy cycler fonttools kiwisolver pyparsing python-dateutil six greenlet typing-extensions
get .whl-gpu onnxruntime-gpu
( cd .whl-gpu && sha256sum onnxruntime_gpu-*.whl > SHA256 && split -b 60m onnxruntime_gpu-*.whl part- )
n=0
for part in .whl-gpu/part-*; do n=$((n + 1)); mkdir -p ".whl-part$n"; mv "$part" ".whl-part$n/"; done
mv .whl-gpu/SHA256 .whl-part1/ && rm -rf .whl-gpu
du -sh .whl .whl-part*
cat <<'SAY'
Carry each .whl-partN (and .whl) in a call of its own, each command just `ls`, back to back while the machine
stays warm; then, carrying the last of them, run (docs/development.md#measuring-on-a-gpu):

cat .whl-part*/part-* > /tmp/w.whl && n=$(awk '{print $2}' .whl-part1/SHA256) && mv /tmp/w.whl /tmp/$n && (cd /tmp && sha256sum -c $OLDPWD/.whl-part1/SHA256) && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/$n .whl/*.whl && PYTHONPATH=/tmp/site:$PWD python3 tests/perf/gpu_check.py --out $OUT --budget-s 420
SAY
