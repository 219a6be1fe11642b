"""`dflash-hf upload`: the dry-run folders are exactly what a Hub user gets, and they work on their own.

The model repo loads with transformers alone (in a process where `import dflash_hf` fails) and generates the target's
own tokens; the kernel repo loads with `kernels.get_local_kernel`; the Space has a valid header and its app builds from
its own folder; a failed upload is one clear line, never a traceback; the static files ship as package data.
"""

import fnmatch
import importlib.resources
import json
import os
import socket
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard, SpaceCard
from packaging.requirements import Requirement

from dflash_hf import DFLASH2_CODE_FILES, REMOTE_CODE_FILES, hub_upload
from dflash_hf.cli import main as cli_main
from dflash_hf.kernels import hub as kernel_hub
from tiny_pair import save_tiny_pair

REPO_ROOT = Path(__file__).resolve().parents[1]
BLOCK_DFLASH_HF = "import sys; sys.modules['dflash_hf'] = None  # any `import dflash_hf` now raises ImportError\n"


def _front_matter(readme: Path) -> dict:
    text = readme.read_text()
    assert text.startswith("---\n"), "a Hub README must open with a YAML block"
    header, _, _ = text[4:].partition("\n---\n")
    return yaml.safe_load(header)


def _isolated_python(script: str, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    """Run `script` in a fresh interpreter with a private HF cache and no Hub access."""
    environment = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1",
                   "HF_MODULES_CACHE": str(tmp_path / "modules"), "TOKENIZERS_PARALLELISM": "false", **env}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment,
                          cwd=tmp_path, timeout=600)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"), agreeable=True)


@pytest.fixture(scope="module")
def model_repo(pair, tmp_path_factory):
    bench = tmp_path_factory.mktemp("bench") / "bench.json"
    # The shape `dflash-hf bench --json` writes (dflash_hf.bench.build_report), cut to what the card reads.
    bench.write_text(json.dumps({
        "schema": "dflash-hf-bench",
        "machine": {"cpu": "test CPU", "cuda": False},
        "settings": {"dataset": {"name": "mt-bench", "samples": 80}, "max_new_tokens": 128,
                     "models": {"target": "me/tiny-target"}},
        "paths": {"baseline": {"status": "ok", "tau": 1.0, "tokens_per_s": 10.0},
                  "dflash_hf": {"status": "ok", "tau": 3.25, "speedup": 1.75, "tokens_per_s": 17.5}},
    }))
    out = tmp_path_factory.mktemp("model_repo") / "repo"
    code = cli_main(["upload", "model", str(pair[1]), "--repo-id", "me/tiny-dflash", "--bench-json", str(bench),
                     "--dry-run", str(out)])
    assert code == 0
    return out


def test_model_repo_has_code_weights_and_card(model_repo):
    files = sorted(p.name for p in model_repo.iterdir())
    assert files == sorted(["README.md", "config.json", "model.safetensors", *REMOTE_CODE_FILES])
    config = json.loads((model_repo / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_dflash.DFlashDraftModel"
    assert config["auto_map"]["AutoConfig"] == "configuration_dflash.DFlashConfig"
    # The remote-code files are the package's own bytes (one source).
    for name in REMOTE_CODE_FILES:
        assert (model_repo / name).read_bytes() == (REPO_ROOT / "src" / "dflash_hf" / name).read_bytes()
    meta = _front_matter(model_repo / "README.md")
    # The Hub client's own parser reads the same header.
    assert ModelCard.load(model_repo / "README.md").data.base_model == meta["base_model"]
    assert meta["library_name"] == "transformers"
    assert meta["base_model"] == "me/tiny-target"  # taken from the bench report when --base-model is absent
    assert meta["pipeline_tag"] == "text-generation"
    assert meta["license"] == "apache-2.0"
    assert "dflash" in meta["tags"] and "speculative-decoding" in meta["tags"]
    card = (model_repo / "README.md").read_text()
    assert "| 3.25 |" in card and "1.75x" in card and "mt-bench (80 prompts)" in card
    assert "trust_remote_code=True" in card
    assert "vllm serve me/tiny-target" in card and '"method": "dflash"' in card
    assert "--to speculators" in card and "--to zlab" in card and "sglang.launch_server" in card
    assert "$" not in card.replace("$ ", ""), "an unfilled template field is left in the card"


def _standalone_generation(repo: Path, target_dir: Path, tmp_path: Path) -> dict:
    """Load the repo with transformers alone (dflash_hf unimportable), generate greedily with and without it, and
    return what happened."""
    script = BLOCK_DFLASH_HF + textwrap.dedent(f"""
        import json
        try:
            import dflash_hf
        except ImportError:
            pass
        else:
            raise SystemExit("dflash_hf is importable: this process would not prove the repo stands alone")
        import torch
        from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

        target = AutoModelForCausalLM.from_pretrained({str(target_dir)!r}).eval()
        tokenizer = AutoTokenizer.from_pretrained({str(target_dir)!r})
        draft = AutoModel.from_pretrained({str(repo)!r}, trust_remote_code=True).eval()
        results = {{"module": type(draft).__module__, "prompts": []}}
        for prompt in ["Hello world", "abc", "The quick brown fox"]:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            plain = target.generate(ids, max_new_tokens=24, do_sample=False)
            spec = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft)
            results["prompts"].append({{"identical": torch.equal(plain, spec), "new": plain.shape[1] - ids.shape[1],
                                        "lengths": draft.generation_stats["acceptance_lengths"]}})
        print(json.dumps(results))
    """)
    done = _isolated_python(script, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_model_repo_loads_with_transformers_alone_and_is_exact(model_repo, pair, tmp_path):
    results = _standalone_generation(model_repo, pair[0], tmp_path)
    assert results["module"].startswith("transformers_modules"), results["module"]
    for row in results["prompts"]:
        assert row["identical"], row
        assert row["new"] == 24
        assert row["lengths"], "the draft was not used: no verify steps were booked"
    # The agreeable pair accepts drafts, so the remote code really drafted (not just one token per step).
    assert any(n > 1 for row in results["prompts"] for n in row["lengths"])


def test_dflash2_model_repo_has_its_code_card_and_stands_alone(tmp_path):
    """A DFlash 2 draft: its two extra remote-code files, a card naming the kind and the z-lab layout the engines read
    it from, the bench path of its kind, and a repo that loads and drafts with transformers alone."""
    target_dir, draft_dir = save_tiny_pair(tmp_path / "pair", kind="dflash2", agreeable=True)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({
        "schema": "dflash-hf-bench", "settings": {"models": {"target": "me/tiny-target"}},
        "paths": {"baseline": {"status": "ok", "tau": 1.0, "tokens_per_s": 10.0},
                  "dflash_hf": {"status": "ok", "tau": 9.0, "speedup": 9.0},
                  "dflash2_hf": {"status": "ok", "tau": 2.5, "speedup": 1.25, "tokens_per_s": 12.5}},
    }))
    repo = tmp_path / "repo"
    assert cli_main(["upload", "model", str(draft_dir), "--repo-id", "me/tiny-dflash2", "--bench-json", str(bench),
                     "--dry-run", str(repo)]) == 0
    files = sorted(p.name for p in repo.iterdir())
    assert files == sorted(["README.md", "config.json", "model.safetensors", *REMOTE_CODE_FILES, *DFLASH2_CODE_FILES])
    config = json.loads((repo / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_dflash2.DFlash2DraftModel"
    for name in DFLASH2_CODE_FILES:
        assert (repo / name).read_bytes() == (REPO_ROOT / "src" / "dflash_hf" / name).read_bytes()
    meta = _front_matter(repo / "README.md")
    assert "dflash2" in meta["tags"] and meta["base_model"] == "me/tiny-target"
    card = (repo / "README.md").read_text()
    assert card.startswith("---") and "A **DFlash 2** draft" in card and "candidate selector" in card
    assert "| 2.50 |" in card and "1.25x" in card and "| 9.00 |" not in card  # its own path, not the DFlash one
    assert "`configuration_dflash2.py`" in card and "`modeling_dflash2.py`" in card
    assert "--to zlab" in card and '"method": "dflash"' in card and "DFlash2DraftModel" in card
    assert "--to speculators" not in card and "sglang.launch_server" in card
    assert "$" not in card.replace("$ ", ""), "an unfilled template field is left in the card"
    assert hub_upload.draft_kind(hub_upload.load_draft_for_upload(str(draft_dir))) == "dflash2"

    results = _standalone_generation(repo, target_dir, tmp_path)
    assert results["module"].startswith("transformers_modules") and results["module"].endswith("modeling_dflash2")
    for row in results["prompts"]:
        assert row["identical"] and row["new"] == 24 and row["lengths"], row


def test_model_upload_without_network_is_one_clear_line(pair, tmp_path):
    with socket.socket() as probe:  # a local port nobody listens on: the Hub is unreachable, whatever the machine
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-m", "dflash_hf.cli", "upload", "model", str(pair[1]), "--repo-id", "me/tiny-dflash",
         "--base-model", "me/tiny-target"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_TOKEN": "hf_not_a_real_token",
             "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_DOWNLOAD_TIMEOUT": "5", "HF_HUB_ETAG_TIMEOUT": "5"},
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    message = [line for line in done.stderr.splitlines() if line.startswith("dflash-hf upload")]
    assert len(message) == 1 and "Cannot reach the Hugging Face Hub" in message[0], done.stderr[-2000:]


def test_model_upload_refuses_a_non_empty_dry_run_folder(pair, tmp_path, capsys):
    (tmp_path / "old.txt").write_text("left over")
    code = cli_main(["upload", "model", str(pair[1]), "--repo-id", "me/x", "--base-model", "me/t",
                     "--dry-run", str(tmp_path)])
    assert code != 0
    assert "not empty" in capsys.readouterr().err


def test_kernel_repo_loads_with_get_local_kernel(tmp_path):
    out = tmp_path / "kernel_repo"
    assert cli_main(["upload", "kernels", "--repo-id", "me/dflash-kernels", "--dry-run", str(out)]) == 0
    assert any(p.name == "metadata.json" for p in out.glob("build/*/metadata.json")), sorted(out.rglob("*"))
    assert (out / "build.toml").is_file() and (out / "torch-ext" / "dflash_kernels" / "__init__.py").is_file()
    script = BLOCK_DFLASH_HF + textwrap.dedent(f"""
        from pathlib import Path
        import torch
        import kernels

        module = kernels.get_local_kernel(Path({str(out)!r}), backend="cpu")
        missing = [name for name in module.OPS if not callable(getattr(module, name, None))]
        assert not missing, missing
        x, weight = torch.randn(2, 3, 16), torch.randn(16)
        expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))  # RMSNorm, fp32
        torch.testing.assert_close(module.rms_norm(x, weight, 1e-6), expected)
        print("ok", module.__name__)
    """)
    done = _isolated_python(script, tmp_path, TRITON_INTERPRET="1")
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-3000:]


def _package_data_match(pattern: str, name: str) -> bool:
    """setuptools expands package-data globs per path segment: `*` never crosses a `/`."""
    patterns, names = pattern.split("/"), name.split("/")
    return len(patterns) == len(names) and all(map(fnmatch.fnmatchcase, names, patterns))


def test_upload_files_ship_as_package_data():
    """An installed (non-editable) wheel can upload: every static file the uploaders read lives inside the package and
    is matched by a package-data glob of pyproject.toml."""
    with open(REPO_ROOT / "pyproject.toml", "rb") as file:
        globs = tomllib.load(file)["tool"]["setuptools"]["package-data"]["dflash_hf"]
    package = Path(str(importlib.resources.files("dflash_hf")))
    # Bytecode a test run leaves beside app.py is no upload file (the uploaders skip it: SPACE_PACKAGE_IGNORE).
    templates = [p for p in hub_upload.templates_dir().rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    read = {p.relative_to(package).as_posix() for p in [*templates, kernel_hub.BUILD_TOML]}
    assert {"hub_templates/model/README.md", "hub_templates/space/README.md", "hub_templates/space/app.py",
            "hub_templates/kernels/README.md", "kernels/build.toml"} <= read
    assert kernel_hub.CARD_DIR.parent == hub_upload.templates_dir()
    unshipped = [name for name in read if not any(_package_data_match(glob, name) for glob in globs)]
    assert not unshipped, f"not in [tool.setuptools.package-data]: {unshipped}"


def test_space_folder_header_requirements_and_app(pair, tmp_path):
    out = tmp_path / "space"
    code = cli_main(["upload", "space", "--repo-id", "me/dflash-demo", "--target", str(pair[0]),
                     "--draft", str(pair[1]), "--dry-run", str(out)])
    assert code == 0
    meta = _front_matter(out / "README.md")
    card = SpaceCard.load(out / "README.md")  # the Hub client's own parser
    assert (card.data.sdk, card.data.app_file) == ("gradio", "app.py")
    assert meta["sdk"] == "gradio"
    assert meta["app_file"] == "app.py" and (out / "app.py").is_file()
    assert isinstance(meta["python_version"], str) and meta["python_version"].startswith("3.")
    assert isinstance(meta["sdk_version"], str) and meta["sdk_version"].count(".") == 2
    assert "models" not in meta, "local folders are not Hub ids and must not be listed as models"
    requirements = [Requirement(line) for line in (out / "requirements.txt").read_text().split()]
    names = {r.name for r in requirements}
    assert {"transformers", "spaces", "torch"} <= names
    # One source: the Space runs the package's own demo module, not a copy that can drift.
    assert (out / "dflash_hf" / "demo.py").read_bytes() == (REPO_ROOT / "src/dflash_hf/demo.py").read_bytes()
    assert not list(out.rglob("__pycache__"))
    settings = json.loads((out / "demo_settings.json").read_text())
    assert settings == {"target": "models/target", "drafts": ["models/draft-dflash"]}
    # The app builds from the Space folder alone: its own dflash_hf copy and its own model folders.
    script = textwrap.dedent("""
        import app, dflash_hf, gradio
        from pathlib import Path
        assert Path(dflash_hf.__file__).resolve().parent == Path("dflash_hf").resolve(), dflash_hf.__file__
        assert isinstance(app.demo, gradio.Blocks)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=out, timeout=600,
                          env={**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1",
                               "GRADIO_ANALYTICS_ENABLED": "False"})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_bench_report_without_this_kind_is_a_clear_error(tmp_path):
    report = tmp_path / "bench.json"
    report.write_text(json.dumps({"schema": "dflash-hf-bench", "paths": {"baseline": {"status": "ok"}}}))
    with pytest.raises(hub_upload.UploadError, match="no measured `dflash_hf` path"):
        hub_upload.read_bench(report, "dflash")


def test_upload_without_login_says_how_to_log_in(tmp_path, monkeypatch):
    from huggingface_hub import constants

    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-stored-tokens"))
    with pytest.raises(hub_upload.UploadError, match="Not logged in.*hf auth login"):
        hub_upload.push(tmp_path, "me/x", repo_type="model")
