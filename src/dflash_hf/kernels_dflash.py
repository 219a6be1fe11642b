"""Kernel loading and dispatch: optional Triton kernels from a Hub kernel repo, torch everywhere else.

A Hub remote-code file (stdlib and torch only; `kernels` is imported lazily and optional). The draft asks
`kernel_path_for` which path a forward takes; the helpers here run one op on that path and return None whenever
the caller must run its own torch code instead (no kernels, an op `auto` leaves to torch, or a kernel that failed).
"""

import logging
import os

import torch

logger = logging.getLogger(__name__)

KERNELS_REPO_ID = "dflash-hf/dflash-kernels"
KERNELS_VERSION = 1  # Hub branch `v1` = the kernel package's API_VERSION
KERNELS_ENV = "DFLASH_KERNELS"
_KERNEL_MODES = {"auto": "auto", "1": "on", "on": "on", "true": "on", "0": "off", "off": "off", "false": "off"}
_KERNEL_OPS = ("rms_norm", "context_kv", "markov_walk", "selector_walk")
# Ops `auto` leaves to torch until a GPU run shows their kernel wins. The Markov walk that ran one program per row
# measured 5-25x slower than torch's per-slot launches on an H200 (docs/gpu_check_h200.txt); its replacement, split
# over the vocabulary, is unmeasured on a GPU (`scripts/gpu_check.sh` times it, `scripts/gpu_bench.sh` runs it end to
# end). `on` still runs them (that is how they are tested).
_AUTO_TORCH_OPS = frozenset({"markov_walk"})
_kernel_modules: dict[str, tuple] = {}  # device kind -> (module or None, source, why not); one load per process
_kernel_paths: dict[tuple, "KernelPath"] = {}


class KernelPath:
    """A loaded kernel module, where it came from, and whether a failing call may fall back to torch.

    Calling it runs one op; in `auto` mode a failure (say, Triton cannot compile for this GPU) logs one warning,
    retires the kernels for the rest of the process and returns None so the caller runs its torch code.
    """

    def __init__(self, module, kind: str, source: str, strict: bool):
        self.module, self.kind, self.source, self.strict = module, kind, source, strict
        self.failed = False

    @property
    def label(self) -> str:
        return f"triton:{self.source}"

    def runs(self, op: str) -> bool:
        """Whether `op` takes the kernel on this path (`auto` skips the ones slower than torch)."""
        return not self.failed and (self.strict or op not in _AUTO_TORCH_OPS)

    def __call__(self, op: str, *args):
        if self.failed:
            return None
        try:
            return getattr(self.module, op)(*args)
        except Exception as error:
            if self.strict:
                raise
            self.failed = True
            _kernel_modules[self.kind] = (None, "torch", f"{op} failed: {type(error).__name__}: {error}")
            for key in [key for key in _kernel_paths if key[0] == self.kind]:
                del _kernel_paths[key]
            logger.warning("DFlash kernel `%s` failed (%s: %s); using torch from now on.", op, type(error).__name__,
                           error)
            return None


def path_label(path: KernelPath | None) -> str:
    """"torch" or "triton:<source>": what `generation_stats["kernels"]` reports."""
    return "torch" if path is None or path.failed else path.label


def kernel_mode(config=None) -> str:
    """"auto" | "on" | "off": `DFLASH_KERNELS` when set (auto/1/0), else the config's `use_kernels`, else auto."""
    raw = os.environ.get(KERNELS_ENV, "").strip()
    if not raw:
        raw = getattr(config, "use_kernels", None)
        raw = "auto" if raw is None else raw
    mode = _KERNEL_MODES.get(str(raw).strip().lower())
    if mode is None:
        raise ValueError(f"Kernel switch {KERNELS_ENV} / `use_kernels` = {raw!r}; expected auto, 1 (on) or 0 (off).")
    return mode


def load_kernels(mode: str, device: torch.device) -> KernelPath | None:
    """The Triton kernels for `device`, or None for the torch path.

    auto: kernels on CUDA when they load, torch otherwise. on: kernels or an error (on the CPU they run only
    under TRITON_INTERPRET=1, for testing). off: torch.
    """
    if mode == "off":
        return None
    if device.type == "cuda":
        kind = "cuda"
    elif device.type == "cpu" and mode == "on" and os.environ.get("TRITON_INTERPRET") == "1":
        kind = "interpret"
    elif mode == "on":
        raise RuntimeError(
            f"{KERNELS_ENV}=1 asks for the Triton kernels, but the draft runs on {device}: they need a CUDA device "
            f"(or TRITON_INTERPRET=1 on the CPU, for testing). Set {KERNELS_ENV}=auto or 0 to use torch."
        )
    else:
        return None
    if kind not in _kernel_modules:
        _kernel_modules[kind] = _import_kernel_module(kind)
    module, source, reason = _kernel_modules[kind]
    if module is None:
        if mode == "on":
            raise RuntimeError(f"{KERNELS_ENV}=1 but the DFlash kernels could not be loaded: {reason}")
        return None
    strict = mode == "on"
    if (kind, strict) not in _kernel_paths:
        _kernel_paths[(kind, strict)] = KernelPath(module, kind, source, strict)
    return _kernel_paths[(kind, strict)]


def kernel_path_for(config, like: torch.Tensor, training: bool) -> KernelPath | None:
    """This forward's path: the configured mode on `like`'s device, torch while autograd needs gradients (the
    kernels have no backward)."""
    return None if training else load_kernels(kernel_mode(config), like.device)


def _import_kernel_module(kind: str) -> tuple:
    """Hub repo (or its LOCAL_KERNELS override) on CUDA, then the copy shipped in `dflash_hf`; the reasons if none."""
    try:
        import kernels as hub_kernels
    except ImportError as error:
        logger.info("DFlash kernels unavailable (the `kernels` package is not installed): torch path.")
        return None, "torch", f"`kernels` is not installed ({error})"
    overrides = os.environ.get("LOCAL_KERNELS", "")
    overridden = any(entry.split("=", 1)[0] == KERNELS_REPO_ID for entry in overrides.split(":") if entry)
    attempts = []
    if kind == "cuda" or overridden:
        attempts.append(("LOCAL_KERNELS" if overridden else "hub", _hub_kernel_module))
    attempts.append(("local", _shipped_kernel_module))
    reasons = []
    for source, load in attempts:
        try:
            module = load(hub_kernels)
            missing = [op for op in _KERNEL_OPS if not hasattr(module, op)]
            if getattr(module, "API_VERSION", None) != KERNELS_VERSION or missing:
                raise ImportError(f"API_VERSION {getattr(module, 'API_VERSION', None)} (expected "
                                  f"{KERNELS_VERSION}), missing ops {missing}")
        except Exception as error:  # noqa: BLE001  any failure to load means the next source, then torch
            reasons.append(f"{source}: {type(error).__name__}: {error}")
            continue
        logger.info("DFlash kernels: Triton path, loaded from %s (%s).", source, kind)
        return module, source, None
    reason = "; ".join(reasons)
    logger.info("DFlash kernels unavailable (%s): torch path.", reason)
    return None, "torch", reason


def _hub_kernel_module(hub_kernels):
    return hub_kernels.get_kernel(KERNELS_REPO_ID, version=KERNELS_VERSION, trust_remote_code=[KERNELS_REPO_ID])


def _shipped_kernel_module(hub_kernels):
    try:
        from dflash_hf.kernels import shipped_kernel_repo  # the package's own copy; absent for remote-code users
    except ImportError as error:
        raise ImportError(f"no shipped copy (dflash_hf is not installed: {error})") from error
    return hub_kernels.get_local_kernel(shipped_kernel_repo())


def stacked_kv_weights(layers, owner: dict) -> tuple:
    """k/v projection and k_norm weights of all draft layers stacked for the one-pass kernel, cached in `owner`
    (the draft's `__dict__`) and rebuilt when any weight changes."""
    attns = [layer.self_attn for layer in layers]
    parts = [(a.k_proj.weight, a.v_proj.weight, a.k_proj.bias, a.v_proj.bias, a.k_norm.weight) for a in attns]
    key = tuple((t.data_ptr(), t._version) for group in parts for t in group if t is not None)
    cached = owner.get("_kv_stack")
    if cached is None or cached[0] != key:
        stacked = tuple(None if group[0] is None else torch.stack(group) for group in zip(*parts))
        owner["_kv_stack"] = cached = (key, stacked)
    return cached[1]


def context_kv_kernel(path: KernelPath | None, layers, owner: dict, context, cos, sin) -> list[tuple] | None:
    """Per layer (k, v) [B, KVH, C, D] of the projected context in one launch for all layers, or None (torch)."""
    if path is None or not context.shape[1]:
        return None
    k_weight, v_weight, k_bias, v_bias, norm_weight = stacked_kv_weights(layers, owner)
    eps = layers[0].self_attn.k_norm.variance_epsilon
    out = path("context_kv", context, k_weight, v_weight, k_bias, v_bias, norm_weight, cos, sin, eps)
    return None if out is None else list(zip(out[0].unbind(0), out[1].unbind(0)))


def plain_temperature(logits_processor) -> float | None:
    """The temperature when the processors amount to at most one temperature warper, else None (torch walk)."""
    if not logits_processor:
        return 1.0
    try:
        from transformers.generation.logits_process import TemperatureLogitsWarper
    except ImportError:
        return None
    if len(logits_processor) == 1 and isinstance(logits_processor[0], TemperatureLogitsWarper):
        return float(logits_processor[0].temperature)
    return None


def markov_walk_kernel(path: KernelPath | None, draft, hidden, base, anchor_ids, logits_processor, do_sample,
                       need_logits, threshold) -> tuple | None:
    """DSpark's walk in one launch -> (ids, draft-vocabulary logits, confidence) cut at the stop slot, or None when
    the torch walk must run (no kernels, `auto` skipping the op, a non-vanilla head, processors beyond temperature).

    Sampling draws one uniform per slot up front (same distribution as the torch walk's multinomial, other draws).
    The kernel walks the whole block; cutting at the first slot where every row's survival is below `threshold`
    afterwards gives what the torch walk's early stop gives, since picks do not depend on the threshold.
    """
    head, conf_head = draft.markov_head, draft.confidence_head
    if path is None or not path.runs("markov_walk") or (head is not None and head.head_type != "vanilla"):
        return None
    temperature = plain_temperature(logits_processor)
    if temperature is None:
        return None
    uniforms = torch.rand(base.shape[:2], device=base.device) if do_sample else None
    out = path(
        "markov_walk", base, hidden, anchor_ids,
        None if head is None else head.markov_w1.weight, None if head is None else head.markov_w2.weight,
        draft.d2t if draft.config.drafts_pruned_vocab else None,
        None if conf_head is None else conf_head.proj.weight[0], None if conf_head is None else conf_head.proj.bias,
        uniforms, temperature, bool(draft.config.confidence_head_with_markov), bool(need_logits),
    )
    if out is None:
        return None
    ids, logits, confidence, survival = out
    stop = ids.shape[1]
    if conf_head is not None and threshold is not None:
        below = (survival < threshold).all(0).nonzero()
        if len(below):
            stop = int(below[0, 0])
    return (ids[:, :stop], logits[:, :stop] if need_logits else None,
            confidence[:, : stop + 1] if conf_head is not None else None)


def selector_walk_kernel(path: KernelPath | None, draft, unary, candidates, projected, anchor_ids, logits_processor,
                         do_sample, need_logits) -> tuple | None:
    """DFlash 2's candidate walk in one launch -> (ids [B, S], scores [B, S, K] divided by the temperature, or None
    unless `need_logits`), or None when the torch walk must run (no kernels, processors beyond temperature).

    Sampling draws one uniform per slot up front (same distribution as the torch walk's multinomial, other draws).
    """
    if path is None or not path.runs("selector_walk"):
        return None
    temperature = plain_temperature(logits_processor)
    if temperature is None:
        return None
    selector = draft.candidate_selector
    uniforms = torch.rand(unary.shape[:2], device=unary.device) if do_sample else None
    out = path("selector_walk", unary, candidates, projected, selector.predecessor_codebook,
               selector.successor_codebook, anchor_ids, uniforms, temperature, bool(need_logits))
    if out is None:
        return None
    ids, scores = out
    return ids, scores if need_logits else None


__all__ = ["KERNELS_ENV", "KERNELS_REPO_ID", "KERNELS_VERSION", "KernelPath", "kernel_mode", "kernel_path_for",
           "load_kernels", "path_label"]
