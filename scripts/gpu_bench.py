"""Every speculative loop end to end on an 8B-shaped target: per-step cost split, and speed-up against forced tau.

Builds, with random weights and no downloads, a Qwen3-8B-shaped target (36 layers, hidden 4096, vocabulary 151936) and
a draft shaped like z-lab's Qwen3-8B-DFlash-b16 (5 layers, block 16), plus a DSpark twin (Markov rank 256, confidence
head), then runs plain generate, ours (DFlash, DSpark; fixed and auto length policies; on CUDA also DSpark with the
Triton walk forced on), transformers' built-in DFlash and z-lab's `dflash_generate` (the `dflash_hf.bench` paths):

- split: per verify step, the target's forward, the draft (its forwards, the target lm_head it calls, our `propose`
  with its walk) and the loop's own overhead (the rest of the wall time), with a device sync around each, at tau 16;
- curve: tokens/s at forced acceptance lengths (no syncs), as a speed-up over plain generate at the same tau.

Forcing tau: the target's lm_head is zeroed, so every draft, which reads its logits through that head, proposes token
0; a hook on the target's forward then writes its logits: token 1 at every P-th position, 0 elsewhere. Every loop
accepts P - 1 proposals a step and emits P tokens, whatever its code, while every forward costs what it always costs.
Every loop's tokens must equal plain generate's in every run (at the tiny size also in a run on the random heads).

    python scripts/gpu_bench.py [--size full|tiny] [--out DIR]      (scripts/gpu_bench.sh on a lent GPU)

`--size tiny` is the same run on a 2-layer toy pair in float32 on the CPU, in seconds: the suite's check of this script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash_hf import DFlashConfig, DFlashDraftModel, DSparkConfig, DSparkDraftModel
from dflash_hf.bench import BASELINE, OURS, TRANSFORMERS_DFLASH, ZLAB, BenchSettings, build_paths

FIXED = "_fixed"
WALK_KERNEL = "dspark_hf_fixed_walk_kernel"


@dataclass
class Size:
    """A run's models and lengths. The prompt length is a multiple of every period, so each run starts aligned with
    its forced pattern (the token after the prompt is a 1) and every step emits exactly `period` tokens."""

    target: dict
    draft: dict
    markov_rank: int
    device: str
    dtype: str
    prompt_tokens: int
    new_tokens: int
    periods: tuple[int, ...]
    natural_tokens: int
    repeats: int  # runs per curve point, interleaved over the loops; the fastest counts


SIZES = {
    # Qwen3-8B's config; the draft as z-lab's Qwen3-8B-DFlash-b16 (5 layers reading target layers 1, 9, 17, 25, 33).
    "full": Size(
        target=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                    rope_theta=1_000_000.0, rms_norm_eps=1e-6),
        draft=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=5, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, target_layer_ids=[1, 9, 17, 25, 33], block_size=16,
                   mask_token_id=151669),
        markov_rank=256, device="cuda", dtype="bfloat16", prompt_tokens=64, new_tokens=128,
        periods=(1, 2, 4, 8, 16), natural_tokens=0, repeats=2,
    ),
    "tiny": Size(
        target=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rope_theta=10_000.0),
        draft=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, target_layer_ids=[0, 2], block_size=8, mask_token_id=511),
        markov_rank=8, device="cpu", dtype="float32", prompt_tokens=16, new_tokens=24, periods=(1, 2, 4, 8),
        natural_tokens=16, repeats=1,
    ),
}


def build_models(size: Size, device: torch.device, dtype: torch.dtype):
    """(target, {kind: draft}): random weights, made on the device in the run's dtype (an 8B init on a CPU is slow)."""
    torch.manual_seed(0)
    config = Qwen3Config(**size.target, tie_word_embeddings=False)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        target.generation_config.eos_token_id = None  # run to max_new_tokens: forced tokens 0 and 1 must not stop it
        target.generation_config.pad_token_id = 2
        fields = dict(size.draft, vocab_size=config.vocab_size, target_hidden_size=config.hidden_size,
                      num_target_layers=config.num_hidden_layers, rope_theta=size.target["rope_theta"],
                      rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings)
        drafts = {"dflash": DFlashDraftModel(DFlashConfig(**fields)),
                  "dspark": DSparkDraftModel(DSparkConfig(markov_rank=size.markov_rank, enable_confidence_head=True,
                                                          **fields))}
    for draft in drafts.values():
        with torch.no_grad():  # wider than the init's 0.02, so a natural run's proposals vary
            for name, param in draft.named_parameters():
                param.normal_(1.0, 0.1) if "norm" in name else param.normal_(0.0, 0.05)
        draft.to(dtype).eval()
    return target, drafts


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _row_positions(args, kwargs, rows: int, start: int) -> torch.Tensor:
    """Absolute positions of the last `rows` inputs of a target forward (the rows its logits hold)."""
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        return position_ids.reshape(-1)[-rows:]
    inputs = kwargs.get("input_ids", args[0] if args else None)
    if inputs is None:
        inputs = kwargs["inputs_embeds"]
    end = start + inputs.shape[1]
    return torch.arange(end - rows, end, device=inputs.device)


def _cache_length(kwargs) -> int:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0


@contextlib.contextmanager
def forced_acceptance(target, drafts: dict, period: int):
    """Every loop accepts `period - 1` proposals a step (tau = period): see the module docstring.

    The zeroed weights (target lm_head, DSpark's Markov W2 and confidence weight) and the confidence bias (+30: the
    survival never cuts a block) are restored on exit.
    """
    head = target.get_output_embeddings().weight
    changed = [(head, 0.0)]
    for draft in drafts.values():
        if draft.markov_head is not None:
            changed.append((draft.markov_head.markov_w2.weight, 0.0))
        if draft.confidence_head is not None:
            changed += [(draft.confidence_head.proj.weight, 0.0), (draft.confidence_head.proj.bias, 30.0)]
    saved = [tensor.detach().clone() for tensor, _ in changed]
    starts = []

    def pre(module, args, kwargs):
        starts.append(_cache_length(kwargs))

    def post(module, args, kwargs, output):
        logits = output.logits
        predicted = _row_positions(args, kwargs, logits.shape[1], starts.pop()) + 1
        logits.zero_()
        logits[..., 1] = (predicted % period == 0).to(logits.dtype)

    with torch.no_grad():
        for tensor, value in changed:
            tensor.fill_(value)
    handles = [target.register_forward_pre_hook(pre, with_kwargs=True),
               target.register_forward_hook(post, with_kwargs=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for (tensor, _), value in zip(changed, saved):
                tensor.copy_(value)


class StepTimer:
    """Synced wall time of the target's forwards (prefill, then verify/decode) and of the draft's work in one call.

    Draft work: a draft module's forward, the target's lm_head called outside the target's forward (transformers' and
    z-lab's loops take the draft logits there), and our drafts' `propose` (which holds our walk); nested regions count
    once.
    """

    def __init__(self, target, drafts: list, device: torch.device):
        self.target, self.device = target, device
        self.handles, self.wrapped = [], []
        self.target_depth = self.draft_depth = 0
        self.reset()
        self.handles += [target.register_forward_pre_hook(self._target_pre),
                         target.register_forward_hook(self._target_post, always_call=True)]
        head = target.get_output_embeddings()
        self.handles += [head.register_forward_pre_hook(self._head_pre),
                         head.register_forward_hook(self._head_post, always_call=True)]
        for draft in drafts:
            self.handles += [draft.register_forward_pre_hook(self._draft_pre),
                             draft.register_forward_hook(self._draft_post, always_call=True)]
            if hasattr(draft, "propose"):
                self.wrapped.append(draft)
                draft.propose = self._timed(draft.propose)

    def reset(self) -> None:
        self.target_s, self.draft_s = [], 0.0

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        for draft in self.wrapped:
            del draft.propose

    def _now(self) -> float:
        sync(self.device)
        return time.perf_counter()

    def _target_pre(self, module, args):
        self.target_depth += 1
        if self.target_depth == 1:
            self.target_t0 = self._now()

    def _target_post(self, module, args, output):
        self.target_depth -= 1
        if self.target_depth == 0:
            self.target_s.append(self._now() - self.target_t0)

    def _draft_pre(self, *_):
        self.draft_depth += 1
        if self.draft_depth == 1:
            self.draft_t0 = self._now()

    def _draft_post(self, *_):
        self.draft_depth -= 1
        if self.draft_depth == 0:
            self.draft_s += self._now() - self.draft_t0

    def _head_pre(self, module, args):
        if self.target_depth == 0:
            self._draft_pre()

    def _head_post(self, module, args, output):
        if self.target_depth == 0:
            self._draft_post()

    def _timed(self, fn):
        def timed(*args, **kwargs):
            self._draft_pre()
            try:
                return fn(*args, **kwargs)
            finally:
                self._draft_post()
        return timed


def bench_paths(target, drafts: dict, device: torch.device, new_tokens: int) -> tuple[dict, dict, list]:
    """({name: generate(ids, mask, n)}, {name: why skipped}, extra draft modules): `dflash_hf.bench`'s paths without
    prompt lookup, both length policies of ours, and on CUDA ours with the DSpark Triton walk forced on."""
    settings = BenchSettings(max_new_tokens=new_tokens, policy="both")
    paths, skipped, extra = build_paths(target, drafts, settings, pad_token_id=target.generation_config.pad_token_id)
    keep = {BASELINE, TRANSFORMERS_DFLASH, ZLAB, *OURS.values(), *(name + FIXED for name in OURS.values())}
    generate = {path.name: path.generate for path in paths if path.name in keep}
    generate = {name: generate[name] for name in sorted(generate, key=_row_order)}
    skipped = {name: reason for name, reason in skipped.items() if name in keep}
    if device.type == "cuda":
        generate[WALK_KERNEL] = _with_kernels_on(generate[OURS["dspark"] + FIXED])
    else:
        skipped[WALK_KERNEL] = "the Triton walk runs on CUDA (on the CPU only under TRITON_INTERPRET=1)"
    return generate, skipped, extra


def _row_order(name: str) -> int:
    order = [BASELINE, "dflash_hf_fixed", "dspark_hf_fixed", "dflash_hf", "dspark_hf", TRANSFORMERS_DFLASH, ZLAB]
    return order.index(name) if name in order else len(order)


def _with_kernels_on(generate):
    def run(*args):
        previous = os.environ.get("DFLASH_KERNELS")
        os.environ["DFLASH_KERNELS"] = "1"
        try:
            return generate(*args)
        finally:
            if previous is None:
                os.environ.pop("DFLASH_KERNELS")
            else:
                os.environ["DFLASH_KERNELS"] = previous
    return run


def timed_generate(generate, ids, device, new_tokens: int) -> tuple[torch.Tensor, float]:
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = generate(ids, torch.ones_like(ids), new_tokens)
    sync(device)
    return out, time.perf_counter() - start


class ForwardCounter:
    """Target forwards of one call, without syncs (for the measured tau of an unsynced run)."""

    def __init__(self, target):
        self.count = 0
        self.handle = target.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.count += 1


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """None when equal, else the index of the first differing token (or the shorter length)."""
    if a.shape == b.shape and torch.equal(a, b):
        return None
    n = min(a.shape[-1], b.shape[-1])
    unequal = (a[0, :n] != b[0, :n]).nonzero()
    return int(unequal[0]) if len(unequal) else n


def measure_split(target, drafts: dict, extra: list, generate: dict, ids, device, size: Size, check) -> dict:
    """Per loop, at full acceptance: ms per verify step in the target's forward, the draft and the loop itself."""
    block = size.draft["block_size"]
    split, outputs = {}, {}
    timer = StepTimer(target, list(drafts.values()) + list(extra), device)
    try:
        with forced_acceptance(target, drafts, block):
            for name, fn in generate.items():
                timer.reset()
                outputs[name], wall = timed_generate(fn, ids, device, size.new_tokens)
                steps = max(len(timer.target_s) - 1, 1)
                prefill, verify = timer.target_s[0], sum(timer.target_s[1:])
                loop = max(wall - prefill - verify - timer.draft_s, 0.0)
                split[name] = {"steps": steps, "tau": (size.new_tokens - 1) / steps, "wall_s": wall,
                               "verify_ms": 1e3 * verify / steps, "draft_ms": 1e3 * timer.draft_s / steps,
                               "loop_ms": 1e3 * loop / steps, "loop_share": loop / max(verify + timer.draft_s, 1e-12)}
                kind = name.split("_")[0]  # ours: dflash_hf..., dspark_hf...
                if kind in drafts:
                    split[name]["kernels"] = drafts[kind].generation_stats.get("kernels")
    finally:
        timer.close()
    check(f"split, tau {block}", outputs)
    return split


def measure_curve(target, drafts: dict, generate: dict, ids, device, size: Size, check, deadline: float,
                  skipped: dict) -> dict:
    """Per loop and forced tau: the fastest of `size.repeats` unsynced runs, its tokens/s, speed-up and measured tau."""
    curve = {name: {} for name in generate}
    counter = ForwardCounter(target)
    try:
        for period in sorted(size.periods, reverse=True):  # the cheap points first, so a budget cut drops tau 1
            if time.perf_counter() > deadline:
                skipped[f"tau {period}"] = "over the time budget"
                continue
            with forced_acceptance(target, drafts, period):
                for _ in range(size.repeats):
                    outputs = {}
                    for name, fn in generate.items():
                        counter.count = 0
                        outputs[name], wall = timed_generate(fn, ids, device, size.new_tokens)
                        wall = min(wall, curve[name].get(period, {}).get("wall_s", wall))
                        curve[name][period] = {"wall_s": wall, "tok_s": size.new_tokens / wall,
                                               "tau": (size.new_tokens - 1) / max(counter.count - 1, 1)}
                    check(f"tau {period}", outputs)
            for name in generate:
                curve[name][period]["speedup"] = curve[BASELINE][period]["wall_s"] / curve[name][period]["wall_s"]
    finally:
        counter.handle.remove()
    return {name: {str(p): point for p, point in points.items()} for name, points in curve.items()}


def run(size_name: str, out_dir: Path | None, budget_s: float, device_name: str | None = None) -> dict:
    started = time.perf_counter()
    size = SIZES[size_name]
    device = torch.device(device_name or size.device)
    target, drafts = build_models(size, device, getattr(torch, size.dtype))
    generate, skipped, extra = bench_paths(target, drafts, device, size.new_tokens)
    ids = torch.randint(3, size.target["vocab_size"] - 1, (1, size.prompt_tokens),
                        generator=torch.Generator().manual_seed(0)).to(device)
    block = size.draft["block_size"]
    mismatches = []

    def check(label: str, outputs: dict) -> None:
        for name, out in outputs.items():
            at = first_difference(outputs[BASELINE], out)
            if at is not None:
                mismatches.append(f"{name} differs from plain generate at token {at - ids.shape[1]} ({label})")

    # Warm-up (kernel compilation, allocator, cuBLAS handles), forced to full blocks; checked like every run.
    with forced_acceptance(target, drafts, block):
        check("warm-up", {name: timed_generate(fn, ids, device, block + 2)[0] for name, fn in generate.items()})
    split = measure_split(target, drafts, extra, generate, ids, device, size, check)
    curve = measure_curve(target, drafts, generate, ids, device, size, check, started + budget_s, skipped)
    if size.natural_tokens:  # random heads: tau ~ 1, and a check of exactness off the forced path
        check("natural", {name: timed_generate(fn, ids, device, size.natural_tokens)[0]
                          for name, fn in generate.items()})
    report = {"size": size_name, "settings": asdict(size), "elapsed_s": time.perf_counter() - started,
              "machine": machine(device), "split_at_tau": block, "split": split, "curve": curve, "skipped": skipped,
              "mismatches": mismatches}
    report["table"] = format_table(report)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"gpu_bench_{size_name}.json").write_text(json.dumps(report, indent=1) + "\n")
        (out_dir / f"gpu_bench_{size_name}.txt").write_text(report["table"] + "\n")
    return report


def machine(device: torch.device) -> dict:
    import transformers

    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def format_table(report: dict) -> str:
    size, split, curve, block = report["settings"], report["split"], report["curve"], report["split_at_tau"]
    periods = sorted(int(p) for p in curve[BASELINE])
    info, target = report["machine"], size["target"]
    title = (f"gpu_bench ({report['size']}): {info['device']}, torch {info['torch']}, transformers "
             f"{info['transformers']}, {size['dtype']}; target {target['num_hidden_layers']} layers x "
             f"{target['hidden_size']} (vocab {target['vocab_size']}), draft {size['draft']['num_hidden_layers']} "
             f"layers, block {block}; prompt {size['prompt_tokens']} + {size['new_tokens']} new tokens")
    lines = [title, f"{'':<28}{f'ms per verify step at tau {block}':^38}  speed-up over plain generate at forced tau"]
    header = (f"{'loop':<28} {'verify':>7} {'draft':>7} {'loop':>7} {'loop/(v+d)':>11}  "
              + " ".join(f"{f'tau={p}':>7}" for p in periods))
    lines += [header, "-" * len(header)]
    for name, row in split.items():
        cells = " ".join(f"{curve[name][str(p)]['speedup']:>6.2f}x" if str(p) in curve[name] else f"{'-':>7}"
                         for p in periods)
        draft = f"{row['draft_ms']:>7.2f}" if name != BASELINE else f"{'-':>7}"
        lines.append(f"{name:<28} {row['verify_ms']:>7.2f} {draft} {row['loop_ms']:>7.2f} "
                     f"{100 * row['loop_share']:>10.0f}%  {cells}")
    base = [point["tok_s"] for point in curve[BASELINE].values()]
    if base:
        lines.append(f"plain generate: {sum(base) / len(base):.1f} tok/s.")
    lines.append("verify: the target's forward (plain generate: a decode step); draft: draft forwards, the lm_head "
                 "they call, our propose and walk; loop: the rest of the wall time. Split synced per forward; curve "
                 "unsynced.")
    fixed_length = [name for name in curve if name not in (BASELINE, OURS["dflash"], OURS["dspark"])]
    off = [f"{name} at tau {p}: {point['tau']:.2f}" for name in fixed_length for p, point in curve[name].items()
           if abs(point["tau"] - int(p)) > 0.25 * int(p)]
    if off:
        lines.append("measured tau off the forced one: " + ", ".join(off))
    # Like for like: our fixed-length DFlash loop against the peers' (same weights, full blocks every step).
    ours, peers = OURS["dflash"] + FIXED, (TRANSFORMERS_DFLASH, ZLAB)
    behind = sorted({int(p) for p in curve.get(ours, {}) for peer in peers
                     if p in curve.get(peer, {}) and curve[ours][p]["speedup"] < curve[peer][p]["speedup"]})
    lines.append(f"{ours} at or above transformers' and z-lab's loops at every tau: "
                 + ("yes" if not behind else f"no (tau {', '.join(map(str, behind))})"))
    heavy = [name for name in split if name.startswith(tuple(OURS.values())) and split[name]["loop_share"] > 0.10]
    lines.append("our loop overhead within 10% of verify + draft: " + ("yes" if not heavy else "no (" + ", ".join(heavy)
                                                                        + ")"))
    for name, reason in report["skipped"].items():
        lines.append(f"skipped {name}: {reason}")
    lines.append("every loop's tokens equal plain generate's in every run" if not report["mismatches"]
                 else "NOT LOSSLESS: " + "; ".join(report["mismatches"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--device", default=None, help="default: cuda for full, cpu for tiny")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="write gpu_bench_<size>.json and .txt here")
    parser.add_argument("--budget-s", type=float, default=400.0, help="skip the remaining tau points after this")
    args = parser.parse_args(argv)
    if (args.device or SIZES[args.size].device) == "cuda" and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device (use --size tiny for the CPU run).", file=sys.stderr)
        return 2
    report = run(args.size, Path(args.out) if args.out else None, args.budget_s, args.device)
    print(report["table"])
    print(f"done in {report['elapsed_s']:.0f} s")
    return 1 if report["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
