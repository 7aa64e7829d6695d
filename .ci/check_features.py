"""Fails when a dependency would be compiled with different features by the builds the
test command runs: the library build (`cargo build --workspace`), the test build (dev
dependencies too) and maturin's build of eccl-python alone. Each difference compiles
that dependency, and every crate above it, once more (tokio's differed, so eccl was
built three times). The fix is a line in workspace-hack/Cargo.toml."""

import re
import subprocess
import sys

LINE = re.compile(r"(\S+) (v\S+)(?: \([^)]*\))? \[(.*)\]$")


def features(*args):
    out = subprocess.run(["cargo", "tree", "--locked", "--prefix", "none", "-f", "{p} [{f}]",
                          *args], check=True, capture_output=True, text=True).stdout
    got = {}
    for line in out.splitlines():
        m = LINE.match(line.strip())
        if m:
            got.setdefault((m[1], m[2]), set()).update(f for f in m[3].split(",") if f)
    return got


def main():
    # The test command builds with eccl-transport's verbs feature, through eccl-python's
    # (.ci/test.sh: CARGO_FEATURES; maturin --features verbs).
    builds = {
        "cargo build --workspace": features("--workspace", "--features", "eccl-python/verbs",
                                            "-e", "normal,build"),
        "cargo test --workspace": features("--workspace", "--features", "eccl-python/verbs"),
        "maturin (-p eccl-python --features verbs)": features(
            "-p", "eccl-python", "--features", "verbs", "-e", "normal,build"),
    }
    names = list(builds)
    bad = []
    for crate in sorted(set().union(*builds.values())):
        seen = {n: builds[n][crate] for n in names if crate in builds[n]}
        if len({frozenset(f) for f in seen.values()}) > 1:
            bad.append(f"  {crate[0]} {crate[1]}: " + "; ".join(
                f"{n}: {','.join(sorted(f)) or '(none)'}" for n, f in seen.items()))
    if bad:
        print("dependencies whose features differ between builds (add the union to "
              "workspace-hack/Cargo.toml):\n" + "\n".join(bad))
        return 1
    print(f"one feature set per dependency across {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
