"""What one draft step costs, per draft and number of proposed slots: the full-vocabulary head against a pruned one.

Run: `python scripts/bench_draft_step.py --draft DIR [--draft DIR ...] [--rounds 30] [--json out.json]` (the embedded
SmolLM2-135M's head and embedding, float32, one thread; each step reads 2 new context states after a 200-token
prefill, as a decode-time step does). Drafts and slot counts are interleaved round by round; each figure is the
median of the rounds, in ms.
"""

import argparse
import json
import statistics
import time

import torch

from dflash_hf.bench import machine_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", action="append", required=True, help="a draft folder (repeat to compare)")
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 3, 7])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from dflash_hf.defaults import load_target
    from dflash_hf.formats import load_draft

    target, _ = load_target(dtype="float32")
    drafts = {}
    for path in args.draft:
        draft = load_draft(path, dtype=torch.float32)
        draft.bind_target(target)
        drafts[path] = draft
    generator = torch.Generator().manual_seed(0)
    caches = {}
    seconds = {(path, slots): [] for path in drafts for slots in args.slots}
    with torch.inference_mode():
        for path, draft in drafts.items():
            caches[path] = draft.new_context_cache()
            states = torch.randn(1, args.context, draft.fc.in_features, generator=generator)
            draft.propose(states, torch.tensor([5]), caches[path])
        for _ in range(args.rounds + 1):  # the first round warms every shape up and is dropped
            for (path, slots), times in seconds.items():
                draft = drafts[path]
                states = torch.randn(1, 2, draft.fc.in_features, generator=generator)
                anchor = torch.randint(0, draft.config.vocab_size, (1,), generator=generator)
                start = time.perf_counter()
                draft.propose(states, anchor, caches[path], max_slots=slots)
                times.append(time.perf_counter() - start)
    report = {
        "machine": machine_info(),
        "context": args.context,
        "rounds": args.rounds,
        "ms": {path: {"draft_vocab_size": drafts[path].config.draft_vocab_size,
                      **{str(slots): round(1e3 * statistics.median(seconds[path, slots][1:]), 2)
                         for slots in args.slots}} for path in drafts},
    }
    print(json.dumps(report["ms"], indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
