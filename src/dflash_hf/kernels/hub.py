"""The Hub kernel repo, laid out as a kernel-builder no-arch kernel, and its local twin.

    build.toml                     the declaration: name, version (= the Hub branch), license, backends
    torch-ext/dflash_kernels/      the source: the package's `dflash_kernels/`
    build/torch-<backend>/         what `kernels` loads: those files plus metadata.json, one folder per backend
    README.md                      the card (package data, `hub_templates/kernels/`)

The package keeps `build.toml` beside `dflash_kernels/`. `build_variants` derives a repo's build folders from that
repo's own build.toml and torch-ext/, as kernel-builder's no-arch build does (pure Triton: nothing is compiled), so
the declaration and the folders cannot disagree. `shipped_kernel_repo()` writes the same repo locally for
`kernels.get_local_kernel`, which is how the package loads its kernels without the Hub.
"""

import base64
import hashlib
import json
import logging
import os
import shutil
import tempfile
import tomllib
from pathlib import Path

logger = logging.getLogger(__name__)

KERNEL_SOURCE = Path(__file__).parent / "dflash_kernels"
BUILD_TOML = Path(__file__).parent / "build.toml"
CARD_DIR = Path(__file__).resolve().parents[1] / "hub_templates" / "kernels"
# kernel-builder's default for `[torch-noarch] pyext`: the file types a build variant carries.
DEFAULT_PYEXT = ("py", "pyi")
CACHE_ENV = "DFLASH_KERNELS_CACHE"


def read_build_toml(project: Path | None = None) -> dict:
    """The build.toml of a kernel repo folder; by default the package's own."""
    path = BUILD_TOML if project is None else Path(project) / "build.toml"
    with open(path, "rb") as file:
        return tomllib.load(file)


def module_name(config: dict) -> str:
    """The Python name of the kernel: its folder under torch-ext/ and under the package."""
    return config["general"]["name"].replace("-", "_")


def package_files(folder: Path, config: dict) -> list[Path]:
    """The files of a kernel package folder that go into each build variant."""
    extensions = config.get("torch-noarch", {}).get("pyext", DEFAULT_PYEXT)
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix.lstrip(".") in extensions)


def _digest(build_toml: Path, files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in (build_toml, *files):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def source_digest() -> str:
    """Content hash of build.toml and the kernel source: names the local build and each variant's module id."""
    return _digest(BUILD_TOML, package_files(KERNEL_SOURCE, read_build_toml()))


def source_api_version() -> int:
    """API_VERSION as written in the source, read without importing it (importing needs triton)."""
    for line in (KERNEL_SOURCE / "__init__.py").read_text().splitlines():
        if line.startswith("API_VERSION"):
            return int(line.split("=", 1)[1].split("#")[0].strip())
    raise RuntimeError(f"No API_VERSION line in {KERNEL_SOURCE / '__init__.py'}.")


def check_build_toml(config: dict) -> None:
    """The declaration must describe the shipped source: the loader checks API_VERSION against the Hub branch."""
    general = config["general"]
    if module_name(config) != KERNEL_SOURCE.name:
        raise RuntimeError(f"{BUILD_TOML} names {general['name']!r}, but the source is {KERNEL_SOURCE.name}/.")
    if general["version"] != source_api_version():
        raise RuntimeError(f"{BUILD_TOML} declares version {general['version']}, but {KERNEL_SOURCE.name} has "
                           f"API_VERSION = {source_api_version()}: bump both together.")
    if "torch-noarch" not in config:
        raise RuntimeError(f"{BUILD_TOML} must declare [torch-noarch]: the kernels are pure Triton.")


def api_version() -> int:
    """The kernel version, i.e. the Hub branch `v<version>` that `kernels.get_kernel(..., version=N)` resolves."""
    config = read_build_toml()
    check_build_toml(config)
    return config["general"]["version"]


# Build variant -> backend, as build.toml declares them.
VARIANTS = {f"torch-{backend}": backend for backend in read_build_toml()["general"]["backends"]}


# Bumped whenever `variant_metadata` writes something new, so that local builds cached under an older layout are
# rebuilt rather than reused.
METADATA_LAYOUT = 2


def file_digests(files: list[Path]) -> dict:
    """`kernels` >= 0.19's integrity record of a build variant: base64 SHA-256 of each file, by name (its loader
    checks the files against it, and warns when a variant has none)."""
    return {"algorithm": "sha256",
            "files": {p.name: base64.b64encode(hashlib.sha256(p.read_bytes()).digest()).decode() for p in files}}


def variant_metadata(config: dict, backend: str, digest: str, integrity: dict) -> dict:
    """A build variant's metadata.json; `integrity` is `file_digests` of its files (the same in every variant)."""
    general = config["general"]
    return {
        # The loader registers the module under this id, so it must be unique per source and backend.
        "id": f"_{module_name(config)}_{backend}_{digest[:12]}",
        "name": general["name"],
        "version": general["version"],
        "license": general["license"],
        "python-depends": general.get("python-depends", []),
        "backend": {"type": backend},
        "digest": integrity,
    }


def write_source(dest: Path) -> Path:
    """Write the kernel project: `build.toml` and `torch-ext/<name>/`, copied from the package."""
    config = read_build_toml()
    check_build_toml(config)
    dest = Path(dest)
    source = dest / "torch-ext" / module_name(config)
    if source.exists():
        shutil.rmtree(source)
    source.mkdir(parents=True)
    shutil.copy2(BUILD_TOML, dest / "build.toml")
    for path in package_files(KERNEL_SOURCE, config):
        shutil.copy2(path, source / path.name)
    return dest


def build_variants(project: Path) -> Path:
    """Write `project/build/torch-<backend>/` for each backend in the project's build.toml: the files of
    `torch-ext/<name>/` plus a metadata.json."""
    project = Path(project)
    config = read_build_toml(project)
    source = project / "torch-ext" / module_name(config)
    files = package_files(source, config)
    digest = _digest(project / "build.toml", files)
    integrity = file_digests(files)
    for backend in config["general"]["backends"]:
        folder = project / "build" / f"torch-{backend}"
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        for path in files:
            shutil.copy2(path, folder / path.name)
        metadata = variant_metadata(config, backend, digest, integrity)
        (folder / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    return project


def write_hub_repo(dest: Path) -> Path:
    """Assemble the Hub kernel repo in `dest`: the card, build.toml, torch-ext/ and the build variants.

    Upload the folder to the kernel repo's branch `v<version>` (what `get_kernel(..., version=N)` resolves).
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(CARD_DIR.iterdir()):
        if path.is_file():
            shutil.copy2(path, dest / path.name)
    build_variants(write_source(dest))
    logger.info("Wrote kernel repo %s (version %d, variants %s)", dest, api_version(), ", ".join(VARIANTS))
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
        target = root / f"{digest[:16]}-m{METADATA_LAYOUT}"
        if (target / "build").is_dir():
            return target
        try:
            root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=root))
            build_variants(write_source(staging))
            try:
                os.replace(staging, target)
            except OSError:
                shutil.rmtree(staging, ignore_errors=True)  # another process finished first
            if (target / "build").is_dir():
                return target
        except OSError as error:
            logger.debug("Kernel cache %s is not writable (%s); trying the next location.", root, error)
    raise OSError(f"Could not write the local kernel build under {_cache_root()} or the temp dir; set {CACHE_ENV}.")
