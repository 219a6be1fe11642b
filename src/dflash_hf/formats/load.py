"""`load_draft`: any dialect's checkpoint as our draft model, checked in full before the model is filled.

The model is built on the meta device and the checkpoint's tensors are assigned to it, so a large draft never exists
twice in memory; tensor names, shapes, finite values and vocabulary maps are all checked first, so a bad checkpoint
raises and nothing is half-loaded.
"""

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from ..modeling_dflash import DFlashDraftModel, check_finite_weights, check_vocab_mapping
from .files import read_config, resolve_checkpoint, tensor_headers, weight_files
from .read import LoadPlan, plan_load

logger = logging.getLogger(__name__)

LOAD_OPTIONS = ("dtype", "torch_dtype", "device", "revision", "cache_dir", "token", "local_files_only",
                "trust_remote_code", "num_target_layers")


def _torch_dtype(value) -> torch.dtype | None:
    if value is None or value == "auto" or isinstance(value, torch.dtype):
        return None if value == "auto" else value
    resolved = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"Unknown dtype {value!r}; use e.g. 'bfloat16', 'float32' or 'auto'.")
    return resolved


def _check_tensors(plan: LoadPlan, expected: dict[str, tuple], headers: dict, context: str) -> dict[str, str]:
    """{our name: checkpoint name} of the tensors to read; raises, naming every problem at once, unless they fill the
    model exactly.

    Every dialect studied names the body, heads and vocabulary maps as we do (unprefixed), so names map to themselves
    but for the few a plan renames (DFlash 2 codebooks spelled with `.weight`); what differs is which tensors exist,
    and which are training-only.
    """
    present = {plan.renames.get(name, name): name for name in set(headers) - plan.ignored}
    problems = []
    missing = sorted(set(expected) - set(present) - set(plan.fills))
    unexpected = sorted(present[name] for name in set(present) - set(expected))
    mismatched = [
        f"{present[name]}: checkpoint {list(headers[present[name]][1])} vs expected {list(expected[name])}"
        for name in sorted(set(present) & set(expected)) if headers[present[name]][1] != expected[name]
    ]
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {'; '.join(mismatched)}")
    if problems:
        raise ValueError(f"{context} does not fill the {plan.model_class.__name__} its config describes; "
                         + "; ".join(problems) + ".")
    return present


def _read_tensors(plan: LoadPlan, names: dict[str, str], headers: dict, dtype, device) -> dict[str, torch.Tensor]:
    """Our state dict from the checkpoint tensors `names` ({our name: checkpoint name}) and the plan's fills."""
    by_file: dict[Path, list[str]] = {}
    for name in sorted(names):
        by_file.setdefault(headers[names[name]][0], []).append(name)
    state = {}
    for file, file_names in by_file.items():
        with safe_open(str(file), framework="pt", device=str(device)) as handle:
            for name in file_names:
                tensor = handle.get_tensor(names[name])
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                state[name] = tensor
    for name, make in plan.fills.items():
        if name not in state:
            state[name] = make().to(device)
    # Vocabulary maps are indices and flags whatever the file stored them as.
    if "d2t" in state:
        state["d2t"] = state["d2t"].long()
    if "t2d" in state:
        state["t2d"] = state["t2d"].bool()
    return state


def load_draft(path_or_repo_id, **from_pretrained_kwargs) -> DFlashDraftModel:
    """Load a DFlash/DSpark/DFlash 2 draft from any known dialect as our `DFlashDraftModel` / `DSparkDraftModel` /
    `DFlash2DraftModel`.

    Accepted keyword arguments: dtype (or torch_dtype; "auto"/None keeps the checkpoint's, e.g. bf16), device,
    the Hub options revision / cache_dir / token / local_files_only, and num_target_layers for checkpoints that do not
    record the target's depth (speculators). trust_remote_code is accepted and ignored: no checkpoint code runs.
    """
    unknown = sorted(set(from_pretrained_kwargs) - set(LOAD_OPTIONS))
    if unknown:
        raise TypeError(f"load_draft got unsupported arguments {unknown}; it accepts {list(LOAD_OPTIONS)}.")
    options = dict(from_pretrained_kwargs)
    dtype = _torch_dtype(options.pop("dtype", options.pop("torch_dtype", None)))
    device = torch.device(options.pop("device", None) or "cpu")
    options.pop("trust_remote_code", None)
    overrides = {"num_target_layers": options.pop("num_target_layers", None)}
    folder = resolve_checkpoint(path_or_repo_id, **options)
    raw = read_config(folder)
    headers = tensor_headers(weight_files(folder))
    plan = plan_load(raw, set(headers), str(folder), overrides, options)
    context = f"{folder} ({plan.dialect} checkpoint)"

    with torch.device("meta"):
        model = plan.model_class(plan.config)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    names = _check_tensors(plan, expected, headers, context)
    state = _read_tensors(plan, names, headers, dtype, device)
    check_finite_weights(state, lambda name: str(headers[names[name]][0]) if name in names
                         else f"{context} (filled in)")
    if "d2t" in state:
        try:
            check_vocab_mapping(state["d2t"], state["t2d"], plan.config.draft_vocab_size, plan.config.vocab_size)
        except ValueError as error:
            raise ValueError(f"{context}: {error}") from error
    model.load_state_dict(state, strict=True, assign=True)
    floating = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(floating) == 1:
        model.config.dtype = floating.pop()
    model.config._name_or_path = str(path_or_repo_id)
    logger.info("Loaded %s as %s (%d tensors).", context, type(model).__name__, len(state))
    return model.eval()
