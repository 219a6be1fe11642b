"""Generation: target-state capture, the candidate generator and the hook behind `generate(assistant_model=draft)`.

A Hub remote-code file (torch and transformers only). It knows drafts by duck typing (`_is_dflash_block_drafter`,
`propose`, `new_context_cache`), so it never imports the models. `import dflash_hf` and every draft's constructor
install the hook (`install_generate_hook`).

Everything a generate call creates (the generator, its target-state capture, its books) belongs to that call: the
hook finds the call's generator through a context variable, closes its capture whatever raised, and hands the
finished stats to the caller (`output.generation_stats` with `return_dict_in_generate=True`) and to
`draft.generation_stats` (the last finished call). Two threads sharing one draft each get their own.
"""

import contextvars
import inspect
import logging
import threading
import time
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator

from .batching_dflash import batched_speculation, note_nonfinite_draft
from .policy_dflash import LengthPolicy, measured_costs
from .verify_matmul import set_verifying, verify_matmuls

logger = logging.getLogger(__name__)


def check_draft_fits_target(draft_config, target_config) -> None:
    """Raise, naming the field, when a draft cannot read this target's states or speak its vocabulary."""
    text_config = target_config.get_text_config(decoder=True)
    expected = {
        "vocab_size": text_config.vocab_size,
        "target_hidden_size": text_config.hidden_size,
        "num_target_layers": text_config.num_hidden_layers,
    }
    for name, value in expected.items():
        if getattr(draft_config, name) != value:
            raise ValueError(
                f"The draft does not fit this target: draft `{name}` = {getattr(draft_config, name)}, the target "
                f"({type(target_config).__name__}) has {value}. Load the draft made for this target."
            )
    if any(not 0 <= t < expected["num_target_layers"] for t in draft_config.target_layer_ids):
        raise ValueError(
            f"The draft reads target layers {draft_config.target_layer_ids} but the target has "
            f"{expected['num_target_layers']} decoder layers."
        )
    if not 0 <= draft_config.mask_token_id < expected["vocab_size"]:
        raise ValueError(
            f"The draft's `mask_token_id` = {draft_config.mask_token_id} is outside the target vocabulary "
            f"[0, {expected['vocab_size']})."
        )


class TargetStateCapture:
    """Captures the outputs of the target's chosen decoder layers during its forwards.

    mode "outputs": transformers' selective `output_hidden_states=[t + 1, ...]` (only those layers are kept);
    mode "hooks": forward hooks on the decoder layers, for targets whose modeling code cannot select (remote code,
    older code). "auto" picks "outputs" where the target records hidden states through transformers' output capture.
    Either way, only the chosen layers' states are held, and only until the next forward.
    """

    def __init__(self, target: PreTrainedModel, layer_ids: list[int], mode: str = "auto"):
        self.layer_ids = list(layer_ids)
        self.layers = find_decoder_layers(target)
        if mode == "auto":
            mode = "outputs" if "hidden_states" in (getattr(target, "_can_record_outputs", None) or {}) else "hooks"
        if mode not in ("outputs", "hooks"):
            raise ValueError(f"capture mode must be 'auto', 'outputs' or 'hooks', got {mode!r}.")
        self.mode = mode
        self._captured: dict[int, torch.Tensor] = {}
        self._handles = []
        # The target is shared: another thread's generate call may run it at the same time, and its forwards fire
        # these hooks too. Record only the forwards of the thread that owns this capture (its generate call).
        self._owner = threading.get_ident()
        if mode == "hooks":
            for t in self.layer_ids:
                # `hidden_states[N]` is the final-normed state in transformers, so the last layer is read after the norm.
                module = self.layers[t] if t < len(self.layers) - 1 else find_final_norm(target, self.layers)
                self._handles.append(module.register_forward_hook(self._recorder(t)))

    def _recorder(self, layer_id: int):
        def record(module, args, output):
            if threading.get_ident() != self._owner:
                return
            self._captured[layer_id] = (output[0] if isinstance(output, (tuple, list)) else output).detach()

        return record

    @property
    def model_kwargs_overrides(self) -> dict:
        return {"output_hidden_states": [t + 1 for t in self.layer_ids]} if self.mode == "outputs" else {}

    def states(self, model_outputs, count: int, device: torch.device) -> torch.Tensor:
        """[B, count, K*H]: the first `count` positions of the last target forward, layers concatenated."""
        if self.mode == "hooks":
            parts = [self._captured[t] for t in self.layer_ids]
        else:
            hidden = getattr(model_outputs, "hidden_states", None)
            if hidden is None or any(hidden[t + 1] is None for t in self.layer_ids):
                raise RuntimeError(
                    "The target did not return the requested hidden states; set `draft.capture_mode = 'hooks'`."
                )
            parts = [hidden[t + 1] for t in self.layer_ids]
        return torch.cat([p[:, :count].to(device) for p in parts], dim=-1)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._captured.clear()


# Where decoder layers live in the models users bring: causal LMs, multimodal wrappers, GPT-style and encoder-decoder.
DECODER_LAYER_PATHS = (
    "model.layers",
    "model.language_model.layers",
    "language_model.model.layers",
    "language_model.layers",
    "model.text_model.layers",
    "text_model.layers",
    "model.decoder.layers",
    "transformer.h",
)


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's decoder layer list, found by the usual paths, else by its length (num_hidden_layers)."""
    for path in DECODER_LAYER_PATHS:
        module = model
        for name in path.split("."):
            module = getattr(module, name, None)
            if module is None:
                break
        if isinstance(module, nn.ModuleList):
            return module
    expected = model.config.get_text_config(decoder=True).num_hidden_layers
    candidates = [m for _, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == expected]
    if len(candidates) == 1:
        return candidates[0]
    raise ValueError(
        f"Could not find the decoder layers of {type(model).__name__}: none of {', '.join(DECODER_LAYER_PATHS)} exists "
        f"and {len(candidates)} ModuleLists have num_hidden_layers={expected} entries. Set `draft.capture_mode` and "
        "capture the layers yourself, or report the model layout."
    )


FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_norm", "ln_f")


def find_final_norm(model: nn.Module, layers: nn.ModuleList) -> nn.Module:
    """The norm applied after the decoder layers: a sibling of the layer list under one of the usual names."""
    for _, parent in model.named_modules():
        if any(child is layers for child in parent.children()):
            for name in FINAL_NORM_NAMES:
                if isinstance(getattr(parent, name, None), nn.Module):
                    return getattr(parent, name)
    raise ValueError(
        f"The draft reads the last decoder layer, whose state transformers reports after the final norm, but no final "
        f"norm ({', '.join(FINAL_NORM_NAMES)}) sits beside the layers of {type(model).__name__}."
    )


def execution_device(module: nn.Module) -> torch.device:
    """Where a module computes: accelerate's execution device if dispatched, else where its weights are."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    for param in module.parameters():
        if param.device.type != "meta":
            return param.device
    return torch.device("cpu")


CROPPABLE_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def check_target_cache_croppable(target: PreTrainedModel) -> None:
    """Speculation rolls the target's cache back after each verify; recurrent layers cannot be rolled back."""
    layer_types = getattr(target.config.get_text_config(decoder=True), "layer_types", None) or []
    recurrent = sorted({t for t in layer_types if t not in CROPPABLE_LAYER_TYPES})
    if getattr(target, "_is_stateful", False) or recurrent:
        raise ValueError(
            f"{type(target).__name__} keeps recurrent state ({', '.join(recurrent) or 'stateful model'}) that cannot be "
            "cropped back after a rejected draft, so block speculation cannot be lossless on it. Generate without "
            "`assistant_model`."
        )


def lookup_continuation(ids: torch.Tensor, max_ngram: int, min_ngram: int, num_tokens: int) -> torch.Tensor:
    """Prompt-lookup candidates for the one sequence in `ids` [1, T]: the tokens that followed an earlier occurrence of
    its last n tokens, trying n from `max_ngram` down to `min_ngram`; empty when none occurred. Of the occurrences, the
    most recent one among those followed by the most tokens (up to `num_tokens`): inside a run that repeats itself
    ("0 0 0 ...", indentation) the latest occurrence ends right before the sequence does and has one token to give."""
    row = ids[0]
    length = row.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = row[:-1].unfold(0, n, 1)  # every n-gram ending before the last token
        hits = (windows == row[-n:]).all(1).nonzero()[:, 0]
        if len(hits):
            follows = (length - (hits + n)).clamp(max=num_tokens)
            start = int(hits[follows == follows.max()][-1]) + n
            return row[start : start + num_tokens]
    return row[:0]


def _new_stats() -> dict:
    return {
        "acceptance_lengths": [],
        "proposals": [],  # per verify step, the drafted ids; the first acceptance_lengths[i] - 1 were accepted
        "mean_acceptance_length": 0.0,
        "drafted_tokens": 0,
        "accepted_tokens": 0,
        "target_forwards": 0,
        "draft_forwards": 0,
        "looked_up": [],  # per verify step, whether its candidates came from prompt lookup instead of the draft
        # per verify step, the length policy's choice: k proposed (0 = a plain decode step), from which source,
        # the expected emitted tokens and the estimated seconds it weighed, and whether it was a forced probe
        "policy": [],
        # at the end of the call, the measured costs the policy weighs (`MeasuredCosts.estimates_ms`)
        "cost_estimates_ms": {},
        "time_s": {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "total": 0.0},
        "kernels": "torch",
        "nonfinite_steps": 0,  # steps whose draft logits held NaN or inf: decoded without the draft
    }


# Prompt lookup beside a draft: n-grams tried, longest first (a longer match is likelier to go on as before). A
# one-token match is too weak to displace a block.
LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM = 5, 2


@dataclass
class DraftSettings:
    """What a generate call drafts with, read from the draft and the call's generation config."""

    device: torch.device
    block_size: int  # ids per drafted block (anchor included), `dflash_block_size` or the draft's
    max_slots: int  # tokens one block can propose
    confidence_threshold: float | None  # DSpark's stop threshold under the fixed policy
    policy: LengthPolicy


def prepare_draft(draft, target: PreTrainedModel, generation_config, batch: int = 1) -> DraftSettings:
    """Check that the draft can serve this target, place it beside the target's last layer, bind it, and read the
    call's drafting settings: shared by the one-sequence generator and the batched loop."""
    check_draft_fits_target(draft.config, target.config)
    check_target_cache_croppable(target)
    if target.device.type == "meta":
        raise ValueError(
            "The target's input embedding is offloaded to disk (target.device is meta), which transformers' "
            "assisted generation cannot run with: keep the embedding on a real device in your device_map."
        )
    layers = find_decoder_layers(target)
    if draft.place_with_target:  # beside the last decoder layer, where the states are freshest
        device = execution_device(layers[-1])
        if draft.fc.weight.device != device:
            draft.to(device)
    draft.bind_target(target)  # may raise: before any hook goes on the target
    device = draft.fc.weight.device
    threshold = getattr(generation_config, "dspark_confidence_threshold", None)
    block_size = getattr(generation_config, "dflash_block_size", None) or draft.config.block_size
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"`dflash_block_size` = {block_size!r}; expected an integer >= 2 (anchor + slots).")
    max_slots = block_size - (draft.config.block_size - draft.config.num_speculative_slots)
    # Measured costs and acceptance are kept per target, device, dtype, thread count and draft for the process.
    key = (id(target), id(draft), str(device), str(draft.fc.weight.dtype), torch.get_num_threads())
    policy = LengthPolicy(measured_costs(key, (target, draft)), max_slots,
                          getattr(generation_config, "dflash_policy", None) or "auto", batch)
    return DraftSettings(device, block_size, max_slots,
                         threshold if threshold is not None else draft.confidence_threshold, policy)


class DFlashCandidateGenerator(CandidateGenerator):
    """Drafts one block per step from the target's captured hidden states, on transformers' assisted decoding.

    The target's verification forward captures only `target_layer_ids` (`model_kwargs_overrides`); each step keeps the
    newly verified tokens' states, lets the length policy choose how many tokens to propose (looked up, drafted, or
    none: a plain decode step), and hands the draft every state it has not read yet when it drafts. One generator per
    generate call: it holds that call's context cache, capture, policy state and books (`stats`).
    """

    requires_model_outputs = True

    def __init__(self, draft, target: PreTrainedModel, generation_config, logits_processor=None,
                 input_ids: torch.Tensor | None = None):
        if input_ids is not None and input_ids.shape[0] != 1:
            raise ValueError(
                f"DFlashCandidateGenerator drafts for one sequence (got batch size {input_ids.shape[0]}); "
                "`target.generate(assistant_model=draft)` runs batches through the batched loop."
            )
        settings = prepare_draft(draft, target, generation_config)
        self.draft = draft
        self.device = settings.device
        self.cache = draft.new_context_cache()
        self.num_context = 0  # verified tokens whose states were captured (in the draft's cache, or pending)
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor if logits_processor else None
        self.confidence_threshold = settings.confidence_threshold
        self.block_size, self.max_slots, self.policy = settings.block_size, settings.max_slots, settings.policy
        self.max_length = generation_config.max_length
        self.pending: list[torch.Tensor] = []  # verified tokens' states the draft has not read yet
        self._step = None  # (source, proposed, forced probe) of the step being verified
        # `prompt_lookup_num_tokens` alongside the draft: where the sequence's last LOOKUP_MIN_NGRAM ..
        # max_matching_ngram_size (default LOOKUP_MAX_NGRAM) tokens occurred before (code repeating its prompt, say),
        # the tokens that followed are tried instead of a block.
        self.lookup_tokens = generation_config.prompt_lookup_num_tokens or 0
        self.lookup_ngram = generation_config.max_matching_ngram_size or LOOKUP_MAX_NGRAM
        eos = getattr(generation_config, "_eos_token_tensor", None)
        self.eos_ids = set() if eos is None else {int(e) for e in eos.flatten()}
        self.stats = _new_stats()
        # A streamer with `put_candidates(ids: list[int], looked_up: bool)` hears each step's candidates before the
        # target verifies them (the demo colours accepted tokens by source); the hook hands over the call's streamer.
        self.streamer = None
        # Last: the only step that changes the target (hooks in "hooks" mode).
        self.capture = TargetStateCapture(target, draft.config.target_layer_ids, draft.capture_mode)
        self.model_kwargs_overrides = self.capture.model_kwargs_overrides
        if generation_config.output_hidden_states:
            # The caller asked for every layer's states: leave the request alone (the chosen ones are among them);
            # narrowing it to our layers would hand `generate` a tuple its bookkeeping cannot slice.
            self.model_kwargs_overrides = {}
        self._start = self._last_return = time.perf_counter()
        self._last_length = None  # sequence length when we last returned candidates

    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False,
                       n_last_matches=0, **kwargs):
        now = time.perf_counter()
        set_verifying(False)  # the verify of the last candidates has run; the draft's forwards are not verifies
        self._account_verify(input_ids.shape[1], now)
        if is_first_iteration:
            self._last_return = time.perf_counter()
            return input_ids, None
        fresh = input_ids.shape[1] - 1 - self.num_context
        self.pending.append(self.capture.states(model_outputs, fresh, self.device))
        self.num_context += fresh
        budget = self.max_length - input_ids.shape[1] - 1
        if budget > 0:
            looked_up = self._lookup(input_ids, budget)
            if looked_up is not None:
                k, expected, seconds = self.policy.choose("lookup", looked_up.shape[1], None)
                if k:
                    return self._propose(input_ids, looked_up[:, :k], None, now, "lookup", expected, seconds)
        slots, probe = self.policy.plan_draft("draft")
        slots = min(slots, max(budget, 0))
        if not slots:
            return self._propose(input_ids, input_ids[:, :0], None, now, None, 1.0, None)
        proposal = self.draft.propose(
            self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending, dim=1),
            input_ids[:, -1].to(self.device),
            self.cache,
            prefix_ids=input_ids.to(self.device) if self.logits_processor else None,
            logits_processor=self.logits_processor,
            do_sample=self.do_sample,
            need_logits=self.do_sample,
            confidence_threshold=None if self.policy.adaptive else self.confidence_threshold,
            block_size=self.block_size,
            max_slots=slots,
        )
        self.pending.clear()
        self.stats["draft_forwards"] += 1
        if not proposal.finite:
            note_nonfinite_draft(self.draft, self.stats)
            return self._propose(input_ids, input_ids[:, :0], None, now, None, 1.0, None)
        drafted = time.perf_counter() - now
        self.policy.observe_draft("draft", slots, drafted)
        confidence = None
        if proposal.confidence is not None and self.policy.adaptive:
            confidence = proposal.confidence[0].tolist()
        k, expected, seconds = self.policy.choose("draft", proposal.draft_ids.shape[1], confidence)
        if probe:
            k = max(k, 1)
        draft_ids = proposal.draft_ids[:, :k].to(input_ids.device)
        logits = None
        if proposal.draft_logits is not None and draft_ids.shape[1]:
            logits = proposal.draft_logits[:, : draft_ids.shape[1]].to(input_ids.device)
        return self._propose(input_ids, draft_ids, logits, now, "draft", expected, seconds, probe)

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens one step can propose: a block's slots, or the prompt-lookup length when larger
        (transformers >= 5.25 keeps that many recurrent states of a stateful target's cache for rollback)."""
        return max(self.max_slots, self.lookup_tokens)

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        pass

    def _propose(self, input_ids, candidate_ids, logits, now: float, source: str | None, expected: float,
                 seconds: float | None, probe: bool = False):
        """Book a step's candidates (drafted, looked up, or none: a decode step) and hand them to `generate`."""
        proposed = candidate_ids.shape[1]
        self._step = (source if proposed else None, proposed, probe)
        self.stats["drafted_tokens"] += proposed
        self.stats["proposals"].append(candidate_ids[0])  # tensors until `finish`: no host sync per step
        self.stats["looked_up"].append(source == "lookup")
        self.stats["policy"].append({"k": proposed, "source": source or "decode",
                                     "expected_tokens": expected,
                                     "estimated_ms": None if seconds is None else 1000 * seconds, "probe": probe})
        if hasattr(self.streamer, "put_candidates"):
            self.streamer.put_candidates(candidate_ids[0].tolist(), source == "lookup")
        self._last_return = time.perf_counter()
        self.stats["time_s"]["draft"] += self._last_return - now
        if not proposed:
            return input_ids, None
        set_verifying(True)  # the target's next forward verifies these (`verify_matmul`)
        return torch.cat([input_ids, candidate_ids], dim=1), logits

    def _lookup(self, input_ids: torch.Tensor, budget: int) -> torch.Tensor | None:
        """Prompt-lookup candidates [1, n] (cut before any EOS and to the length budget; a slice of `input_ids`), or
        None to draft a block."""
        if not self.lookup_tokens:
            return None
        found = lookup_continuation(input_ids, self.lookup_ngram, LOOKUP_MIN_NGRAM, min(self.lookup_tokens, budget))
        for i, token in enumerate(found.tolist()):
            if token in self.eos_ids:
                found = found[:i]
                break
        return found[None] if found.shape[0] else None

    def _account_verify(self, length: int, now: float) -> None:
        """Book the target forward that ran since our last return (the prefill first), what it emitted, and what it
        teaches the policy (the cost of that many rows, the acceptance of the proposals' source)."""
        if self._last_length is not None:
            phase = "prefill" if self.stats["target_forwards"] == 0 else "verify"
            seconds = now - self._last_return
            self.stats["time_s"][phase] += seconds
            self.stats["target_forwards"] += 1
            if phase == "verify":
                emitted = length - self._last_length
                self.stats["acceptance_lengths"].append(emitted)
                self.stats["accepted_tokens"] += emitted - 1
                source, proposed, probe = self._step
                self.policy.record(source, proposed, emitted - 1, probe, seconds)
        self._last_length = length

    def finish(self, sequences: torch.Tensor) -> dict:
        """Close the books after `generate` returns: the last verify step and the totals."""
        self.capture.close()
        self._account_verify(sequences.shape[1], time.perf_counter())
        lengths = self.stats["acceptance_lengths"]
        self.stats["mean_acceptance_length"] = sum(lengths) / len(lengths) if lengths else 0.0
        self.stats["proposals"] = [ids.tolist() for ids in self.stats["proposals"]]
        self.stats["time_s"]["total"] = time.perf_counter() - self._start
        self.stats["kernels"] = self.draft.kernel_label
        self.stats["cost_estimates_ms"] = self.policy.costs.estimates_ms()
        return self.stats


# ----------------------------------------------------------------------------------------------------------------------
# The generate hook
# ----------------------------------------------------------------------------------------------------------------------

class _GenerateCall:
    """What one `_assisted_decoding` call with a block drafter made, found by the hook through `_current_call`
    (context variables are per thread, so concurrent calls never see each other's)."""

    def __init__(self, streamer):
        self.streamer = streamer
        self.generators: list[DFlashCandidateGenerator] = []


_current_call: contextvars.ContextVar = contextvars.ContextVar("dflash_generate_call", default=None)

# The private transformers methods the hook wraps, with the parameters it relies on; checked at install, so a
# release that renames them fails loudly at import instead of silently bypassing the draft. docs/transformers_patches.md
# says why each is needed and what upstream change would remove it.
PATCHED_METHODS = {
    # The candidate-generator factory: returns the draft's own generator (B = 1, on transformers' assisted loop).
    "_get_candidate_generator": ("generation_config", "input_ids", "inputs_tensor", "logits_processor",
                                 "model_kwargs", "assistant_model"),
    # The assisted decoding method: B > 1 goes to the batched loop; B = 1 runs transformers' own loop inside the
    # call's scope (verify matmuls, the capture's hooks removed whatever raised, the call's stats handed back).
    "_assisted_decoding": ("input_ids", "logits_processor", "stopping_criteria", "generation_config", "streamer",
                           "assistant_model"),
}


# Our generation settings. They become `GenerationConfig` class attributes (default None), so that
# `GenerationConfig.update` (public: it takes the kwargs that match existing attributes) takes them from `generate`
# keyword arguments (`generate(..., dflash_policy="fixed")`) as it takes transformers' own.
GENERATION_SETTINGS = ("dflash_policy", "dflash_block_size", "dspark_confidence_threshold", "dflash_verify_matmul")


def _is_block_drafter(model) -> bool:
    return getattr(model, "_is_dflash_block_drafter", False)


def check_patchable(mixin=GenerationMixin, config_class=GenerationConfig) -> None:
    """Raise, naming the transformers version and the method, when a method the hook wraps is missing or lost a
    parameter, or when `GenerationConfig.update` no longer takes our settings."""
    import transformers

    problems = []
    for name, params in PATCHED_METHODS.items():
        method = getattr(mixin, name, None)
        if method is None:
            problems.append(f"`GenerationMixin.{name}` is missing")
            continue
        method = getattr(method, "__wrapped__", method)
        missing = [p for p in params if p not in inspect.signature(method).parameters]
        if missing:
            problems.append(f"`GenerationMixin.{name}` has no parameter(s) {', '.join(missing)}")
    update = getattr(config_class, "update", None)
    if update is None or "kwargs" not in inspect.signature(update).parameters:
        problems.append("`GenerationConfig.update` takes no keyword arguments")
    if problems:
        raise RuntimeError(
            f"dflash: transformers {transformers.__version__} changed the generation API the `generate` hook wraps "
            f"({'; '.join(problems)}); install a supported release (see the package's `transformers` range)."
        )


def install_generate_hook() -> None:
    """Make `target.generate(..., assistant_model=draft)` use the draft's own candidate generator (B = 1) or the
    batched loop (B > 1), and take our generation settings (`GENERATION_SETTINGS`) as keyword arguments.

    Called by `import dflash_hf` and by every draft's constructor (so remote-code drafts install it too).
    Idempotent: the first installer wins, whichever copy of this module it came from, since the dispatch goes through
    the draft's own `make_candidate_generator`. Every other assistant type, and `speculation_type="dflash"`, keep
    transformers' own behaviour.
    """
    if getattr(GenerationMixin._get_candidate_generator, "_dflash_hook", False):
        return
    check_patchable()
    for name in GENERATION_SETTINGS:
        if not hasattr(GenerationConfig, name):
            setattr(GenerationConfig, name, None)
    original_get = GenerationMixin._get_candidate_generator
    original_assisted = GenerationMixin._assisted_decoding

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, *args, **kwargs):
        if _is_block_drafter(assistant_model) and getattr(generation_config, "speculation_type", None) != "dflash":
            generator = assistant_model.make_candidate_generator(self, generation_config, logits_processor, input_ids)
            call = _current_call.get()
            if call is not None:
                call.generators.append(generator)
                generator.streamer = call.streamer
            return generator
        return original_get(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                            assistant_model, *args, **kwargs)

    def _assisted_decoding(self, input_ids, *args, assistant_model=None, **kwargs):
        if not _is_block_drafter(assistant_model):
            return original_assisted(self, input_ids, *args, assistant_model=assistant_model, **kwargs)
        matmuls = verify_matmuls(self, getattr(kwargs.get("generation_config"), "dflash_verify_matmul", None))
        if input_ids.shape[0] > 1:
            with matmuls:
                return _batched(self, input_ids, *args, assistant_model=assistant_model, **kwargs)
        call = _GenerateCall(kwargs.get("streamer"))
        token = _current_call.set(call)
        try:
            with matmuls:
                result = original_assisted(self, input_ids, *args, assistant_model=assistant_model, **kwargs)
        finally:
            _current_call.reset(token)
            for generator in call.generators:
                generator.capture.close()  # never leave hooks on the target, even when generation raised
        if call.generators:
            stats = call.generators[-1].finish(result if isinstance(result, torch.Tensor) else result.sequences)
            assistant_model.generation_stats = stats  # the last finished call's, for convenience
            if not isinstance(result, torch.Tensor):
                result.generation_stats = stats  # this call's, whatever other threads finish meanwhile
        return result

    def _batched(self, input_ids, *args, assistant_model, generation_config, **kwargs):
        """B > 1: our own loop (transformers' assisted decoding takes one sequence)."""
        settings = prepare_draft(assistant_model, self, generation_config, batch=input_ids.shape[0])
        capture = TargetStateCapture(self, assistant_model.config.target_layer_ids, assistant_model.capture_mode)
        try:
            result, stats = batched_speculation(self, input_ids, *args, generation_config=generation_config,
                                                assistant_model=assistant_model, settings=settings, capture=capture,
                                                **kwargs)
        finally:
            capture.close()
        assistant_model.generation_stats = stats
        if not isinstance(result, torch.Tensor):
            result.generation_stats = stats
        return result

    for name, wrapper in (("_get_candidate_generator", _get_candidate_generator),
                          ("_assisted_decoding", _assisted_decoding)):
        wrapper._dflash_hook = True
        wrapper.__wrapped__ = getattr(GenerationMixin, name)
        setattr(GenerationMixin, name, wrapper)


__all__ = [
    "DFlashCandidateGenerator",
    "LOOKUP_MAX_NGRAM",
    "LOOKUP_MIN_NGRAM",
    "TargetStateCapture",
    "check_draft_fits_target",
    "check_patchable",
    "find_decoder_layers",
    "install_generate_hook",
    "lookup_continuation",
]
