"""Per-step loop overhead of the speculative loops, on a tiny target where the models cost almost nothing.

On a GPU an 8B target's decode is launch-bound, so what a loop does between forwards (bookkeeping, host syncs,
tensor shuffling) decides the ratio as much as the forwards do. Here the target (2 layers, hidden 64) and the draft
are tiny, so a step's time minus its target and draft forwards is the loop itself: a CPU stand-in for that regime.
Every loop runs the same DFlash weights on a target that always says token 0, so every loop accepts whole blocks and
takes the same steps. Ours runs with both length policies.

    python scripts/bench_loop_overhead.py [--prompts 8] [--max-new-tokens 128] [--json out.json]

Needs the z-lab peer for its row: `pip install --no-deps dflash`.
"""

import argparse
import json

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dflash_hf import DFlashConfig, DFlashDraftModel
from dflash_hf.bench import BenchSettings, Sample, build_paths, build_report, machine_info, run_bench

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_pair(vocab_size: int, block_size: int):
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )).eval()
    with torch.no_grad():
        target.lm_head.weight.zero_()  # equal logits: greedy says token 0 everywhere, and so does the draft
    target.generation_config.eos_token_id = None
    draft = DFlashDraftModel(DFlashConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, target_hidden_size=64, num_target_layers=2, target_layer_ids=[0],
        block_size=block_size, mask_token_id=vocab_size - 1,
    )).eval()
    return target, draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = byte_tokenizer()
    target, draft = tiny_pair(len(tokenizer) + 1, args.block_size)
    samples = [Sample(f"p{i}", "chat", [f"prompt number {i}: say something"]) for i in range(args.prompts)]
    settings = BenchSettings(max_new_tokens=args.max_new_tokens, policy="both")
    paths, skipped, extra = build_paths(target, {"dflash": draft}, settings, pad_token_id=0)
    records = run_bench(target, tokenizer, paths, samples, settings, extra, progress=False)
    dataset = {"name": "tiny", "samples": len(samples), "generations": len(records)}
    report = build_report(records, paths, skipped, settings, dataset, {}, machine_info())
    print(f"machine: {report['machine'].get('cpu')}, torch threads {args.threads}; {len(samples)} prompts x "
          f"{args.max_new_tokens} tokens, block {args.block_size}, every block accepted")
    header = f"{'loop':<24} {'steps':>6} {'tau':>5} {'target ms':>10} {'draft ms':>9} {'loop ms':>8} {'loop share':>10}"
    print(header)
    print("-" * len(header))
    rows = {}
    for name, path in report["paths"].items():
        if path["status"] != "ok" or not path["speculative"]:
            continue
        steps = path["verify_steps"]
        times = path["time_s"]
        per_step = {key: 1e3 * times[key] / steps for key in ("verify", "draft", "other")}
        share = times["other"] / max(times["total"] - times["prefill"], 1e-12)
        rows[name] = {"steps": steps, "tau": path["tau"], "ms_per_step": per_step, "loop_share": share}
        print(f"{name:<24} {steps:>6} {path['tau']:>5.2f} {per_step['verify']:>10.2f} {per_step['draft']:>9.2f} "
              f"{per_step['other']:>8.2f} {100 * share:>9.0f}%")
    for name, reason in skipped.items():
        print(f"{name:<24} skipped: {reason}")
    print("loop ms: a step's wall time minus its target and draft forwards (bookkeeping between forwards).")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"machine": report["machine"], "settings": vars(args), "loops": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
