"""dflash-hf without `triton` and `kernels` (they install on Linux only, or not at all): see `without_triton.py`."""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_every_draft_kind_generates_exactly_without_triton_or_kernels():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)
    env.pop("DFLASH_KERNELS", None)
    run = subprocess.run([sys.executable, str(HERE / "without_triton.py")], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[-1] == "ok"
    assert run.stdout.count("exact at B = 1 and 2") == 6
