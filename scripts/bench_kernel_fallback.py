"""What the kernel layer costs where no kernel runs: the CPU torch fallback against no kernel layer at all.

"with layer" is the draft as shipped (DFLASH_KERNELS=auto on the CPU: each forward checks the switch and the device,
each norm checks for a kernel path, then the torch math runs). "no layer" is the same draft with those hooks replaced
by the bare torch calls they fall back to. Rounds alternate between the two so drift hits both alike; an A/A
comparison (no layer against itself) gives the noise floor the difference should be read against.

    .venv/bin/python scripts/bench_kernel_fallback.py [--rounds 15]
"""

import argparse
import os
import statistics
import time

import torch

from dflash_hf import modeling_dflash
from dflash_hf.configuration_dflash import DFlashConfig, DSparkConfig
from dflash_hf.layers_dflash import DFlashContextCache, DFlashRMSNorm
from dflash_hf.modeling_dflash import DFlashDraftModel, DSparkDraftModel

SHIPPED = {name: getattr(modeling_dflash, name) for name in ("kernel_path_for", "context_kv_kernel",
                                                             "markov_walk_kernel")}
SHIPPED_NORM = DFlashRMSNorm.forward


def bare_norm(self, hidden_states):
    """DFlashRMSNorm's torch math with no kernel check in front of it."""
    dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(dtype)


def no_layer() -> None:
    for name in SHIPPED:
        setattr(modeling_dflash, name, lambda *args: None)
    DFlashRMSNorm.forward = bare_norm


def with_layer() -> None:
    for name, fn in SHIPPED.items():
        setattr(modeling_dflash, name, fn)
    DFlashRMSNorm.forward = SHIPPED_NORM


def smollm2_sized(kind: str, layers: int):
    """A draft the size of one for SmolLM2-135M (hidden 576, 9/3 heads of 64, vocab 49152), random weights."""
    fields = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                  num_attention_heads=9, num_key_value_heads=3, head_dim=64, target_hidden_size=576,
                  num_target_layers=30, block_size=8, mask_token_id=0, shares_target_embeddings=False)
    torch.manual_seed(0)
    if kind == "dspark":
        return DSparkDraftModel(DSparkConfig(markov_rank=16, enable_confidence_head=True, draft_vocab_size=8192,
                                             **fields)).eval()
    return DFlashDraftModel(DFlashConfig(**fields)).eval()


def timed(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def compare(name: str, fn, calls: int, rounds: int) -> None:
    """Per round: no layer, with layer, no layer again (order alternating); report per-round paired differences."""
    arms = {"no layer": no_layer, "with layer": with_layer, "no layer (A/A)": no_layer}
    samples = {label: [] for label in arms}
    fn()  # warm-up
    for round_index in range(rounds):
        order = list(arms) if round_index % 2 == 0 else list(reversed(arms))
        for label in order:
            arms[label]()
            samples[label].append(timed(fn, calls))
    with_layer()
    base = statistics.median(samples["no layer"])
    unit, scale = ("us", 1e6) if base < 1e-3 else ("ms", 1e3)
    print(f"{name}: {rounds} rounds x {calls} calls")
    print(f"  no layer     median {base * scale:10.3f} {unit}")
    for label in ("with layer", "no layer (A/A)"):
        diffs = sorted(a - b for a, b in zip(samples[label], samples["no layer"]))
        q1, mid, q3 = (diffs[int(f * (len(diffs) - 1))] for f in (0.25, 0.5, 0.75))
        print(f"  {label:<12} paired diff median {mid * scale:+9.3f} {unit} ({100 * mid / base:+6.2f}%), "
              f"IQR [{q1 * scale:+.3f}, {q3 * scale:+.3f}] {unit}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    os.environ.pop("DFLASH_KERNELS", None)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, DFLASH_KERNELS=auto on the CPU")

    norm = DFlashRMSNorm(576, eps=1e-6)
    x = torch.randn(1, 8, 576)
    with torch.no_grad():
        compare("RMSNorm forward [1, 8, 576]", lambda: norm(x), calls=200, rounds=args.rounds * 4)

    for kind in ("dflash", "dspark"):
        draft = smollm2_sized(kind, layers=1)
        prompt = torch.randn(1, 200, draft.fc.in_features)
        step = torch.randn(1, 4, draft.fc.in_features)
        anchor = torch.tensor([7])
        cache = DFlashContextCache()
        draft.propose(prompt, anchor, cache)
        length = cache.get_seq_length()
        block = draft.embed(torch.tensor([[7] + [0] * 7]))

        def rewind(cache=cache, length=length):
            """Keep the context at the prompt's length between calls, so every call does the same work."""
            for layer in range(len(cache.keys)):
                cache.keys[layer] = cache.keys[layer][:, :, :length]
                cache.values[layer] = cache.values[layer][:, :, :length]

        def forward(draft=draft, cache=cache, block=block, step=step, rewind=rewind):
            with torch.no_grad():
                draft(block, step, cache=cache)
            rewind()

        def propose(draft=draft, cache=cache, step=step, anchor=anchor, rewind=rewind):
            draft.propose(step, anchor, cache)
            rewind()

        compare(f"{kind} draft forward (block 8, 200 cached + 4 new context tokens)", forward, calls=4,
                rounds=args.rounds)
        compare(f"{kind} propose (forward + head + pick)", propose, calls=2, rounds=args.rounds)
        with torch.no_grad():
            hook = timed(lambda draft=draft, block=block: draft._select_kernel_path(block), 20000)
        print(f"  the per-forward hook alone (_select_kernel_path): {hook * 1e6:.2f} us per call")


if __name__ == "__main__":
    main()
