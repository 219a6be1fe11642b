"""Peak extra memory of capturing a draft's target layers during one prefill forward (a benchmark, not a test).

Modes, each in a fresh process on the same random Llama target and prompt:
  none     plain forward (the baseline)
  hooks    `TargetStateCapture(mode="hooks")`: forward hooks keep only the chosen layers' outputs
  outputs  `TargetStateCapture(mode="outputs")`: transformers' selective `output_hidden_states=[t + 1, ...]`
  all      `output_hidden_states=True`: every layer's state, as a draft without selection would need

Reported per mode: `peak_rss_mib`, the high-water mark of resident memory during the forward above the resident
memory just before it (Linux VmHWM, reset through /proc/self/clear_refs); `retained_mib`, resident memory still
held right after the forward (outputs and captured states alive); `hidden_states_returned_mib`, the bytes of the
states the target's output carries. `extra_peak_mib` is the peak minus the baseline's. glibc's mmap threshold is
pinned so that large tensors go straight back to the OS when freed and RSS follows the live tensors.

    python scripts/bench_capture_memory.py                      # 24 layers, hidden 1024, 2048-token prompt
    python scripts/bench_capture_memory.py --layers 8 --hidden 256 --tokens 512 --json out.json
"""

import argparse
import gc
import json
import os
import subprocess
import sys

MODES = ("none", "hooks", "outputs", "all")


def status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (None entries skipped)."""
    storages = {}
    for tensor in tensors:
        if tensor is not None:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def chosen_layers(num_layers: int, count: int) -> list[int]:
    """Evenly spread layer ids, as DFlash checkpoints pick them (first near the bottom, last below the top)."""
    return [round(1 + i * (num_layers - 3) / (count - 1)) for i in range(count)]


def run_one(args) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_hf.generation_dflash import TargetStateCapture

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=args.tokens + 16,
                         attn_implementation="sdpa")
    target = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, args.vocab, (1, args.tokens))
    layer_ids = chosen_layers(args.layers, args.num_chosen)
    with torch.no_grad():
        target(ids[:, :16], use_cache=False)  # warm-up: lazy initialisation outside the measured window

    capture, kwargs = None, {}
    if args.mode in ("hooks", "outputs"):
        capture = TargetStateCapture(target, layer_ids, mode=args.mode)
        kwargs = capture.model_kwargs_overrides
    elif args.mode == "all":
        kwargs = {"output_hidden_states": True}

    gc.collect()
    reset_peak_rss()
    before = status_kib("VmRSS")
    with torch.no_grad():
        outputs = target(ids, use_cache=False, logits_to_keep=1, **kwargs)
    peak = status_kib("VmHWM") - before
    held = status_kib("VmRSS") - before  # outputs (and the capture's states) still alive
    states = None
    if capture is not None:
        states = capture.states(outputs, args.tokens, torch.device("cpu"))
        capture.close()
    elif args.mode == "all":
        states = torch.cat([outputs.hidden_states[t + 1] for t in layer_ids], dim=-1)
    return {"mode": args.mode, "peak_rss_mib": peak / 1024, "retained_mib": held / 1024,
            "hidden_states_returned_mib": tensor_bytes(outputs.hidden_states or ()) / 2**20,
            "context_shape": list(states.shape) if states is not None else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--num-chosen", type=int, default=5, help="layers the draft reads (DFlash uses 5)")
    parser.add_argument("--mode", choices=MODES, help="run one mode in this process (used by the driver)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    if args.mode is not None:
        print(json.dumps(run_one(args)))
        return

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 17)}
    results = []
    for mode in MODES:
        command = [sys.executable, __file__, "--mode", mode, "--layers", str(args.layers), "--hidden",
                   str(args.hidden), "--tokens", str(args.tokens), "--vocab", str(args.vocab),
                   "--num-chosen", str(args.num_chosen)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    baseline = results[0]["peak_rss_mib"]
    one_state_mib = args.tokens * args.hidden * 4 / 2**20
    for result in results:
        result["extra_peak_mib"] = result["peak_rss_mib"] - baseline
    report = {"layers": args.layers, "hidden": args.hidden, "tokens": args.tokens, "dtype": "float32",
              "layer_ids": chosen_layers(args.layers, args.num_chosen), "one_hidden_state_mib": one_state_mib,
              "results": results}
    print(f"Llama {args.layers} layers, hidden {args.hidden}, {args.tokens}-token prompt, float32; one hidden "
          f"state = {one_state_mib:.1f} MiB")
    print(f"{'mode':8} {'peak MiB':>9} {'extra MiB':>10} {'retained MiB':>13} {'in output MiB':>14}")
    for result in results:
        print(f"{result['mode']:8} {result['peak_rss_mib']:9.1f} {result['extra_peak_mib']:10.1f} "
              f"{result['retained_mib']:13.1f} {result['hidden_states_returned_mib']:14.1f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
