"""`dflash-hf generate`: one speculative generation on a target/draft pair, checked against the target alone."""

import copy
import time

import torch

from .defaults import DTYPE_HELP, SHIPPED_DRAFTS
from .generation_dflash import LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM
from .verify_matmul import VERIFY_MATMULS

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number."
ROUNDS = 2


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="speculative generation, checked token for token")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--target", default=None, help="target model id or folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--draft", default=None, help="draft id or folder (default: the embedded draft)")
    parser.add_argument("--kind", choices=tuple(SHIPPED_DRAFTS), default="dspark",
                        help="embedded draft to use when --draft is not given")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=None, help="override the draft's block size")
    parser.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    parser.add_argument("--policy", choices=("auto", "fixed"), default="auto",
                        help="speculation length: auto (each step weighs acceptance against measured cost) or fixed "
                             "(full blocks)")
    parser.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                        help=f"also try N looked-up tokens where the last {LOOKUP_MIN_NGRAM}-{LOOKUP_MAX_NGRAM} tokens "
                             "occurred before (0: off)")
    parser.add_argument("--verify-matmul", choices=VERIFY_MATMULS, default="auto",
                        help="auto: on a CPU in float32, verify forwards of 2-5 rows multiply weight-first (about a "
                             "decode's cost instead of up to 1.9); linear: F.linear as plain generate")
    parser.set_defaults(func=run)


def load_pair(target_id, draft_id, kind, dtype="auto"):
    """(target, tokenizer, draft, draft_note) for the CLI: the embedded defaults unless ids are given."""
    from .defaults import load_default_draft, load_target

    target, tokenizer = load_target(target_id, dtype)
    if draft_id is not None:
        from .formats import load_draft

        return target, tokenizer, load_draft(draft_id, dtype=target.dtype).eval(), f"draft {draft_id}"
    draft, trained = load_default_draft(target, kind)
    note = f"embedded trained {kind} draft" if trained else (
        f"RANDOMLY INITIALISED {kind} draft (no trained draft shipped yet): expect tau ~ 1 and no speed-up"
    )
    return target, tokenizer, draft, note


def run(args) -> int:
    target, tokenizer, draft, note = load_pair(args.target, args.draft, args.kind, args.dtype)
    messages = [{"role": "user", "content": args.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    plain_config = copy.deepcopy(target.generation_config)  # the target's defaults (EOS, ...), greedy, this length
    plain_config.update(max_new_tokens=args.max_new_tokens, do_sample=False)
    config = copy.deepcopy(plain_config)  # plus ours for the speculative call
    config.update(allow_custom_entries=True, dflash_policy=args.policy, dflash_block_size=args.block_size,
                  dflash_verify_matmul=args.verify_matmul, prompt_lookup_num_tokens=args.prompt_lookup or None)
    warm_up = copy.deepcopy(config)
    warm_up.max_new_tokens = 4
    target.generate(**inputs, assistant_model=draft, generation_config=warm_up)  # not timed

    def timed(**extra):
        start = time.perf_counter()
        return target.generate(**inputs, **extra), time.perf_counter() - start

    speculative = dict(assistant_model=draft, generation_config=config)
    # Interleaved, best of ROUNDS each: a shared machine's noise only ever adds time.
    runs = [(timed(generation_config=plain_config), timed(**speculative)) for _ in range(ROUNDS)]
    plain, plain_s = runs[0][0][0], min(r[0][1] for r in runs)
    spec, spec_s = runs[0][1][0], min(r[1][1] for r in runs)
    prompt_len = inputs["input_ids"].shape[1]
    text = tokenizer.decode(spec[0, prompt_len:], skip_special_tokens=True)
    stats = draft.generation_stats
    identical = torch.equal(plain, spec)
    new_tokens = spec.shape[1] - prompt_len
    print(f"draft: {note}; target in {str(target.dtype).removeprefix('torch.')} "
          f"({target.config._attn_implementation} attention)")
    print(f"prompt: {args.prompt}\n--- speculative output ---\n{text}\n---")
    print(f"identical to the target's own greedy output: {identical}")
    lookups = f"  (prompt lookup on {sum(stats['looked_up'])} of {len(stats['acceptance_lengths'])} steps)"
    print(f"tokens: {new_tokens}  tau (mean tokens per target forward): {stats['mean_acceptance_length']:.2f}"
          + (lookups if args.prompt_lookup else ""))
    chosen = [step["k"] for step in stats["policy"]]
    print(f"{args.policy} policy, tokens proposed per step: {' '.join(map(str, chosen))} "
          f"({chosen.count(0)} of {len(chosen)} steps plain decoding)")
    print(f"target alone: {new_tokens / plain_s:.1f} tok/s   speculative: {new_tokens / spec_s:.1f} tok/s   "
          f"speed-up: {plain_s / spec_s:.2f}x")
    return 0 if identical else 1
