"""What a target forward of 1-8 rows costs with `F.linear` and with `verify_matmul`'s weight-first products.

Run: `python scripts/bench_verify_matmul.py [--rounds 15] [--json out.json]` (the embedded SmolLM2-135M, float32, one
thread, a 200-token cache). Sizes and modes are interleaved round by round; each figure is the median of the rounds.
"""

import argparse
import json
import statistics
import time

import torch

from dflash_hf.bench import machine_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from dflash_hf.defaults import load_target
    from dflash_hf.verify_matmul import verify_matmuls, verifying

    target, _ = load_target(dtype="float32")
    torch.manual_seed(0)
    vocab = target.config.vocab_size
    seconds = {(mode, rows): [] for mode in ("linear", "weight-first") for rows in range(1, 9)}
    with torch.inference_mode(), verify_matmuls(target):
        cache = target(torch.randint(0, vocab, (1, args.context)), use_cache=True).past_key_values
        for _ in range(args.rounds + 1):  # the first round warms every shape up and is dropped
            for mode, rows in seconds:
                ids = torch.randint(0, vocab, (1, rows))
                with verifying(mode == "weight-first"):
                    start = time.perf_counter()
                    target(ids, cache=cache, use_cache=True, logits_to_keep=rows)
                    seconds[mode, rows].append(time.perf_counter() - start)
                cache.crop(-rows)
    table = {mode: {rows: 1e3 * statistics.median(seconds[mode, rows][1:]) for m, rows in seconds if m == mode}
             for mode in ("linear", "weight-first")}
    decode = table["linear"][1]
    print(f"{'rows':>4} {'F.linear ms':>12} {'weight-first ms':>16}   (in decodes: {decode:.1f} ms)")
    for rows in range(1, 9):
        lin, wf = table["linear"][rows], table["weight-first"][rows]
        print(f"{rows:>4} {lin:>8.1f} {lin / decode:>3.1f}x {wf:>11.1f} {wf / decode:>3.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "target": "embedded SmolLM2-135M-Instruct, float32",
                       "context": args.context, "rounds": args.rounds, "ms": table}, f, indent=1)


if __name__ == "__main__":
    main()
