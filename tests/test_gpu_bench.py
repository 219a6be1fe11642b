"""scripts/gpu_bench.sh at SIZE=tiny: the GPU bench's own code path on a toy pair on the CPU (no timed assertions)."""

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]
LOOPS = ["baseline", "dflash_hf_fixed", "dspark_hf_fixed", "dflash_hf", "dspark_hf", "transformers_dflash",
         "zlab_dflash"]
FIXED_LENGTH = ["dflash_hf_fixed", "dspark_hf_fixed", "transformers_dflash", "zlab_dflash"]


def test_tiny_bench_has_every_row_and_every_loop_is_lossless(tmp_path):
    env = {**os.environ, "SIZE": "tiny"}
    env.pop("DFLASH_KERNELS", None)
    result = subprocess.run([str(ROOT / "scripts" / "gpu_bench.sh"), str(tmp_path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_bench_tiny.json").read_text())
    table = (tmp_path / "gpu_bench_tiny.txt").read_text()
    assert report["mismatches"] == [] and "every loop's tokens equal plain generate's in every run" in table
    assert list(report["split"]) == LOOPS
    periods = [str(p) for p in report["settings"]["periods"]]
    for name in LOOPS:
        assert name in table
        assert sorted(report["curve"][name]) == sorted(periods), name
        row = report["split"][name]
        assert row["verify_ms"] > 0 and row["loop_ms"] >= 0 and (row["draft_ms"] > 0) == (name != "baseline")
    # Forcing works: every fixed-length loop emits the forced number of tokens per step (the last step may be cut).
    for name in FIXED_LENGTH:
        for period in periods:
            assert abs(report["curve"][name][period]["tau"] - int(period)) <= 0.25 * int(period), (name, period)
        assert report["split"][name]["tau"] > 0.75 * report["split_at_tau"]
    assert report["split"]["dspark_hf_fixed"]["kernels"] == "torch"  # auto keeps torch on the CPU
    assert "dspark_hf_fixed_walk_kernel" in report["skipped"]  # CUDA only
    assert table in result.stdout
