"""Run as a script: dflash-hf where `triton` cannot be imported (macOS, Windows: it ships Linux wheels only), nor
`kernels` where transformers does not require it (transformers >= 5.25 depends on `kernels` and loads every model
through it). Where they are installed, `sys.modules[name] = None` stands in for their absence: `import triton` then
raises ModuleNotFoundError and `importlib.util.find_spec("triton")` is None, as where the package is missing.

It imports the package, loads every draft kind (through the package and as remote code) and checks that B = 1 and
B = 2 greedy generation equals the target alone, on the torch paths. Exit status 0 means all of that held.
"""

import importlib.metadata
import json
import sys
import tempfile
from pathlib import Path


def transformers_requires_kernels() -> bool:
    requirements = importlib.metadata.requires("transformers") or []
    return any(r.startswith("kernels") and "extra ==" not in r for r in requirements)


BLOCKED = ("triton",) if transformers_requires_kernels() else ("triton", "kernels")


def main() -> None:
    print(f"absent: {', '.join(BLOCKED)}")
    for name in BLOCKED:
        sys.modules[name] = None
    import torch
    from transformers import AutoModel
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    import dflash_hf
    from dflash_hf.kernels_dflash import load_kernels
    from tiny import random_dflash, random_dflash2, random_dspark, tiny_target

    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED and sys.modules[m] is not None)
    assert not loaded, f"imported without being asked: {loaded}"
    ids = torch.tensor([[0, 3, 4, 5], [6, 7, 8, 9]])
    mask = (ids != 0).long()
    target = tiny_target("llama", vocab_size=16)
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=10)
    for make in (random_dflash, random_dspark, random_dflash2):
        with tempfile.TemporaryDirectory() as folder:
            make(target, layer_ids=[0, 2], block_size=4).save_pretrained(folder)
            for remote in (False, True):
                if remote:  # the copy of the code saved beside the weights, as a Hub user without the package runs it
                    auto_map = json.loads((Path(folder) / "config.json").read_text())["auto_map"]
                    draft = get_class_from_dynamic_module(auto_map["AutoModel"], folder).from_pretrained(folder)
                else:
                    draft = AutoModel.from_pretrained(folder)
                assert type(draft).__module__.startswith("transformers_modules") == remote, type(draft).__module__
                for rows in (1, 2):
                    out = target.generate(input_ids=ids[-rows:], attention_mask=mask[-rows:], do_sample=False,
                                          max_new_tokens=10, assistant_model=draft, dflash_policy="fixed")
                    assert torch.equal(out, expected[-rows:]), (type(draft).__name__, remote, rows)
                    assert draft.generation_stats["draft_forwards"] > 0
                assert draft.kernel_label == "torch", draft.kernel_label
                print(f"{type(draft).__name__} (remote code: {remote}): exact at B = 1 and 2, torch path")
    try:
        load_kernels("on", torch.device("cpu"))
    except RuntimeError as error:
        assert "DFLASH_KERNELS=1" in str(error), error
    else:
        raise AssertionError("DFLASH_KERNELS=1 without triton must be refused")
    assert dflash_hf.__version__
    print("ok")


if __name__ == "__main__":
    main()
