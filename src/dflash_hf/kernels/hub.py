"""Assemble the Hub kernel repo (and its local twin) from the one kernel source, `dflash_kernels/`.

A kernel repo holds `build/<variant>/` folders, each with the package's files and a `metadata.json`; the Triton
kernels are architecture-independent, so the variants are the no-arch ones of `kernels` 0.17 (`torch-cuda`, and
`torch-cpu` for the Triton interpreter). The same function writes the local copy that `kernels.get_local_kernel`
loads when the Hub is out of reach.
"""

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

KERNEL_SOURCE = Path(__file__).parent / "dflash_kernels"
KERNEL_NAME = "dflash-kernels"
KERNEL_LICENSE = "Apache-2.0"
# no-arch variant -> the backend its metadata declares.
VARIANTS = {"torch-cuda": "cuda", "torch-cpu": "cpu"}
# The repo's static files (card/README) live beside the other Hub uploads in a source checkout.
STATIC_DIR = Path(__file__).resolve().parents[3] / "hub_upload" / "kernels"
CACHE_ENV = "DFLASH_KERNELS_CACHE"


def source_files() -> list[Path]:
    return sorted(p for p in KERNEL_SOURCE.glob("*.py") if p.is_file())


def source_digest() -> str:
    """Content hash of the kernel source: names the local build and each variant's module id."""
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def api_version() -> int:
    """API_VERSION as written in the source, read without importing it (importing needs triton)."""
    for line in (KERNEL_SOURCE / "__init__.py").read_text().splitlines():
        if line.startswith("API_VERSION"):
            return int(line.split("=", 1)[1].split("#")[0].strip())
    raise RuntimeError(f"No API_VERSION line in {KERNEL_SOURCE / '__init__.py'}.")


def variant_metadata(variant: str, digest: str) -> dict:
    version = api_version()
    return {
        # The loader registers the module under this id: unique per source, version and variant.
        "id": f"_dflash_kernels_v{version}_{digest[:12]}_{variant.replace('-', '_')}",
        "name": KERNEL_NAME,
        "version": version,
        "license": KERNEL_LICENSE,
        "python-depends": [],
        "backend": {"type": VARIANTS[variant]},
    }


def write_build(dest: Path, variants=tuple(VARIANTS)) -> Path:
    """Write `dest/build/<variant>/` for each variant: the package's .py files plus metadata.json."""
    digest = source_digest()
    for variant in variants:
        if variant not in VARIANTS:
            raise ValueError(f"Unknown kernel variant {variant!r}; known: {sorted(VARIANTS)}.")
        folder = dest / "build" / variant
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        for path in source_files():
            shutil.copy2(path, folder / path.name)
        (folder / "metadata.json").write_text(json.dumps(variant_metadata(variant, digest), indent=2) + "\n")
    return dest


def write_hub_repo(dest: Path, variants=tuple(VARIANTS), static_dir: Path | None = STATIC_DIR) -> Path:
    """Assemble the Hub kernel repo in `dest`: the static files (README card) and `build/<variant>/`.

    Upload the folder to the kernel repo's branch `v<API_VERSION>` (what `get_kernel(..., version=N)` resolves).
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if static_dir is not None and Path(static_dir).is_dir():
        for path in sorted(Path(static_dir).iterdir()):
            if path.is_file():
                shutil.copy2(path, dest / path.name)
    else:
        logger.warning("No static kernel-repo files at %s: writing the build variants only.", static_dir)
    write_build(dest, variants)
    logger.info("Wrote kernel repo %s (API v%d, variants %s)", dest, api_version(), ", ".join(variants))
    return dest


def _cache_root() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflash_hf" / "kernels"


def shipped_kernel_repo() -> Path:
    """A local build of the shipped kernel source for `kernels.get_local_kernel`, written once per source hash."""
    digest = source_digest()
    for root in (_cache_root(), Path(tempfile.gettempdir()) / "dflash_hf_kernels"):
        target = root / digest[:16]
        if (target / "build").is_dir():
            return target
        try:
            root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=root))
            write_build(staging)
            try:
                os.replace(staging, target)
            except OSError:
                shutil.rmtree(staging, ignore_errors=True)  # another process finished first
            if (target / "build").is_dir():
                return target
        except OSError as error:
            logger.debug("Kernel cache %s is not writable (%s); trying the next location.", root, error)
    raise OSError(f"Could not write the local kernel build under {_cache_root()} or the temp dir; set {CACHE_ENV}.")
