"""`dflash-hf bench`: the command line, and loading the target and drafts it names."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..defaults import DTYPE_HELP, SHIPPED_DRAFTS
from ..verify_matmul import VERIFY_MATMULS
from .datasets import BUILTIN_DATASETS, DatasetUnavailableError, load_samples, select_samples
from .paths import (DEFAULT_PROMPT_LOOKUP_TOKENS, POLICIES, WARMUP_NEW_TOKENS, BenchSettings, build_paths,
                    keep_paths)
from .report import _load_average, build_report, format_table, machine_info, plot_report
from .runner import BenchMismatchError, run_bench

# The kinds with an embedded draft (`defaults.SHIPPED_DRAFTS`); `--kind both` is the first two, `all` every one.
EMBEDDED_KINDS = tuple(SHIPPED_DRAFTS)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="acceptance, tokens/s and speed-up against plain generate and peers")
    parser.add_argument("--dataset", required=True, help="mt-bench, humaneval, or a JSONL file (prompt|turns, category)")
    parser.add_argument("--target", default=None, help="target model id or folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--draft", action="append", default=None,
                        help="draft id or folder; repeat for a DFlash, a DSpark and a DFlash 2 draft (default: the "
                             "embedded ones)")
    parser.add_argument("--kind", choices=(*EMBEDDED_KINDS, "both", "all"), default="both",
                        help="which embedded drafts to bench when --draft is not given (both: dflash and dspark; all: "
                             "dflash2 too)")
    parser.add_argument("--max-samples", type=int, default=None)
    parser.add_argument("--skip-samples", type=int, default=0, metavar="N",
                        help="leave out the first N prompts of the same order, to split a long run into parts "
                             "(--skip-samples 40 --max-samples 40 runs what follows --max-samples 40)")
    parser.add_argument("--block-size", type=int, default=None, help="override the drafts' block size")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (exactness is then enforced)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt-lookup-tokens", type=int, default=None,
                        help=f"prompt-lookup candidates per step (default {DEFAULT_PROMPT_LOOKUP_TOKENS})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", choices=POLICIES, default="auto",
                        help="our paths' speculation length: auto (by measured cost), fixed (full blocks), or both")
    parser.add_argument("--confidence-threshold", type=float, default=None, metavar="P",
                        help="DSpark's confidence cut for our DSpark paths under the fixed policy: drafting stops before "
                             "the first slot whose predicted survival is below P (default: the draft's own, 0.1 for "
                             "the shipped one; 0 drafts full blocks, to measure the draft's acceptance alone)")
    parser.add_argument("--verify-matmul", choices=VERIFY_MATMULS, default="auto",
                        help="our paths' verify forwards on a CPU in float32: auto (2-5 rows weight-first) or linear "
                             "(F.linear for every verify)")
    parser.add_argument("--paths", nargs="+", default=None, metavar="NAME",
                        help="run only these paths beside the baseline (e.g. dspark_hf dflash2_hf; names as in the "
                             "table)")
    parser.add_argument("--batch-size", type=int, nargs="+", default=None, metavar="B",
                        help="batches of B prompts per generate call (one or more sizes): total tokens/s of ours "
                             "against plain batched generate, and per-row tau (first turns only)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    parser.add_argument("--warmup-tokens", type=int, default=WARMUP_NEW_TOKENS)
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every path this many times per prompt (interleaved) and keep its fastest run: "
                             "per-prompt ratios with less noise (not with --batch-size)")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--plot", default=None, help="write the PNG here")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run)


def _draft_kind(draft) -> str:
    return {"DSparkDraftModel": "dspark", "DFlash2DraftModel": "dflash2"}.get(type(draft).__name__, "dflash")


def load_models(target_id: str | None, draft_ids: list[str] | None, kind: str, dtype: str = "auto"):
    """(target, tokenizer, {kind: draft}, models note for the JSON)."""
    from ..defaults import SMOLLM2_GGUF, load_default_draft, load_target

    target, tokenizer = load_target(target_id, dtype)
    name = f"embedded SmolLM2-135M-Instruct ({SMOLLM2_GGUF})" if target_id is None else target_id
    models = {"target": name, "target_dtype": str(target.dtype).removeprefix("torch."),
              "target_attention": target.config._attn_implementation, "drafts": {}}
    drafts = {}
    if draft_ids:
        for draft_id in draft_ids:
            draft = _load_draft(draft_id)
            found = _draft_kind(draft)
            if found in drafts:
                raise ValueError(f"Two {found} drafts given (--draft); give at most one draft of each kind (DFlash, "
                                 "DSpark, DFlash 2).")
            drafts[found] = draft
            models["drafts"][found] = {"source": draft_id, "trained": None}
    else:
        for name in {"both": EMBEDDED_KINDS[:2], "all": EMBEDDED_KINDS}.get(kind, (kind,)):
            draft, trained = load_default_draft(target, name)
            drafts[name] = draft
            models["drafts"][name] = {"source": "embedded" if trained else "random (no trained draft shipped)",
                                      "trained": trained}
    return target, tokenizer, drafts, models


def _load_draft(draft_id: str):
    try:
        from ..formats import load_draft
    except ModuleNotFoundError as error:
        if error.name != f"{__package__.rpartition('.')[0]}.formats":
            raise
        from transformers import AutoModel

        return AutoModel.from_pretrained(draft_id).eval()
    return load_draft(draft_id).eval()


def run(args) -> int:
    import sys

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        all_samples, source = load_samples(args.dataset)
    except DatasetUnavailableError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.max_samples is not None and args.max_samples < 1:
        print(f"error: --max-samples {args.max_samples}: expected a positive count", file=sys.stderr)
        return 2
    if not 0 <= args.skip_samples < len(all_samples):
        print(f"error: --skip-samples {args.skip_samples}: expected a count from 0 to {len(all_samples) - 1} "
              f"(the prompts of {args.dataset})", file=sys.stderr)
        return 2
    samples = select_samples(all_samples, args.max_samples, args.skip_samples)
    if args.repeats < 1 or (args.repeats > 1 and args.batch_size):
        print(f"error: --repeats {args.repeats}: expected a positive count, and 1 with --batch-size", file=sys.stderr)
        return 2
    if args.confidence_threshold is not None and not 0.0 <= args.confidence_threshold <= 1.0:
        print(f"error: --confidence-threshold {args.confidence_threshold}: expected a probability in [0, 1]",
              file=sys.stderr)
        return 2
    try:
        target, tokenizer, drafts, models = load_models(args.target, args.draft, args.kind, args.dtype)
    except ValueError as error:  # no such draft, or a checkpoint that does not load: one line, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.block_size is not None:
        for draft in drafts.values():
            draft.config.block_size = args.block_size
    for kind, draft in drafts.items():
        models["drafts"][kind]["block_size"] = draft.config.block_size
        models["drafts"][kind]["loaded_dtype"] = str(draft.dtype).removeprefix("torch.")
        if draft.dtype != target.dtype:
            # Every path must run the same weights in the same arithmetic; transformers' built-in path and z-lab's feed
            # the target's embeddings straight into the draft, so a bf16 draft beside an fp32 target cannot run there.
            draft.to(target.dtype)
        models["drafts"][kind]["dtype"] = str(draft.dtype).removeprefix("torch.")
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
        prompt_lookup_num_tokens=args.prompt_lookup_tokens or DEFAULT_PROMPT_LOOKUP_TOKENS,
        warmup_new_tokens=args.warmup_tokens, policy=args.policy, verify_matmul=args.verify_matmul,
        repeats=args.repeats, confidence_threshold=args.confidence_threshold,
    )
    if args.batch_size:
        return _run_batched(args, target, tokenizer, drafts, samples, settings, models)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    paths, skipped, extra = build_paths(target, drafts, settings, pad_token_id=pad)
    try:
        paths, skipped = keep_paths(paths, skipped, args.paths)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for kind, note in models["drafts"].items():
        if note["trained"] is False:
            print(f"note: the {kind} draft is RANDOMLY INITIALISED (no trained draft shipped): expect tau ~ 1.")
    for name, reason in skipped.items():
        print(f"note: skipping {name}: {reason}")
    machine = machine_info()
    try:
        records = run_bench(target, tokenizer, paths, samples, settings, extra, progress=not args.no_progress)
    except BenchMismatchError as error:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    dataset = {"name": Path(args.dataset).name if args.dataset not in BUILTIN_DATASETS else args.dataset,
               "source": source, "samples": len(samples), "available": len(all_samples),
               "turns": sum(len(s.turns) for s in samples), "generations": len(records),
               "skipped": args.skip_samples, "selection": "round-robin over categories, first items first"}
    machine["load_average_1m_end"] = _load_average()
    report = build_report(records, paths, skipped, settings, dataset, models, machine)
    print(format_table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        print(f"report: {args.json}")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_report(report, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _run_batched(args, target, tokenizer, drafts, samples, settings, models) -> int:
    import sys

    from .batched import format_batched_table, run_batched_bench

    if any(size < 1 for size in args.batch_size):
        print(f"error: --batch-size takes positive sizes, got {args.batch_size}", file=sys.stderr)
        return 2
    machine = machine_info()
    try:
        results = run_batched_bench(target, tokenizer, drafts, samples, settings, args.batch_size,
                                    progress=not args.no_progress)
    except BenchMismatchError as error:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    machine["load_average_1m_end"] = _load_average()
    print(format_batched_table(results))
    if args.json:
        report = {"kind": "batched", "dataset": args.dataset, "samples": len(samples), "models": models,
                  "settings": vars(settings), "machine": machine,
                  "results": {str(size): per_path for size, per_path in results.items()}}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        print(f"report: {args.json}")
    return 0
