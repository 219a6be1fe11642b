"""The ways of generating a bench compares: the baseline, ours, transformers' built-in DFlash, prompt lookup, z-lab's.

`build_paths` turns a target, its drafts and the run's `BenchSettings` into `BenchPath`s (each a
`generate(input_ids, attention_mask, max_new_tokens)`), and says why any peer it cannot run is skipped.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Both lookup paths propose this many tokens: a verify row costs ~2 ms against a ~70 ms decode step, and a continuation
# that held once tends to hold on (an offline replay of HumanEval problems 0-69 with measured step costs: 16 beat 7 by
# 4-7% with ours). Below `exact_attention.EXACT_VERIFY_ROWS`, so a bf16 verify of the candidates stays exact.
DEFAULT_PROMPT_LOOKUP_TOKENS = 16
WARMUP_NEW_TOKENS = 16

# Path names, in table order. `baseline` must come first: every other path is compared with it.
BASELINE = "baseline"
# The target alone again, timed like any path: its per-prompt ratios are the run's noise floor (a path that decodes
# exactly as the target does scatters as widely), against which the other paths' worst prompts are read.
TARGET_AGAIN = "target_again"
OURS = {"dflash": "dflash_hf", "dspark": "dspark_hf", "dflash2": "dflash2_hf"}
OURS_LOOKUP = {kind: name + "_lookup" for kind, name in OURS.items()}  # the draft plus prompt lookup where it matches
# The speculation-length policies of our paths (`dflash_policy`): `--policy both` runs each of our paths under both,
# the fixed-length one with this suffix.
POLICIES = ("auto", "fixed", "both")
FIXED_SUFFIX = "_fixed"
TRANSFORMERS_DFLASH = "transformers_dflash"
PROMPT_LOOKUP = "prompt_lookup"
ZLAB = "zlab_dflash"


@dataclass
class BenchSettings:
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    prompt_lookup_num_tokens: int = DEFAULT_PROMPT_LOOKUP_TOKENS
    warmup_new_tokens: int = WARMUP_NEW_TOKENS
    policy: str = "auto"
    verify_matmul: str = "auto"  # `dflash_verify_matmul` of our paths
    repeats: int = 1  # runs of every path per turn (interleaved); the fastest is kept
    confidence_threshold: float | None = None  # `dspark_confidence_threshold` of our paths; None: the draft's own

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def apply_to(self, config, policy: str) -> None:
        """Set our generator's settings for this run on a GenerationConfig (they are not its own fields, so
        `update` would drop them)."""
        config.dflash_policy, config.dflash_verify_matmul = policy, self.verify_matmul
        if self.confidence_threshold is not None:
            config.dspark_confidence_threshold = self.confidence_threshold


GenerateFn = Callable[[torch.Tensor, torch.Tensor | None, int], torch.Tensor]


@dataclass
class BenchPath:
    """One way of generating: `generate(input_ids, attention_mask, max_new_tokens)` -> full sequence [1, T].

    `speculative`: False for the target alone (the baseline, `target_again`), which the plots and the loop-overhead
    script leave out. `stats_draft`: a draft whose `generation_stats` (our generator's books) give the draft time;
    otherwise the draft time is what the hooks saw inside draft forwards and the target's lm_head called from outside
    it.
    """

    name: str
    description: str
    generate: GenerateFn
    speculative: bool = True
    stats_draft: torch.nn.Module | None = None


def _hf_kwargs(settings: BenchSettings, pad_token_id) -> dict:
    kwargs = {"do_sample": not settings.greedy, "pad_token_id": pad_token_id}
    if not settings.greedy:
        kwargs["temperature"] = settings.temperature
    return kwargs


def _zlab_draft(draft, target):
    """z-lab's `DFlashDraftModel` holding our DFlash draft's weights, or (None, why not)."""
    try:
        from dflash.model import DFlashDraftModel as ZLabDFlashDraftModel
        from dflash.model import dflash_generate
    except ImportError as error:
        return None, f"the z-lab `dflash` package is not importable ({error}); `pip install --no-deps dflash`"
    from transformers import Qwen3Config

    config = draft.config
    if type(draft).__name__ != "DFlashDraftModel":
        return None, f"z-lab runs plain DFlash drafts, not {type(draft).__name__}"
    if not config.shares_target_embeddings:
        return None, "z-lab drafts borrow the target's embedding and lm_head; this draft has its own"
    if config.target_hidden_size != config.hidden_size:
        return None, (f"z-lab's fc assumes target hidden size == draft hidden size "
                      f"({config.target_hidden_size} != {config.hidden_size})")
    if any(kind != "full_attention" for kind in config.layer_types):
        return None, "z-lab makes sliding-window draft layers causal; ours are bidirectional within the window"
    zlab_config = Qwen3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, hidden_act=config.hidden_act,
        rms_norm_eps=config.rms_norm_eps, rope_parameters=dict(config.rope_parameters),
        max_position_embeddings=config.max_position_embeddings, attention_bias=config.attention_bias,
        num_target_layers=config.num_target_layers, block_size=config.block_size,
        dflash_config={"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)},
    )
    zlab = ZLabDFlashDraftModel(zlab_config).to(dtype=draft.fc.weight.dtype, device=draft.fc.weight.device).eval()
    state = {name: tensor for name, tensor in draft.state_dict().items() if not name.startswith("rotary_emb")}
    missing, unexpected = zlab.load_state_dict(state, strict=False)
    if missing or unexpected:
        return None, f"weights do not map onto z-lab's model (missing {missing}, unexpected {unexpected})"
    return (zlab, dflash_generate), None


def build_paths(target, drafts: dict[str, torch.nn.Module], settings: BenchSettings, pad_token_id=None,
                ) -> tuple[list[BenchPath], dict[str, str], list[torch.nn.Module]]:
    """(paths to run, skipped path -> reason, extra draft modules the hooks must time)."""
    hf = _hf_kwargs(settings, pad_token_id)

    def plain(ids, mask, n):
        return target.generate(ids, attention_mask=mask, max_new_tokens=n, **hf)

    paths = [BenchPath(BASELINE, "target.generate, no draft", plain, speculative=False),
             BenchPath(TARGET_AGAIN, "target.generate again, no draft: the noise floor of the per-prompt ratios",
                       plain, speculative=False)]
    skipped: dict[str, str] = {}
    extra_modules: list[torch.nn.Module] = []

    def ours(draft, policy, **extra):
        # The target's own defaults (EOS, ...), the run's settings and the policy, in one config: transformers
        # deprecates mixing a config with generation arguments.
        config = copy.deepcopy(target.generation_config)
        config.update(**hf, **extra)
        settings.apply_to(config, policy)

        def generate(ids, mask, n):
            call = copy.copy(config)
            call.max_new_tokens = n
            return target.generate(ids, attention_mask=mask, assistant_model=draft, generation_config=call)

        return generate

    lookup = settings.prompt_lookup_num_tokens
    policies = ("auto", "fixed") if settings.policy == "both" else (settings.policy,)
    for names, description, extra in ((OURS, "", {}), (OURS_LOOKUP, f" + prompt lookup ({lookup} tokens) where an "
                                                        "n-gram repeats", {"prompt_lookup_num_tokens": lookup})):
        for policy in policies:
            suffix = FIXED_SUFFIX if settings.policy == "both" and policy == "fixed" else ""
            for kind, draft in drafts.items():
                paths.append(BenchPath(names[kind] + suffix, f"dflash-hf {kind}{description}, {policy} length policy",
                                       ours(draft, policy, **extra), stats_draft=draft))
    dflash_draft = drafts.get("dflash")
    if dflash_draft is None:
        skipped[TRANSFORMERS_DFLASH] = skipped[ZLAB] = "needs a DFlash draft (run with --kind dflash or both)"
    else:
        paths.append(BenchPath(
            TRANSFORMERS_DFLASH, 'transformers built-in speculation_type="dflash", same DFlash weights',
            lambda ids, mask, n: target.generate(ids, attention_mask=mask, max_new_tokens=n,
                                                 assistant_model=dflash_draft, speculation_type="dflash", **hf)))
    paths.append(BenchPath(
        PROMPT_LOOKUP, f"transformers prompt-lookup decoding ({settings.prompt_lookup_num_tokens} tokens; n-gram search counts as other)",
        lambda ids, mask, n: target.generate(ids, attention_mask=mask, max_new_tokens=n,
                                             prompt_lookup_num_tokens=settings.prompt_lookup_num_tokens, **hf)))
    if dflash_draft is not None:
        zlab, reason = _zlab_draft(dflash_draft, target)
        if zlab is None:
            skipped[ZLAB] = reason
        else:
            zlab_model, dflash_generate = zlab
            extra_modules.append(zlab_model)
            eos = target.generation_config.eos_token_id
            stop_ids = None if eos is None else ([eos] if isinstance(eos, int) else list(eos))

            def run_zlab(ids, mask, n):
                if mask is not None and not bool(mask.all()):
                    raise ValueError("z-lab's dflash_generate takes no attention mask; the prompt must not be padded.")
                with warnings.catch_warnings():
                    # z-lab passes `past_key_values=`, which transformers 5.24 still accepts but flags on every call.
                    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
                    return dflash_generate(zlab_model, target, ids, n, stop_ids,
                                           temperature=max(settings.temperature, 0.0),
                                           block_size=dflash_draft.config.block_size)

            paths.append(BenchPath(ZLAB, "z-lab dflash.model.dflash_generate (PyPI dflash), same DFlash weights",
                                   run_zlab))
    return paths, skipped, extra_modules


def keep_paths(paths: list[BenchPath], skipped: dict[str, str], names: list[str] | None,
               ) -> tuple[list[BenchPath], dict[str, str]]:
    """The baseline and the paths `names` asks for (`--paths`); the others reported as skipped, so a long bench can
    run only the rows it is about. An unknown name raises ValueError listing the known ones."""
    if not names:
        return paths, skipped
    known = [path.name for path in paths] + list(skipped)
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"--paths: no path named {', '.join(unknown)} in this run; its paths are {', '.join(known)}")
    wanted = {BASELINE, *names}
    kept = [path for path in paths if path.name in wanted]
    dropped = {path.name: "not asked for (--paths)" for path in paths if path.name not in wanted}
    return kept, {**{name: why for name, why in skipped.items() if name in wanted}, **dropped}
