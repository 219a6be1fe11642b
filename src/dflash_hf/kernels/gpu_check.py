"""On a CUDA machine: every kernel against its torch reference at realistic sizes, both timed; prints a table.

Run `scripts/gpu_check.sh` (or `python -m dflash_hf.kernels.gpu_check`). Exit status 0 = all match, 1 = a mismatch,
2 = no CUDA device. Times are medians of CUDA-event timings after warm-up; "torch" is the reference, which is the
model's own torch math. Shapes follow Kimi-K2.6's DFlash/DSpark drafts (hidden 7168, 8 KV heads of 128, 6 layers,
vocabulary 163840, DSpark drafting 32000 kept ids), a Qwen3-8B-sized one, and z-lab/Qwen3.8-27B-DFlash2's selector
(vocabulary 248320, rank 256, top-16, 7 slots).
"""

import argparse
import os
import statistics
import sys
import time

import torch

RUNS = 50
BF16, FP32 = torch.bfloat16, torch.float32
# Realistic sizes (Kimi-K2.6 drafts; a Qwen3-8B-sized vocabulary), and tiny ones for a CPU dry run of this script
# under TRITON_INTERPRET=1 (`--tiny`), which checks the checking code itself.
FULL = {
    "rms_norm": [(512, 7168, BF16), (8, 4096, BF16), (512, 4096, FP32)],
    "context_kv": [(6, 1, 16, 7168, 8, 128, BF16), (6, 1, 512, 7168, 8, 128, BF16), (1, 1, 16, 4096, 8, 128, BF16),
                   (2, 2, 64, 1024, 4, 128, FP32)],
    "markov_walk": [(1, 8, 163840, 32000, 256, 7168, BF16, False), (1, 8, 163840, 32000, 256, 7168, BF16, True),
                    (1, 15, 151936, 151936, 256, 4096, BF16, False), (4, 16, 151936, 151936, 64, 4096, FP32, False)],
    # batch, slots, vocabulary, rank, top-K, dtype, sampled
    "selector_walk": [(1, 7, 248320, 256, 16, BF16, False), (1, 7, 248320, 256, 16, BF16, True),
                      (4, 15, 151936, 256, 16, FP32, False)],
}
TINY = {
    "rms_norm": [(3, 70, FP32)],
    "context_kv": [(2, 2, 5, 40, 2, 16, FP32)],
    "markov_walk": [(2, 8, 3001, 700, 8, 48, FP32, False), (2, 8, 3001, 700, 8, 48, FP32, True)],
    "selector_walk": [(2, 7, 3001, 16, 8, FP32, False), (2, 7, 3001, 16, 8, FP32, True)],
}


def median_ms(fn, runs: int, device: torch.device) -> float:
    """Median milliseconds per call: CUDA events on a GPU, wall clock on the CPU (the --tiny dry run)."""
    if device.type != "cuda":
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def max_error(got, want) -> float:
    pairs = zip(got, want) if isinstance(got, (tuple, list)) else [(got, want)]
    return max(((g.float() - w.float()).abs().max().item() if g.numel() else 0.0) for g, w in pairs)


def boundary_tie(weights: torch.Tensor, uniform: float, a: int, b: int, rel: float = 1e-3) -> bool:
    """Two inverse-CDF draws that differ only because u * total sits on the CDF boundary between them."""
    cdf = weights.double().cumsum(0)
    target = uniform * float(cdf[-1])
    low, high = sorted((a, b))
    return abs(float(cdf[low]) - target) <= rel * float(cdf[-1]) and float(cdf[high - 1] - cdf[low]) <= rel * float(
        cdf[-1])


def first_differences(got: torch.Tensor, want: torch.Tensor) -> list[tuple[int, int]]:
    """(row, slot) of each row's first differing id; later slots condition on it and may differ legitimately."""
    out = []
    for row in range(got.shape[0]):
        diff = (got[row] != want[row]).nonzero()
        if len(diff):
            out.append((row, int(diff[0])))
    return out


def cases(ops, ref, device, shapes):
    """(name, shape, dtype, kernel fn, torch fn, check(kernel_out, torch_out) -> (ok, error))."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    def tol(atol, rtol):
        def check(got, want):
            pairs = zip(got, want) if isinstance(got, tuple) else [(got, want)]
            ok = all(torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol) for a, b in pairs)
            return ok, max_error(got, want)
        return check

    for rows, width, dtype in shapes["rms_norm"]:
        x, w = randn(rows, width, dtype=dtype, scale=3.0), randn(width, dtype=dtype)
        check = tol(2e-2, 2e-2) if dtype == torch.bfloat16 else tol(1e-5, 1e-5)
        yield ("rms_norm", f"{rows}x{width}", dtype, lambda x=x, w=w: ops.rms_norm(x, w, 1e-6),
               lambda x=x, w=w: ref.rms_norm(x, w, 1e-6), check)

    for layers, batch, length, hidden, kv_heads, head_dim, dtype in shapes["context_kv"]:
        width = kv_heads * head_dim
        x = randn(batch, length, hidden, dtype=dtype)
        wk = randn(layers, width, hidden, dtype=dtype, scale=hidden**-0.5)
        wv = randn(layers, width, hidden, dtype=dtype, scale=hidden**-0.5)
        nw = randn(layers, head_dim, dtype=dtype)
        angles = torch.rand(batch, length, head_dim // 2, generator=g, device=device) * 6.0
        cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
        args = (x, wk, wv, None, None, nw, cos, sin, 1e-6)
        check = tol(5e-2, 5e-2) if dtype == torch.bfloat16 else tol(1e-4, 1e-4)
        yield ("context_kv", f"L{layers} B{batch} C{length} H{hidden} {kv_heads}x{head_dim}", dtype,
               lambda args=args: ops.context_kv(*args), lambda args=args: ref.context_kv(*args), check)

    for batch, num, vocab, draft_vocab, rank, hidden, dtype, sampled in shapes["markov_walk"]:
        kept = torch.sort(torch.randperm(vocab, generator=g, device=device)[:draft_vocab]).values
        base = randn(batch, num, draft_vocab, scale=2.0)
        args = (base, randn(batch, num, hidden, dtype=dtype), torch.randint(0, vocab, (batch,), device=device,
                                                                            generator=g),
                randn(vocab, rank, dtype=dtype), randn(draft_vocab, rank, dtype=dtype, scale=rank**-0.5),
                kept - torch.arange(draft_vocab, device=device) if draft_vocab < vocab else None,
                randn(hidden + rank, dtype=dtype, scale=hidden**-0.5), randn(1, dtype=dtype),
                torch.rand(batch, num, generator=g, device=device) if sampled else None, 1.0, True, True)

        def walk_check(got, want, args=args, num=num, rel=1e-2 if dtype == torch.bfloat16 else 1e-4):
            kept = torch.arange(args[0].shape[-1], device=device)
            kept = kept + args[5] if args[5] is not None else kept
            firsts = dict(first_differences(got[0], want[0]))
            for row, slot in firsts.items():
                a, b = (int(torch.searchsorted(kept, t[row, slot])) for t in (got[0], want[0]))
                logits = want[1][row, slot]
                if args[8] is None:  # greedy: a near tie of the reference logits
                    ok = abs(float(logits[a] - logits[b])) <= rel * max(1.0, abs(float(logits[b])))
                else:
                    ok = boundary_tie(torch.exp(logits - logits.max()), float(args[8][row, slot]), a, b)
                if not ok:
                    return False, float("inf")
            conf_ok = all(torch.allclose(got[2][r, : firsts.get(r, num) + 1], want[2][r, : firsts.get(r, num) + 1],
                                         atol=1e-2) for r in range(got[0].shape[0]))
            return conf_ok, max_error(got[2], want[2])

        yield ("markov_walk" + (" (sample)" if sampled else ""),
               f"B{batch} n{num} Vd{draft_vocab}/{vocab} r{rank} H{hidden}", dtype,
               lambda args=args: ops.markov_walk(*args), lambda args=args: ref.markov_walk(*args), walk_check)

    for batch, num, vocab, rank, top_k, dtype, sampled in shapes["selector_walk"]:
        unary, candidates = randn(batch, num, vocab, scale=2.0).topk(top_k, -1)
        args = (unary, candidates, randn(batch, num, rank, dtype=dtype), randn(vocab, rank, dtype=dtype),
                randn(vocab, rank, dtype=dtype, scale=rank**-0.5),
                torch.randint(0, vocab, (batch,), device=device, generator=g),
                torch.rand(batch, num, generator=g, device=device) if sampled else None, 1.0, True)

        def selector_check(got, want, args=args, num=num):
            """Picks equal up to each row's first difference, which must be a near tie of the reference scores
            (greedy) or a CDF boundary (sampled); scores close up to there."""
            firsts = dict(first_differences(got[0], want[0]))
            for row, slot in firsts.items():
                cands, scores = args[1][row, slot], want[1][row, slot]
                a, b = (int((cands == t[row, slot]).nonzero()[0, 0]) for t in (got[0], want[0]))
                if args[6] is None:
                    ok = abs(float(scores[a] - scores[b])) <= 1e-3 * max(1.0, abs(float(scores[b])))
                else:
                    ok = boundary_tie(torch.exp(scores - scores.max()), float(args[6][row, slot]), a, b)
                if not ok:
                    return False, float("inf")
            prefixes = [(got[1][r, : firsts.get(r, num - 1) + 1], want[1][r, : firsts.get(r, num - 1) + 1])
                        for r in range(got[0].shape[0])]
            ok = all(torch.allclose(a, b, atol=1e-3, rtol=1e-3) for a, b in prefixes)
            return ok, max((a - b).abs().max().item() for a, b in prefixes)

        yield ("selector_walk" + (" (sample)" if sampled else ""), f"B{batch} n{num} V{vocab} r{rank} K{top_k}", dtype,
               lambda args=args: ops.selector_walk(*args), lambda args=args: ref.selector_walk(*args), selector_check)


def load_ops(source: str):
    from kernels import get_kernel, get_local_kernel

    from ..kernels_dflash import KERNELS_REPO_ID, KERNELS_VERSION
    from . import shipped_kernel_repo

    if source == "hub":
        return get_kernel(KERNELS_REPO_ID, version=KERNELS_VERSION, trust_remote_code=[KERNELS_REPO_ID])
    return get_local_kernel(shipped_kernel_repo())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=("local", "hub"), default="local",
                        help="the shipped kernel source (default) or the published Hub repo")
    parser.add_argument("--runs", type=int, default=RUNS, help="timed runs per op (median reported)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1: a dry run of this script, no timings "
                             "worth reading")
    args = parser.parse_args(argv)
    if args.tiny:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("gpu_check --tiny runs the kernels in the Triton interpreter: start it with TRITON_INTERPRET=1.",
                  file=sys.stderr)
            return 2
        device, shapes, runs = torch.device("cpu"), TINY, 2
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine "
              "(or `TRITON_INTERPRET=1 ... --tiny` for a CPU dry run).", file=sys.stderr)
        return 2
    else:
        device, shapes, runs = torch.device("cuda"), FULL, args.runs
    started = time.perf_counter()
    ops = load_ops(args.source)
    from . import reference as ref

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"device: {name}  torch {torch.__version__}  kernels from {args.source}  (median of {runs} runs, ms)")
    header = f"{'op':<22} {'shape':<40} {'dtype':<9} {'ok':<4} {'max err':>9} {'kernel':>9} {'torch':>9} {'x':>6}"
    print(header)
    print("-" * len(header))
    failures = 0
    for op, shape, dtype, kernel_fn, torch_fn, check in cases(ops, ref, device, shapes):
        ok, error = check(kernel_fn(), torch_fn())
        kernel_ms, torch_ms = median_ms(kernel_fn, runs, device), median_ms(torch_fn, runs, device)
        failures += not ok
        print(f"{op:<22} {shape:<40} {str(dtype).removeprefix('torch.'):<9} {'yes' if ok else 'NO':<4} "
              f"{error:>9.2e} {kernel_ms:>9.3f} {torch_ms:>9.3f} {torch_ms / kernel_ms:>6.2f}")
    failures += not end_to_end(device, args.source)
    print(f"{'all kernels match their references' if not failures else f'{failures} MISMATCH(ES)'} "
          f"in {time.perf_counter() - started:.0f} s")
    return 1 if failures else 0


def end_to_end(device, source: str) -> bool:
    """A tiny target with a DFlash, a DSpark and a DFlash 2 draft: proposals with kernels on equal those with torch.

    The drafts load the kernels through the model's own loader; for the local source it is pointed at this
    checkout's build with LOCAL_KERNELS, so nothing is fetched.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ..configuration_dflash import DFlashConfig, DSparkConfig
    from ..configuration_dflash2 import DFlash2Config
    from ..kernels_dflash import KERNELS_REPO_ID
    from ..layers_dflash import DFlashContextCache
    from ..modeling_dflash import DFlashDraftModel, DSparkDraftModel
    from ..modeling_dflash2 import DFlash2DraftModel
    from . import shipped_kernel_repo

    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)).to(device).eval()
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, target_hidden_size=64, num_target_layers=4, block_size=8,
                  mask_token_id=511, rope_theta=10.0)
    drafts = {"dflash": DFlashDraftModel(DFlashConfig(**fields)),
              "dspark": DSparkDraftModel(DSparkConfig(markov_rank=8, enable_confidence_head=True, **fields)),
              "dflash2": DFlash2DraftModel(DFlash2Config(conv_group_size=16, selector_rank=32, selector_top_k=8,
                                                         **fields))}
    all_ok = True
    previous = {name: os.environ.get(name) for name in ("DFLASH_KERNELS", "LOCAL_KERNELS")}
    if source == "local":
        os.environ["LOCAL_KERNELS"] = f"{KERNELS_REPO_ID}={shipped_kernel_repo()}"
    try:
        for kind, draft in drafts.items():
            with torch.no_grad():
                for name, param in draft.named_parameters():
                    param.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.3)
            draft = draft.to(device).eval()
            draft.bind_target(target)
            context = torch.randn(1, 9, draft.fc.in_features, device=device)
            anchor = torch.tensor([5], device=device)
            ids = {}
            for mode in ("0", "1"):
                os.environ["DFLASH_KERNELS"] = mode
                ids[mode] = draft.propose(context, anchor, DFlashContextCache()).draft_ids
            path = draft.__dict__["_kernel_path"]
            ok = torch.equal(ids["0"], ids["1"]) and path is not None
            all_ok &= ok
            print(f"end to end: {kind} proposals with kernels ({path.label if path else 'none'}) "
                  f"{'==' if ok else '!='} torch: {ids['1'].tolist()}")
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return all_ok


if __name__ == "__main__":
    sys.exit(main())
