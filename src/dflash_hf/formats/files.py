"""Finding a checkpoint's files: a local folder or a Hub repo, its config.json, and its safetensors with their headers."""

import json
from pathlib import Path

from safetensors import safe_open

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def resolve_checkpoint(path_or_repo_id, *, revision=None, cache_dir=None, token=None, local_files_only=False) -> Path:
    """A local folder as is; anything else is a Hub repo id, fetched (config and safetensors only) into the cache."""
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir():
        return path
    if path.exists() or path.is_absolute() or str(path_or_repo_id).startswith((".", "~")):
        raise FileNotFoundError(f"No checkpoint folder at {path} (expected a folder with {CONFIG_NAME}).")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path_or_repo_id), revision=revision, cache_dir=cache_dir, token=token,
                                  local_files_only=local_files_only, allow_patterns=["*.json", "*.safetensors"]))


def read_config(folder: Path) -> dict:
    config_file = Path(folder) / CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"No {CONFIG_NAME} in {folder}: a draft checkpoint folder needs one.")
    return json.loads(config_file.read_text())


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files holding the weights: the shards an index names, or the single file."""
    folder = Path(folder)
    index = folder / WEIGHTS_INDEX_NAME
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not there: {', '.join(missing)}.")
        return [folder / name for name in shards]
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    candidates = sorted(folder.glob("*.safetensors"))
    if len(candidates) == 1:
        return candidates
    raise FileNotFoundError(
        f"No weights in {folder}: looked for {WEIGHTS_INDEX_NAME}, {WEIGHTS_NAME} or a single *.safetensors file "
        f"(found {[c.name for c in candidates]})."
    )


def tensor_headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """name -> (file, shape, dtype) from the safetensors headers, without reading any tensor data."""
    headers = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                if name in headers:
                    raise ValueError(f"Tensor `{name}` appears in both {headers[name][0].name} and {file.name}.")
                piece = handle.get_slice(name)
                headers[name] = (file, tuple(piece.get_shape()), piece.get_dtype())
    return headers
