"""dflash-hf: block-diffusion speculative decoding (DFlash, DSpark, DFlash 2) inside Hugging Face transformers.

Importing the package registers the draft configs and models with `AutoConfig`/`AutoModel` and installs the
`generate` hook, so `target.generate(**inputs, assistant_model=draft)` drafts blocks. It also registers the
`row_exact` attention (`EXACT_ATTENTION`), which keeps greedy speculative decoding bit-exact in bfloat16.
"""

from transformers import AutoConfig, AutoModel

from .configuration_dflash import DFlashConfig, DSparkConfig, default_target_layer_ids
from .configuration_dflash2 import DFlash2Config
from .exact_attention import EXACT_ATTENTION
from .formats import export_draft, load_draft
from .generation_dflash import (
    DFlashCandidateGenerator,
    TargetStateCapture,
    check_draft_fits_target,
    install_generate_hook,
)
from .layers_dflash import DFlashContextCache
from .modeling_dflash import DFlashDraftModel, DraftProposal, DSparkDraftModel, check_vocab_mapping
from .modeling_dflash2 import DFlash2DraftModel

__version__ = "0.1.0"

# The Hub remote-code files: `save_pretrained` copies them beside a draft's weights (modeling_dflash.py and its
# flat relative imports), and the repo root holds a symlink to each. A DFlash 2 draft carries the DFLASH2_CODE_FILES
# besides (modeling_dflash2.py imports the others); a DFlash or DSpark draft does not.
REMOTE_CODE_FILES = ("batching_dflash.py", "configuration_dflash.py", "generation_dflash.py", "kernels_dflash.py",
                     "layers_dflash.py", "modeling_dflash.py", "policy_dflash.py", "verify_matmul.py")
DFLASH2_CODE_FILES = ("configuration_dflash2.py", "modeling_dflash2.py")


def _register() -> None:
    for config_class, model_class in (
        (DFlashConfig, DFlashDraftModel), (DSparkConfig, DSparkDraftModel), (DFlash2Config, DFlash2DraftModel)
    ):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModel.register(config_class, model_class, exist_ok=True)
        # `save_pretrained` then writes `auto_map` and copies the two remote-code files beside the weights.
        config_class.register_for_auto_class()
        model_class.register_for_auto_class("AutoModel")


_register()
install_generate_hook()  # what `import dflash_hf` promises; docs/transformers_patches.md lists what it changes

__all__ = [
    "DFLASH2_CODE_FILES",
    "DFlash2Config",
    "DFlash2DraftModel",
    "DFlashCandidateGenerator",
    "DFlashConfig",
    "DFlashContextCache",
    "DFlashDraftModel",
    "DSparkConfig",
    "DSparkDraftModel",
    "DraftProposal",
    "EXACT_ATTENTION",
    "REMOTE_CODE_FILES",
    "TargetStateCapture",
    "check_draft_fits_target",
    "check_vocab_mapping",
    "default_target_layer_ids",
    "export_draft",
    "install_generate_hook",
    "load_draft",
]
