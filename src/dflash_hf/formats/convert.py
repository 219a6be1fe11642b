"""`dflash-hf convert SRC DST [--to hf|speculators|zlab]`: load a draft in any dialect and export it in another."""

import signal
import threading
from contextlib import contextmanager

from .export import EXPORT_FORMATS, _dtype_name, export_draft
from .files import CONFIG_NAME, read_config, resolve_checkpoint
from .load import load_draft
from .read import _verifier_config
from .recognise import SPECULATORS_DIALECTS, detect_dialect


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("convert", help="load a draft in any known format and write it as ours, "
                                                   "speculators or z-lab")
    parser.add_argument("src", help="draft folder or Hub repo id, in any known dialect")
    parser.add_argument("dst", help="output folder (written atomically)")
    parser.add_argument("--to", choices=EXPORT_FORMATS, default="hf",
                        help="hf: our trust_remote_code format (default); speculators: for vLLM and speculators; "
                             "zlab: for vLLM/SGLang (DFlash and DFlash 2)")
    parser.add_argument("--verifier", default=None,
                        help="target id/folder: recorded in speculators exports and read for its layer count "
                             "(default: the source's own verifier, if it names one)")
    parser.add_argument("--num-target-layers", type=int, default=None,
                        help="the target's decoder layer count, for sources that do not record it")
    parser.add_argument("--dtype", default="auto", help="auto (keep the checkpoint's), bfloat16, float16, float32")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.set_defaults(func=run_convert)


@contextmanager
def _sigterm_exits():
    """SIGTERM (a job scheduler's stop, `kill`) raises SystemExit, so `atomic_folder` removes its partial folder
    at once, as on Ctrl-C; Python's default would die without cleaning up. Only the main thread can take signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_now(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_convert(args) -> int:
    with _sigterm_exits():
        return _convert(args)


def _convert(args) -> int:
    folder = resolve_checkpoint(args.src)
    raw = read_config(folder)
    dialect = detect_dialect(raw, str(folder / CONFIG_NAME))
    # A speculators source names its verifier; carry it over unless the user names another.
    verifier = args.verifier or ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    num_target_layers = args.num_target_layers
    if num_target_layers is None and args.verifier and dialect in SPECULATORS_DIALECTS.values():
        verifier_config = _verifier_config(args.verifier, {})
        if verifier_config is not None:
            num_target_layers = (verifier_config.get("text_config") or verifier_config)["num_hidden_layers"]
    model = load_draft(folder, dtype=args.dtype, num_target_layers=num_target_layers)
    export_draft(model, args.dst, args.to, verifier=verifier, overwrite=args.overwrite)
    print(f"{args.src}: {dialect} -> {type(model).__name__} ({_dtype_name(model)}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters) -> {args.dst} ({args.to})")
    return 0
