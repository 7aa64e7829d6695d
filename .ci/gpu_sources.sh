#!/usr/bin/env bash
# Prints one hash of the sources the GPU bundle is built from (the crates' and the
# Python package's code, manifests and lock file; not tests or docs). gpu_bundle.sh
# writes it into .gpu/SOURCES; gpu_check.sh compares it with the checkout it runs in, so
# a bundle left from older code is caught before its device time is spent. Needs only
# find, sort and sha256sum (the GPU machine has no git).
set -euo pipefail
cd "$(dirname "$0")/.."
{
    printf '%s\n' Cargo.toml Cargo.lock
    find protocol transport shm algorithms cuda peer master chaos plot workspace-hack python/src \
        python/eccl python/eccl_autoload \( -name tests -o -name benches -o -name __pycache__ \) -prune -o -type f \
        \( -name '*.rs' -o -name '*.py' -o -name '*.cu' -o -name '*.h' -o -name Cargo.toml \) -print
    printf '%s\n' python/Cargo.toml python/pyproject.toml
} | LC_ALL=C sort -u | while IFS= read -r f; do [ -f "$f" ] && sha256sum "$f"; done | sha256sum | cut -c1-16
