"""`dflash-hf corpus`: the target answers the self-distillation corpus into resumable committed shards."""

import json
import logging
from pathlib import Path

import torch

from .corpus_shards import (
    BASE_PARTS,
    DEFAULT_CORPUS_DIR,
    WRITTEN_PROMPTS,
    Corpus,
    GenerationConfig,
    corpus_stats,
    export_corpus,
    generate_corpus,
    prompt_counts,
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "corpus", help="the target answers the self-distillation corpus, into resumable committed shards")
    parser.add_argument("--out", type=Path, default=DEFAULT_CORPUS_DIR,
                        help=f"corpus folder (default {DEFAULT_CORPUS_DIR})")
    parser.add_argument("--target", default=None, help="Hub id or folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", help="the target's dtype while answering (default float32)")
    parser.add_argument("--device", default="cpu", help="where the target answers (cpu, cuda)")
    parser.add_argument("--worker", type=int, nargs=2, default=(0, 1), metavar=("I", "N"),
                        help="only shards whose index is I modulo N, so N machines or processes share the work")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--max-minutes", type=float, default=None, help="stop starting new shards after this long")
    parser.add_argument("--parts", nargs="+", choices=BASE_PARTS, default=list(BASE_PARTS))
    parser.add_argument("--written-prompts", type=int, default=WRITTEN_PROMPTS,
                        help="how many questions the target writes itself first")
    defaults = GenerationConfig()
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size,
                        help="rows decoded at once; a row that ends is refilled with the next prompt at once")
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--stats", action="store_true", help="print what the shards hold and exit")
    parser.add_argument("--export", type=Path, default=None, metavar="DIR",
                        help="copy the shards into DIR with every prompt's ids stored (mined ones rebuilt here), for "
                             "training on a machine without the pinned packages; never commit the copy")
    parser.add_argument("--count-prompts", action="store_true",
                        help="build the prompts (a few minutes), print how many each source gives and exit")
    parser.set_defaults(func=run)


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.stats:
        stats = corpus_stats(args.out)
        total = {key: sum(entry[key] for entry in stats.values()) for key in ("shards", "answers", "answer_tokens")}
        print(json.dumps({"parts": stats, "total": total}, indent=2))
        return 0
    if args.count_prompts:
        print(json.dumps(prompt_counts(Corpus(args.out)), indent=2))
        return 0
    from ..defaults import load_target

    if args.export:
        _, tokenizer = load_target(args.target, "float32")
        print(f"{export_corpus(args.out, args.export, tokenizer)} shards exported to {args.export / 'shards'}")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)

    target, tokenizer = load_target(args.target, args.dtype, args.device)
    config = GenerationConfig(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
    written = generate_corpus(target, tokenizer, args.out, config, args.max_minutes, args.written_prompts,
                              tuple(args.parts), target_name=args.target or "embedded:smollm2-135m",
                              worker=tuple(args.worker))
    print(f"{written} shards written to {args.out / 'shards'}")
    return 0
