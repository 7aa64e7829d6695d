"""Registers the backend "eccl" on torch releases without lazy backend entry points.

torch 2.15 and newer load the package's `torch.distributed.backends` entry point the first
time a script asks for "eccl" by name. Older releases (2.5 to 2.14, such as the 2.11 of
many GPU images) do not have that hook, but they run every `torch.backends` entry point at
the end of `import torch` (unless `TORCH_DEVICE_BACKEND_AUTOLOAD=0`): there this registers
the backend at once, so an unchanged script needs no `import eccl` there either. On a
torch with the lazy hook it does nothing, so plain `import torch` stays as fast as before.
A failure here is logged and never breaks `import torch` (torch would re-raise it).
"""

import logging


def register() -> None:
    try:
        import torch.distributed as dist

        if not dist.is_available() or hasattr(dist.Backend, "_ensure_backend_registered"):
            return
        import eccl.torch  # noqa: F401  (registers on import)
    except Exception as e:  # noqa: BLE001 - never break `import torch`
        logging.getLogger("eccl.torch").warning(
            "eccl: cannot register the torch backend at torch's start (%s); "
            "`import eccl.torch` registers it", e)
