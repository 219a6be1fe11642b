"""Every draft checkpoint users bring: recognise its dialect, load it as our model, export it for serving engines.

Dialects (REFERENCE.md sections 5 and 9): ours (`model_type` dflash/dspark/dflash2), z-lab (DFlash and DFlash 2),
NVIDIA ModelOpt exports, speculators DFlash, DSpark and DFlash 2, and DeepSpec's flat DSpark configs. Their conventions
differ in layer ids (speculators' aux id `a` is our `a - 1`), config keys, RoPE spelling, anchor layout, vocabulary
maps, the input order of the rnn Markov projection, which draft layers attend causally inside the block, and (DFlash 2)
whether the selector's codebooks carry a `.weight` suffix. All of that is converted once, here, so the model classes
know a single convention.

Loading builds the model on the meta device and assigns the checkpoint's tensors, so a large draft never exists
twice in memory; every check (required config fields, tensor names, shapes, finite values, vocabulary maps, layer
ids) runs before the model is filled, so a bad checkpoint raises and nothing is half-loaded. Exports are written to a
temporary folder beside the destination and renamed into place; one a killed export left behind is removed by the
next export to the same destination (`atomic_folder`).

The modules, in the order a checkpoint goes through them (every public name is importable from here):

- `files`: a local folder or Hub repo as a folder; its config.json, its safetensors files and their headers.
- `recognise`: the dialect names and which one a config.json speaks (`detect_dialect`, `identify`).
- `read`: each dialect's config as our config, and what happens to its tensors on the way in (`plan_load` ->
  `LoadPlan`): required fields, layer ids, RoPE, sliding-window causality, vocabulary maps, codebook spelling.
- `load`: `load_draft`: the tensors checked against the plan, read, and assigned to a model built on meta.
- `export`: `export_draft`: our draft as ours ("hf"), speculators' or z-lab's layout.
- `atomic`: `atomic_folder`, the write-beside-then-rename every export goes through, and the removal of the folders
  killed exports left.
- `convert`: the `dflash-hf convert` command.
"""

from .atomic import FOLDER_MODE, PARTIAL_MARKER, PARTIAL_WRITER, STALE_PARTIAL_SECONDS, atomic_folder
from .convert import add_parser, run_convert
from .export import (
    EXPORT_FORMATS,
    SPECULATORS_ARCHITECTURES,
    SPECULATORS_FORMAT_VERSION,
    export_draft,
    speculators_config,
    speculators_tensors,
    zlab_config,
    zlab_tensors,
)
from .files import (
    CONFIG_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    read_config,
    resolve_checkpoint,
    tensor_headers,
    weight_files,
)
from .load import LOAD_OPTIONS, load_draft
from .read import (
    CODEBOOKS,
    DFLASH2_FIELDS,
    SPECULATORS_DEFAULTS,
    SPECULATORS_PLAIN_VALUES,
    TRAINING_ONLY_TENSORS,
    UNSUPPORTED_DFLASH_CONFIG_KEYS,
    ZLAB_OPTIONAL_FIELDS,
    LoadPlan,
    plan_load,
)
from .recognise import (
    DEEPSPEC,
    DEEPSPEC_ARCHITECTURE,
    DIALECTS,
    MODELOPT,
    OURS,
    SPECULATORS_DFLASH,
    SPECULATORS_DFLASH2,
    SPECULATORS_DIALECTS,
    SPECULATORS_DSPARK,
    ZLAB,
    ZLAB_ARCHITECTURE,
    ZLAB_DFLASH2,
    ZLAB_DFLASH2_ARCHITECTURE,
    detect_dialect,
    identify,
)

__all__ = [
    "CODEBOOKS",
    "CONFIG_NAME",
    "DEEPSPEC",
    "DEEPSPEC_ARCHITECTURE",
    "DFLASH2_FIELDS",
    "DIALECTS",
    "EXPORT_FORMATS",
    "FOLDER_MODE",
    "LOAD_OPTIONS",
    "LoadPlan",
    "MODELOPT",
    "OURS",
    "PARTIAL_MARKER",
    "PARTIAL_WRITER",
    "SPECULATORS_ARCHITECTURES",
    "SPECULATORS_DEFAULTS",
    "SPECULATORS_DFLASH",
    "SPECULATORS_DFLASH2",
    "SPECULATORS_DIALECTS",
    "SPECULATORS_DSPARK",
    "SPECULATORS_FORMAT_VERSION",
    "SPECULATORS_PLAIN_VALUES",
    "STALE_PARTIAL_SECONDS",
    "TRAINING_ONLY_TENSORS",
    "UNSUPPORTED_DFLASH_CONFIG_KEYS",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "ZLAB",
    "ZLAB_ARCHITECTURE",
    "ZLAB_DFLASH2",
    "ZLAB_DFLASH2_ARCHITECTURE",
    "ZLAB_OPTIONAL_FIELDS",
    "add_parser",
    "atomic_folder",
    "detect_dialect",
    "export_draft",
    "identify",
    "load_draft",
    "plan_load",
    "read_config",
    "resolve_checkpoint",
    "run_convert",
    "speculators_config",
    "speculators_tensors",
    "tensor_headers",
    "weight_files",
    "zlab_config",
    "zlab_tensors",
]
