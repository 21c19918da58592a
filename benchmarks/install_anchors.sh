#!/usr/bin/env bash
# The recovery benchmark's anchor, DLRover's flash checkpoint, in a directory of its own
# (.anchors/dlrover): its dependencies pin versions (python-dateutil, protobuf) that the project's
# environment must not take. From PyPI, once; nothing else reads this directory.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
"$PY" -m pip install -q --target .anchors/dlrover "dlrover==0.6.1" grpcio protobuf tornado kubernetes deprecated pynvml
echo "DLRover installed in .anchors/dlrover"
