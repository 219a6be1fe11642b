"""Weight averages of drafts (`dflash-hf average`): a "model soup" of drafts that share one shape and vocabulary.

Drafts continued from one draft stay close in weight space, and the average of their weights often accepts more
tokens than any of them (Wortsman et al., 2022, "Model soups"). Generation with an average stays lossless like with
any draft: the target verifies every token.
"""

import copy
import json
import math
import shlex
from pathlib import Path

import torch

from .cards import previous_training, training_history

# Config fields that say where or how a draft was saved, not what it computes.
PROVENANCE_FIELDS = ("_name_or_path", "transformers_version", "dtype", "torch_dtype")


def _computed_fields(draft) -> dict:
    fields = draft.config.to_dict()
    return {key: value for key, value in fields.items() if key not in PROVENANCE_FIELDS}


def _check_same_draft(first, other, index: int) -> None:
    """Raise naming what differs (kind, config field) between draft 0 and draft `index`."""
    if type(other) is not type(first):
        raise ValueError(f"--draft: draft {index} is a {type(other).__name__} and draft 0 a {type(first).__name__}; "
                         "only drafts of one kind can be averaged.")
    mine, theirs = _computed_fields(first), _computed_fields(other)
    for key in sorted(mine.keys() | theirs.keys()):
        if mine.get(key) != theirs.get(key):
            raise ValueError(f"--draft: config field `{key}` is {theirs.get(key)!r} in draft {index} and "
                             f"{mine.get(key)!r} in draft 0; only drafts of one shape can be averaged.")


def average_drafts(drafts: list, weights: list[float] | None = None):
    """A copy of `drafts[0]` holding the weighted average of every draft's floating-point tensors (in float32, stored
    in draft 0's dtype). Integer tensors, the pruned vocabulary's maps, must be equal: an average of heads over
    different ids would propose nonsense. `weights` (default equal) are normalised to sum to 1."""
    if len(drafts) < 2:
        raise ValueError(f"--draft: averaging needs at least two drafts, got {len(drafts)}.")
    weights = [1.0] * len(drafts) if weights is None else [float(w) for w in weights]
    if len(weights) != len(drafts):
        raise ValueError(f"--weight: {len(weights)} weights for {len(drafts)} drafts; give one per draft, or none.")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"--weight: every weight must be a positive number, got {weights}.")
    weights = [w / sum(weights) for w in weights]
    first = drafts[0]
    for index, other in enumerate(drafts[1:], 1):
        _check_same_draft(first, other, index)
    states = [draft.state_dict() for draft in drafts]
    averaged = {}
    for name, tensor in states[0].items():
        if tensor.is_floating_point():
            total = sum(w * state[name].detach().float().cpu() for w, state in zip(weights, states))
            averaged[name] = total.to(tensor.dtype)
            continue
        for index, state in enumerate(states[1:], 1):
            if not torch.equal(state[name].cpu(), tensor.cpu()):
                raise ValueError(f"--draft: tensor `{name}` differs between draft {index} and draft 0 (for `d2t` and "
                                 "`t2d`: they propose different pruned vocabularies); only drafts that share it "
                                 "can be averaged.")
        averaged[name] = tensor
    soup = copy.deepcopy(first)
    soup.load_state_dict(averaged)
    return soup


def ingredient(path: str, weight: float) -> dict:
    """One averaged draft as the summary records it: its weight and, for a local folder, how it was made (its
    training summary, read by `previous_training`, so a later warm start can follow the chain)."""

    made = previous_training(Path(path)) if Path(path).is_dir() else None
    return {"path": path, "weight": weight, "training": made}


def made_line(record: dict) -> str:
    """How one averaged draft was made, in a few words, from its `ingredient` record."""
    made = record.get("training") or {}
    if made.get("averaged"):
        return "itself an average of " + ", ".join(f"`{a['path']}`" for a in made["averaged"])
    if not made.get("steps"):
        return "no training summary"
    batch = (f" of {made['sequences_per_step']} x {made['anchors_per_sequence']}"
             if made.get("sequences_per_step") else "")
    data = f" on {made['train_tokens_assistant']} assistant tokens" if made.get("train_tokens_assistant") else ""
    command = f" (`{made['command']}`)" if made.get("command") else ""
    return f"{made['steps']} steps{batch}{data} on {made.get('hardware') or 'unrecorded hardware'}{command}"


def average_card(summary: dict) -> str:
    """The averaged draft's README: what it averages, with which weights, and how each was made."""

    rows = "".join(f"| `{a['path']}` | {a['weight']:.3f} | {made_line(a)} |\n" for a in summary["averaged"])
    first = summary["averaged"][0].get("training") or {}
    history = training_history(first.get("init_from"))
    earlier = f"\nThe training the first of them continued, newest first:\n{history}" if history else ""
    target = f" for {summary['target']}" if summary.get("target") else ""
    return f"""---
library_name: transformers
tags: [speculative-decoding, {summary['kind']}, dflash-hf]
---
# {summary['kind'].upper()} draft{target}: the weight average of {len(summary['averaged'])} drafts

`dflash-hf average` made this draft from the weights of the drafts below, tensor by tensor in float32 (stored in
{summary['dtype']}). They share one shape and one pruned vocabulary. Drafts continued from one draft stay close in
weight space, and their average often accepts more tokens than any of them ("model soups", Wortsman et al., 2022).
Generation with it is lossless like with any draft: the target verifies every token.

## How it was made
```
{summary['command']}
```
| draft | weight | how it was made |
|---|---|---|
{rows}{earlier}
## Measured
Averaging measures nothing. `dflash-hf train-eval --draft DRAFT --dataset humaneval --dataset mt-bench` gives its
teacher-forced tau beside the drafts it averages, `dflash-hf bench --draft DRAFT` its tau and speed in generation.

## Limits
- Made for the target its drafts were trained for; useless with another one.
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "average", help="average the weights of drafts of one shape and vocabulary (a model soup; still lossless)")
    parser.add_argument("--draft", action="append", required=True,
                        help="a draft: folder or Hub id, any dialect `dflash-hf convert` reads (repeat, two or more)")
    parser.add_argument("--weight", action="append", type=float, default=None,
                        help="its weight (repeat, one per --draft, in order; default: equal weights)")
    parser.add_argument("--out", type=Path, required=True,
                        help="folder for the averaged draft (ours, trust_remote_code)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.set_defaults(func=run_average)


def run_average(args) -> int:
    from ..formats import load_draft
    from ..formats.atomic import atomic_folder

    drafts = [load_draft(path) for path in args.draft]
    soup = average_drafts(drafts, args.weight)
    weights = args.weight or [1.0] * len(drafts)
    flags = [flag for path in args.draft for flag in ("--draft", path)]
    flags += [flag for w in args.weight or () for flag in ("--weight", f"{w:g}")]
    first_summary = Path(args.draft[0]) / "training_summary.json"
    target = json.loads(first_summary.read_text()).get("target") if first_summary.is_file() else None
    summary = {"kind": soup.config.model_type, "target": target,
               "dtype": str(next(soup.parameters()).dtype).removeprefix("torch."),
               "command": shlex.join(["dflash-hf", "average", *flags, "--out", str(args.out)]),
               "averaged": [ingredient(path, w / sum(weights)) for path, w in zip(args.draft, weights)]}
    with atomic_folder(args.out, args.overwrite) as staging:
        soup.save_pretrained(staging)
        (staging / "training_summary.json").write_text(json.dumps(summary, indent=2, default=str))
        (staging / "README.md").write_text(average_card(summary))
    weights = [a["weight"] for a in summary["averaged"]]
    print(json.dumps({"out": str(args.out), "drafts": args.draft, "weights": weights}))
    return 0
