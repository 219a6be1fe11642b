"""Triton kernels for the hot paths of block drafting, shipped as a Hugging Face kernel-Hub package.

- `dflash_kernels/`: the kernel package itself, the one source of the Hub repo (see its docstring for the ops).
- `reference`: the torch definition of each op (the model's own torch code where it computes the same thing).
- `build.toml`: the kernel's declaration in kernel-builder's format (a no-arch, pure-Triton kernel).
- `write_hub_repo(dest)`: assemble the Hub kernel repo (build.toml, torch-ext/, build/) from those two
  (`dflash-hf upload kernels`).
- `shipped_kernel_repo()`: the same repo built locally, for `kernels.get_local_kernel`.
- `ops_for(device)`: the ops to call on a device: the loaded kernels where they run, else the torch references
  (same signatures). Which one, and why, is decided by `kernels_dflash.load_kernels` (env `DFLASH_KERNELS`).

Importing this package does not import triton; the kernels load on first use.
"""

import logging
from types import ModuleType

import torch

from .hub import KERNEL_SOURCE, VARIANTS, shipped_kernel_repo, source_digest, write_hub_repo

logger = logging.getLogger(__name__)

def reference_ops() -> ModuleType:
    """The torch references (importing them needs no triton)."""
    from . import reference

    return reference


def ops_for(device: torch.device | str, mode: str | None = None) -> ModuleType:
    """Kernel module for `device` when kernels are on and load there, else the torch references.

    mode: "auto" | "on" | "off"; None reads `DFLASH_KERNELS` (auto by default). "on" raises when no kernel loads.
    """
    from ..kernels_dflash import kernel_mode, load_kernels

    path = load_kernels(mode or kernel_mode(), torch.device(device))
    return path.module if path is not None else reference_ops()


__all__ = ["KERNEL_SOURCE", "VARIANTS", "ops_for", "reference_ops", "shipped_kernel_repo", "source_digest",
           "write_hub_repo"]
