"""The model card a trained draft carries (README.md beside its weights): how it was made, from what data, what it
measured, its limits, and the chain of trainings a continued draft carries. Written by `dflash-hf train` and
`dflash-hf average`; read by nothing (a card is for people)."""

import json
from pathlib import Path


def previous_training(path: Path) -> dict:
    """What a warm start continues: the draft's folder and, from its training summary when it has one, its steps,
    batch, data and hardware, and what it was itself continued from (a chain of runs)."""
    summary_file = path / "training_summary.json"
    earlier = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    train = earlier.get("train", {})
    layers = json.loads((path / "config.json").read_text()).get("num_hidden_layers")
    if earlier.get("averaged"):  # `dflash-hf average`: the chain goes on through the first draft it averaged
        return {"path": str(path), "num_layers": layers, "command": earlier.get("command"),
                "averaged": [{"path": a["path"], "weight": a["weight"]} for a in earlier["averaged"]],
                "init_from": earlier["averaged"][0].get("training")}
    return {"path": str(path), "num_layers": layers, "steps": earlier.get("steps_run") or train.get("max_steps"),
            "sequences_per_step": train.get("sequences_per_step"),
            "anchors_per_sequence": train.get("anchors_per_sequence"),
            "train_tokens_assistant": earlier.get("train_tokens_assistant"), "hardware": earlier.get("hardware"),
            "command": earlier.get("command"), "init_from": earlier.get("init_from")}


def training_history(previous: dict | None) -> str:
    """The card's lines on the earlier trainings a warm-started draft carries, newest first: each names the draft
    that run continued and the run that made it."""
    lines = []
    while previous:
        if previous.get("averaged"):
            parts = ", ".join(f"`{a['path']}` ({a['weight']:.2f})" for a in previous["averaged"])
            lines.append(f"- Continued from `{previous['path']}`, the weight average of {parts} "
                         f"(`{previous['command']}`); the lines below follow the first of them.")
            previous = previous.get("init_from")
            continue
        batch = (f" of {previous['sequences_per_step']} x {previous['anchors_per_sequence']}"
                 if previous.get("sequences_per_step") else "")
        data = (f" on {previous['train_tokens_assistant']} assistant tokens"
                if previous.get("train_tokens_assistant") else "")
        origin = "" if previous.get("init_from") else ", from a fresh initialisation"
        lines.append(f"- Continued from `{previous['path']}`, made by {previous.get('steps') or 'unknown'} steps{batch}"
                     f"{data} on {previous.get('hardware') or 'unrecorded hardware'}{origin}"
                     + (f" (`{previous['command']}`)." if previous.get("command") else "."))
        previous = previous.get("init_from")
    return "".join(line + "\n" for line in lines)


def warm_start_gain(previous: dict | None) -> str:
    """The card's line on what the draft it continued reached on the same held-out answers."""
    before = (previous or {}).get("heldout_here")
    if not before:
        return ""
    return (f"- The draft it continued (`{previous['path']}` before this run) reached {before['tau_decode']:.2f} along "
            f"the decode walk and {before['tau_anchors']:.2f} over every anchor on the same held-out answers.\n")


def vocabulary_change(previous: dict | None) -> str:
    """The card's line on a vocabulary chosen again for this run (`--rechoose-vocab`)."""
    before = (previous or {}).get("vocab_here")
    if not before:
        return ""
    return (f"- Its pruned vocabulary was chosen again from every training answer of its data (the shards it read "
            f"and any whose states were not cached): before, {before['draft_vocab_size']} ids covering "
            f"{before['coverage']:.2%} of the tokens this run read (ids kept again kept their Markov rows, new ones "
            "started with none).\n")


def depth_change(previous: dict | None, num_layers: int) -> str:
    """The card's line on layers added for this run (`--num-layers` above the continued draft's)."""
    before = (previous or {}).get("num_layers")
    if not before or before == num_layers:
        return ""
    return (f"- Deepened from {before} to {num_layers} layers for this run: the new layers started as identities "
            "(attention output and MLP down projections at zero), so it began drafting exactly as the draft it "
            "continued.\n")


def heldout_line(heldout: dict, block_size: int) -> str:
    """The card's held-out tau, or why there is none (a corpus slice without held-out answers measures nothing)."""
    if not heldout["blocks"]:
        return "- Held-out tau: not measured (the data this run read holds no held-out answer long enough for a block)."
    return (f"- Held-out tau (greedy, block {block_size}, teacher-forced on the target's own answers): "
            f"{heldout['tau_decode']:.2f}\n  along the greedy decode walk, {heldout['tau_anchors']:.2f} averaged over "
            f"every anchor ({heldout['blocks']} blocks,\n  {heldout['sequences']} sequences).")


def model_card(summary: dict, evaluation: str = "") -> str:
    """The draft's README: how it was made (the exact command), from what data, what it measured, its limits.
    `evaluation` is extra markdown (e.g. tau on evaluation prompts, measured after training)."""
    kind, heldout, data, spec = summary["kind"], summary["heldout"], summary["data"], summary["draft"]
    previous = summary.get("init_from")
    continued = warm_start_gain(previous) + vocabulary_change(previous) + depth_change(previous, spec["num_layers"])
    train, last = summary["train"], summary["final_train_metrics"]
    precision = "bf16 mixed precision" if train.get("mixed_precision") == "bf16" else "fp32"
    # Prompts used (fewer code tasks than asked for when the standard library has fewer docstrings).
    prompts = summary.get("prompts") or {"code": data["num_code_prompts"], "topic": data["num_topic_prompts"]}
    vocab = ("the full target vocabulary" if not summary["draft_vocab_coverage"] else
             f"pruned to {spec['draft_vocab_size']} target ids, covering {summary['draft_vocab_coverage']:.2%} of the "
             "training answers' tokens")
    heads = ""
    if kind == "dspark":
        heads = (f" Markov head ({spec['markov_head_type']}, rank {spec['markov_rank']}), confidence head: "
                 f"{spec['enable_confidence_head']}.")
    if kind == "dflash2":
        heads = (f" Grouped dynamic convolutions ({spec['conv_kernel_size']} taps, groups of "
                 f"{spec['conv_group_size']} channels) around each sublayer; a rank-{spec['selector_rank']} selector "
                 f"walks each slot's top {spec['selector_top_k']} candidates (selector loss weight "
                 f"{train.get('selector_weight', 1.0)}).")
    data_line = f"""- Data, all made offline by the target itself: {prompts['code']} code tasks built from Python
  standard-library docstrings (functions and class methods, asked for from a description or as a stub to complete)
  and {prompts['topic']} questions the target wrote from seed topics, answered by the target
  ({summary.get('target_dtype', 'float32')}) with its chat template (greedy, up to {data['max_new_tokens']} new
  tokens). No MT-Bench or HumanEval prompt was used."""
    if summary.get("corpus"):
        data_line = f"""- Data: the self-distilled corpus `{summary['corpus']}` (`dflash-hf corpus`; its README says what
  went in): {prompts['code']} answers to prompts mined from installed Python packages' docstrings, code and comments
  and {prompts['topic']} to topic and task templates, the target's own questions and follow-ups, rewrites and
  summaries of earlier answers, all answered by the target with its chat template (mostly greedy, some sampled). No
  MT-Bench or HumanEval prompt was used (a test checks for overlap). The target states it learned from were computed
  in {summary.get('target_dtype', 'float32')}."""
        weights = train.get("part_weights")
        if weights:
            listed = ", ".join(f"{part} {n} times" for part, n in sorted(weights.items()))
            data_line += f"""
- Sampling leaned on some parts (`--part-weight`): per epoch each training answer of {listed}, every
  other answer once."""
        if summary.get("parts"):
            shares = ", ".join(f"{name} {part['epoch_share']:.0%}" for name, part in summary["parts"].items())
            data_line += f"""
- Answer tokens one epoch read, by corpus part: {shares}."""
        shards = summary.get("corpus_shards") or {}
        if shards and shards["used"] < shards["total"]:
            data_line += f"""
- Trained on {shards['used']} of the corpus's {shards['total']} shards: those whose target states were cached within
  the run's `--feature-minutes`."""
    budget = (f"{summary['train_sequences']} answers of the corpus" if summary.get("corpus") else
              f"minutes, a few thousand answers of at most {data['max_new_tokens']} tokens")
    return f"""---
library_name: transformers
tags: [speculative-decoding, {kind}, dflash-hf]
---
# {kind.upper()} draft for {summary['target']}

A {spec['num_layers']}-layer {kind} block drafter (block {spec['block_size']}) trained by `dflash-hf train`. It reads
the target's layers {summary.get('layer_ids')} and borrows its embedding and lm_head (not stored here); it proposes
from {vocab}.{heads}

## How it was made
```
{summary['command'] or '(Python API)'}
```
{data_line}
- {summary['train_sequences']} training sequences ({summary['train_tokens_assistant']} assistant tokens),
  {summary['heldout_sequences']} held out.
- {summary.get('steps_run') or train['max_steps']} steps of {train['sequences_per_step']} sequences x \
{train['anchors_per_sequence']} anchors, AdamW (lr {train['learning_rate']}, cosine schedule), {precision} on
  {summary.get('hardware', 'one CPU thread')}: {summary['minutes']} minutes for this command (data and features are
  cached in the work directory and reused by later runs).
{training_history(summary.get('init_from'))}
## Measured
- Final training loss {last.get('loss', float('nan')):.3f}.
{heldout_line(heldout, spec['block_size'])}
{continued}{evaluation}
## Limits
- Made for this exact target; useless with another one.
- A small training budget ({budget}): acceptance is far below what drafts trained on
  hundreds of thousands of answers reach.
"""
