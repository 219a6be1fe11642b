"""Triton kernels: each against its torch reference and the draft with kernels on against kernels off (in a process
started with TRITON_INTERPRET=1, see `interpreted_kernels.py`), plus the switches, the torch fallback, the Hub repo
layout and the import rules, which need no interpreter."""

import ast
import json
import logging
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from tiny import random_dflash, random_dspark, tiny_target

from dflash_hf import kernels_dflash, modeling_dflash
from dflash_hf.kernels import KERNEL_SOURCE, write_hub_repo
from dflash_hf.kernels import hub as kernel_hub
from dflash_hf.layers_dflash import DFlashRMSNorm

TESTS = Path(__file__).parent


def test_kernels_under_the_interpreter():
    """The interpreted checks in their own process: Triton must see TRITON_INTERPRET=1 before its first import."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("DFLASH_KERNELS", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(TESTS / "interpreted_kernels.py"), "-x", "-q", "-p", "no:cacheprovider"],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=900, check=False,
    )
    report = result.stdout[-8000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, report


def test_modes(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("DFLASH_KERNELS", "0")
    assert kernels_dflash.kernel_mode() == "off" and kernels_dflash.load_kernels("off", cpu) is None
    monkeypatch.setenv("DFLASH_KERNELS", "maybe")
    with pytest.raises(ValueError, match="DFLASH_KERNELS"):
        kernels_dflash.kernel_mode()
    monkeypatch.delenv("DFLASH_KERNELS")
    assert kernels_dflash.kernel_mode() == "auto"
    config = random_dflash(tiny_target("qwen3")).config
    config.use_kernels = False
    assert kernels_dflash.kernel_mode(config) == "off"
    monkeypatch.setenv("DFLASH_KERNELS", "1")
    assert kernels_dflash.kernel_mode(config) == "on"  # the environment overrides the config
    assert kernels_dflash.load_kernels("auto", cpu) is None  # auto: torch on the CPU
    with pytest.raises(RuntimeError, match="DFLASH_KERNELS=1"):  # on: loudly, without CUDA or the interpreter
        kernels_dflash.load_kernels("on", cpu)


def test_auto_on_cpu_runs_torch_and_says_so(monkeypatch, caplog):
    monkeypatch.delenv("DFLASH_KERNELS", raising=False)
    target = tiny_target("qwen3")
    draft = random_dflash(target)
    with caplog.at_level(logging.INFO, logger=modeling_dflash.__name__):
        # Full blocks (the fixed policy): the draft runs from the first step, not after the policy's measurements.
        target.generate(torch.tensor([[1, 5, 7]]), assistant_model=draft, max_new_tokens=4, do_sample=False,
                        dflash_policy="fixed")
    assert draft.generation_stats["kernels"] == "torch"
    assert "DFlashDraftModel: torch path." in caplog.text
    assert all(norm._kernels is None for norm in draft.modules() if isinstance(norm, DFlashRMSNorm))


def test_auto_leaves_the_markov_walk_to_torch():
    """The walk kernel has no GPU measurement showing it wins (its predecessor lost): `auto` must not call it, `on`
    does."""
    draft = random_dspark(tiny_target("qwen3"))
    auto = kernels_dflash.KernelPath(object(), "cuda", "local", strict=False)  # no op would run on object()
    assert auto.runs("context_kv") and not auto.runs("markov_walk")
    assert kernels_dflash.KernelPath(object(), "cuda", "local", strict=True).runs("markov_walk")
    assert kernels_dflash.markov_walk_kernel(auto, draft, None, None, None, None, False, False, None) is None
    assert not auto.failed  # returned before trying the op (trying it on object() would have failed)


def test_on_without_cuda_fails_loudly_in_the_draft(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("DFLASH_KERNELS", "1")
    target = tiny_target("qwen3")
    draft = random_dflash(target)
    with pytest.raises(RuntimeError, match="need a CUDA device"):
        target.generate(torch.tensor([[1, 5, 7]]), assistant_model=draft, max_new_tokens=4, do_sample=False,
                        dflash_policy="fixed")


def test_training_keeps_torch(monkeypatch):
    """With gradients needed the draft keeps torch (the kernels have no backward), whatever DFLASH_KERNELS says."""
    monkeypatch.setenv("DFLASH_KERNELS", "1")
    target = tiny_target("qwen3")
    draft = random_dflash(target)
    draft.bind_target(target)
    hidden = draft(draft.embed(torch.tensor([[3, 95, 95, 95]])), torch.randn(1, 3, 32)).last_hidden_state
    hidden.sum().backward()
    assert draft.fc.weight.grad is not None and draft.__dict__["_kernel_path"] is None


def test_hub_repo_layout(tmp_path):
    """A kernel-builder no-arch project: build.toml names the package, torch-ext/ holds it, and build/ has exactly
    the variants build.toml declares."""
    from kernels import Metadata
    from kernels._rust import Build  # the `kernels` parser of build.toml: rejects unknown fields and editions
    from kernels._rust import Digest, DigestAlgorithm

    repo = write_hub_repo(tmp_path / "repo")
    assert (repo / "README.md").read_text().startswith("---")
    with open(repo / "build.toml", "rb") as file:
        config = tomllib.load(file)
    general = config["general"]
    assert general["name"] == "dflash-kernels" and general["edition"] == 5 and "torch-noarch" in config
    assert general["version"] == kernels_dflash.KERNELS_VERSION
    assert [str(b) for b in Build.open(repo).general.backends] == general["backends"] == ["cpu", "cuda"]
    source_names = {p.name for p in KERNEL_SOURCE.glob("*.py")}
    assert {p.name for p in (repo / "torch-ext" / "dflash_kernels").iterdir()} == source_names
    assert {p.name for p in (repo / "build").iterdir()} == {f"torch-{b}" for b in general["backends"]}
    ids = set()
    for backend in general["backends"]:
        folder = repo / "build" / f"torch-{backend}"
        metadata = json.loads((folder / "metadata.json").read_text())
        parsed = Metadata.read_from_file(folder / "metadata.json")  # what `kernels` will read
        assert metadata["backend"]["type"] == backend and parsed.version == general["version"]
        assert (str(parsed.name), parsed.license) == (general["name"], general["license"])
        ids.add(parsed.id)
        # The integrity record `kernels` checks the variant's files against (and warns about when absent).
        assert parsed.digest.files == Digest.hash_variant(DigestAlgorithm.SHA256, folder).files
        assert {p.name for p in folder.glob("*.py")} == source_names
        assert (folder / "__init__.py").read_bytes() == (KERNEL_SOURCE / "__init__.py").read_bytes()
    assert len(ids) == 2


def test_build_toml_must_match_the_source(tmp_path, monkeypatch):
    """A version bump in build.toml alone would publish a branch whose API_VERSION the loader rejects."""
    bumped = tmp_path / "build.toml"
    bumped.write_text(kernel_hub.BUILD_TOML.read_text().replace("version = 1", "version = 2"))
    monkeypatch.setattr(kernel_hub, "BUILD_TOML", bumped)
    with pytest.raises(RuntimeError, match="API_VERSION"):
        write_hub_repo(tmp_path / "repo")


def imported_modules(path: Path) -> set[tuple[str, int]]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {(alias.name.split(".")[0], 0) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(((node.module or "").split(".")[0], node.level))
    return found


def test_kernel_package_imports_only_stdlib_torch_triton():
    allowed = set(sys.stdlib_module_names) | {"torch", "triton"}
    for path in KERNEL_SOURCE.glob("*.py"):
        for name, level in imported_modules(path):
            assert level > 0 or name in allowed, f"{path.name} imports {name}"


def test_remote_code_file_stays_standalone():
    """transformers' check of a remote-code file sees no import of `kernels` or `dflash_hf` (they sit in try:)."""
    from transformers.dynamic_module_utils import get_imports

    from dflash_hf import DFLASH2_CODE_FILES, REMOTE_CODE_FILES

    package = Path(modeling_dflash.__file__).parent
    for name in REMOTE_CODE_FILES + DFLASH2_CODE_FILES:
        imports = set(get_imports(package / name)) - set(sys.stdlib_module_names)
        assert imports <= {"torch", "transformers"}, (name, imports)


def test_installed_kernels_is_one_transformers_own_integration_accepts():
    """The `kernels` range in pyproject.toml lies inside what transformers' kernel integration takes, so Hub kernels
    that transformers maps itself (`use_kernel_forward_from_hub`, `kernelize`) run beside ours."""
    from transformers.utils import is_kernels_available

    assert is_kernels_available()
