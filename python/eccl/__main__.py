"""`python -m eccl`: what this installation of eccl is and how it is configured: the
version, the native module, the torch backend's registration, and every ECCL_* variable
with its value here (or its default). `python -m eccl.master` runs a master in its own
process (what `eccl.Master.spawn()` starts)."""

import importlib.metadata
import os
import sys

from . import _eccl


def main() -> int:
    try:
        version = importlib.metadata.version("eccl")
    except importlib.metadata.PackageNotFoundError:
        version = "(not installed as a package)"
    print(f"eccl {version}, native module {_eccl.__file__}")
    try:
        backends = importlib.metadata.entry_points(group="torch.distributed.backends")
        found = any(e.name == "eccl" for e in backends)
        print(f"torch.distributed backend \"eccl\": {'registered' if found else 'not registered'}")
    except Exception as e:  # noqa: BLE001 - only a report
        print(f"torch.distributed backend \"eccl\": unknown ({e})")
    print("\nconfiguration (docs/configuration.md):")
    width = max(len(name) for name, *_ in _eccl.VARIABLES)
    for name, default, read_by, _meaning in _eccl.VARIABLES:
        if "peer" not in read_by and "torch" not in read_by:
            continue
        value = os.environ.get(name)
        shown = "(set, not shown)" if "SECRET" in name and value and not name.endswith("FILE") else value
        print(f"  {name:<{width}}  {shown if value is not None else 'default: ' + default}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
