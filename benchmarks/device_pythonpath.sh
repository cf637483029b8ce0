#!/usr/bin/env bash
# On a machine where `pip install -e .` is not possible (the lent GPU machine: no network, no build
# isolation), lay out the package as it would install (`kernels/` -> `oscar_hf/kernels`,
# `eval/` -> `oscar_hf/eval`) under /tmp/oscar_site and print the PYTHONPATH to use.
# Usage: export PYTHONPATH=$(bash scripts/device_pythonpath.sh); cd /tmp  (run scripts by absolute path)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SITE=/tmp/oscar_site
rm -rf "$SITE" && mkdir -p "$SITE"
cp -r "$ROOT/oscar_hf" "$SITE/oscar_hf"
cp -r "$ROOT/kernels" "$SITE/oscar_hf/kernels"
cp -r "$ROOT/eval" "$SITE/oscar_hf/eval"
echo "$SITE"
