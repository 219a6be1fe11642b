"""Which dialect a checkpoint speaks, from its config.json alone: the dialect names and the rules that tell them apart."""

from ..configuration_dflash import DFlashConfig, DSparkConfig
from ..configuration_dflash2 import DFlash2Config
from .files import CONFIG_NAME, read_config, resolve_checkpoint

OURS, ZLAB, MODELOPT, ZLAB_DFLASH2 = "dflash-hf", "z-lab", "modelopt", "z-lab-dflash2"
SPECULATORS_DFLASH, SPECULATORS_DSPARK, DEEPSPEC = "speculators-dflash", "speculators-dspark", "deepspec-dspark"
SPECULATORS_DFLASH2 = "speculators-dflash2"
DIALECTS = (OURS, ZLAB, MODELOPT, ZLAB_DFLASH2, SPECULATORS_DFLASH, SPECULATORS_DSPARK, SPECULATORS_DFLASH2, DEEPSPEC)
SPECULATORS_DIALECTS = {"dflash": SPECULATORS_DFLASH, "dspark": SPECULATORS_DSPARK, "dflash2": SPECULATORS_DFLASH2}

ZLAB_ARCHITECTURE = "DFlashDraftModel"
ZLAB_DFLASH2_ARCHITECTURE = "DFlash2DraftModel"  # z-lab `dflash` 0.1.0; speculators' dflash2 configs name it too
DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"


def detect_dialect(config: dict, source: str = CONFIG_NAME) -> str:
    """Which dialect a config.json speaks; raises listing every rule checked when none matches."""
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    speculators_type = config.get("speculators_model_type")
    if model_type in (DFlashConfig.model_type, DSparkConfig.model_type, DFlash2Config.model_type):
        return OURS
    if speculators_type is not None:
        dialect = SPECULATORS_DIALECTS.get(speculators_type)
        if dialect is None:
            raise ValueError(
                f"{source} is a speculators checkpoint of type {speculators_type!r}; only the block drafters "
                f"{', '.join(map(repr, SPECULATORS_DIALECTS))} load here."
            )
        return dialect
    if ZLAB_DFLASH2_ARCHITECTURE in architectures:  # its fields may sit at the top level: no dflash_config needed
        return ZLAB_DFLASH2
    if ZLAB_ARCHITECTURE in architectures and isinstance(config.get("dflash_config"), dict):
        return ZLAB if "auto_map" in config else MODELOPT
    if DEEPSPEC_ARCHITECTURE in architectures and "target_layer_ids" in config:
        return DEEPSPEC
    raise ValueError(
        f"Cannot tell which draft format {source} is. Checked: model_type in ('dflash', 'dspark', 'dflash2') (ours), "
        f"found {model_type!r}; speculators_model_type in {tuple(SPECULATORS_DIALECTS)} (speculators), found "
        f"{speculators_type!r}; architectures containing {ZLAB_DFLASH2_ARCHITECTURE!r} (z-lab DFlash 2) or "
        f"{ZLAB_ARCHITECTURE!r} with a `dflash_config` dict (z-lab with auto_map, NVIDIA "
        f"ModelOpt without), found architectures={architectures} and dflash_config="
        f"{'present' if 'dflash_config' in config else 'absent'}; architectures containing "
        f"{DEEPSPEC_ARCHITECTURE!r} with top-level `target_layer_ids` (DeepSpec), found "
        f"target_layer_ids={'present' if 'target_layer_ids' in config else 'absent'}."
    )


def identify(path_or_repo_id, **hub_options) -> str:
    """The dialect of a checkpoint folder or Hub repo."""
    folder = resolve_checkpoint(path_or_repo_id, **hub_options)
    return detect_dialect(read_config(folder), str(folder / CONFIG_NAME))
