"""Hugging Face Space entry point: the `dflash-hf` demo, run from the package copied beside this file.

The Space and `dflash-hf demo` share one source (`dflash_hf/demo.py`); only the model references differ, and they
live in `demo_settings.json`, written by `dflash-hf upload space` (Hub ids, or folders inside this Space).
"""

import json
from pathlib import Path

try:  # ZeroGPU wants `spaces` imported before torch touches CUDA; elsewhere it is absent and not needed.
    import spaces  # noqa: F401
except ImportError:
    pass

from dflash_hf.demo import build_demo

HERE = Path(__file__).resolve().parent


def resolve(reference: str) -> str:
    """A folder shipped inside the Space, or else a Hub id."""
    return str(HERE / reference) if (HERE / reference).is_dir() else reference


settings = json.loads((HERE / "demo_settings.json").read_text())
demo = build_demo(target=resolve(settings["target"]), drafts=[resolve(d) for d in settings["drafts"]])

if __name__ == "__main__":
    demo.queue().launch()
