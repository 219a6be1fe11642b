"""End to end: `dflash-hf demo` on localhost, driven by headless Chromium through Playwright.

The demo runs as the real command on a tiny target/draft saved to folders (fast, offline). A prompt is submitted in
the page; both outputs must appear and be identical (greedy), the speculative side must show tau and coloured tokens.
A screenshot is saved to $DFLASH_DEMO_SCREENSHOT (default /tmp/dflash_hf_demo.png). A browserless test checks the
token colours against the candidate generator's own acceptance books.
"""

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tiny_pair import save_tiny_pair

CHROMIUM = os.environ.get("DFLASH_CHROMIUM", "/usr/bin/chromium")
# Debian Chromium as root, offline: no sandbox, no GPU, and none of the background calls this network refuses.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SCREENSHOT = Path(os.environ.get("DFLASH_DEMO_SCREENSHOT", "/tmp/dflash_hf_demo.png"))
PROMPT = "Hello world"
SERVER_START_S = 240
GENERATION_S = 240


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for_server(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the demo exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    pytest.fail(f"the demo did not answer on {url} within {SERVER_START_S} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def demo_url(tmp_path_factory):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}: `apt-get install -y chromium` (or set DFLASH_CHROMIUM)")
    folder = tmp_path_factory.mktemp("demo")
    target_dir, draft_dir = save_tiny_pair(folder, agreeable=True)
    # The same seeded target again, with a DSpark draft for the switch.
    _, dspark_dir = save_tiny_pair(folder / "dspark", kind="dspark", agreeable=True)
    port = _free_port()
    log = folder / "demo.log"
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1", "HF_HOME": str(folder / "hf"),
           "TOKENIZERS_PARALLELISM": "false"}
    with log.open("w") as sink:
        server = subprocess.Popen(
            [sys.executable, "-m", "dflash_hf.cli", "demo", "--target", str(target_dir), "--draft", str(draft_dir),
             "--draft", str(dspark_dir), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"],
            stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=folder,
        )
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_for_server(url, server, log)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def test_demo_outputs_match_in_the_browser(demo_url, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(demo_url)
            prompt = page.locator("#prompt textarea")
            prompt.fill(PROMPT)
            page.locator("#run").click()
            status = page.locator("#status")
            expect(status).to_contain_text("Done.", timeout=GENERATION_S * 1000)
            target_text = page.locator("#target-output textarea").input_value()
            spec_text = page.locator("#spec-output textarea").input_value()
            spec_stats = page.locator("#spec-stats").inner_text()
            accepted = page.locator("#spec-colored span[style*='#c8f7c5']").count()
            status_text = status.inner_text()
            # The DFlash/DSpark switch: the same prompt through the DSpark draft.
            page.locator("#kind label", has_text="dspark").click()
            page.locator("#run").click()
            expect(status).to_contain_text("dspark, block size", timeout=GENERATION_S * 1000)
            dspark_status = status.inner_text()
            dspark_text = page.locator("#spec-output textarea").input_value()
            # Prompt lookup beside the draft, through its slider.
            lookup_box = page.locator("#lookup-tokens input[type='number']")
            lookup_box.fill("4")
            lookup_box.press("Enter")
            page.locator("#run").click()
            expect(status).to_contain_text("prompt lookup (4 tokens)", timeout=GENERATION_S * 1000)
            lookup_status = status.inner_text()
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)  # the last run: DSpark + prompt lookup
            lookup_text = page.locator("#spec-output textarea").input_value()
        finally:
            browser.close()
    assert target_text.strip(), "the target-alone output never appeared"
    assert spec_text == target_text, "greedy speculative output differs from the target alone"
    assert "Identical to the target alone: yes" in status_text, status_text
    assert "tau" in spec_stats and "speed-up" in spec_stats, spec_stats
    # The agreeable pair accepts drafts: tau > 1 and some tokens are coloured as accepted.
    assert accepted > 0, "no token is coloured as drafted-and-accepted"
    tau = float(spec_stats.split("tau")[1].split()[0].strip("*"))
    assert tau > 1.0, spec_stats
    assert SCREENSHOT.stat().st_size > 0
    assert "Identical to the target alone: yes" in dspark_status, dspark_status
    assert dspark_text == target_text
    assert "Identical to the target alone: yes" in lookup_status, lookup_status
    assert lookup_text == target_text


@pytest.mark.parametrize("lookup", [0, 4])
def test_colours_agree_with_the_generators_books(tmp_path, lookup):
    """Without a browser: per step, the tokens coloured accepted are exactly the generator's accepted count, and in
    the colour of where the step's candidates came from (the draft, or prompt lookup)."""
    import torch

    from dflash_hf.demo import DemoModels, IncrementalDetokenizer, RunView, stream_generation

    target_dir, draft_dir = save_tiny_pair(tmp_path, agreeable=True)
    models = DemoModels.load(str(target_dir), [str(draft_dir)], device="cpu")
    draft = models.drafts["dflash"]
    inputs = models.encode(PROMPT)
    max_new = 30
    settings = {"max_new_tokens": max_new, "do_sample": False, "prompt_lookup_num_tokens": lookup or None}
    view = RunView(IncrementalDetokenizer(models.tokenizer))
    coloured_per_step, stats = [], {}
    for ids, proposal, looked_up in stream_generation(models.target, inputs, settings, draft, stats):
        before = len(view.spans)
        view.add_speculative_step(ids, proposal, max_new, looked_up)
        kinds = [kind for _, kind in view.spans[before:]]
        coloured_per_step.append((kinds.count("accepted"), kinds.count("looked_up")))
    assert stats == draft.generation_stats  # the call's own books, also the draft's last finished call's
    lengths = stats["acceptance_lengths"]
    assert coloured_per_step[0] == (0, 0)  # the prefill's token is the target's own
    assert coloured_per_step[1:] == [(0, n - 1) if from_lookup else (n - 1, 0)
                                     for n, from_lookup in zip(lengths, stats["looked_up"])]
    assert any(n > 1 for n in lengths)
    if lookup:  # the tiny target repeats itself, so some steps look up and some of those are accepted
        assert any(looked for _, looked in coloured_per_step)
    else:
        assert not any(stats["looked_up"])
    assert view.tau == pytest.approx(stats["mean_acceptance_length"])
    plain = models.target.generate(**inputs, max_new_tokens=max_new, do_sample=False)
    assert view.detokenizer.ids == plain[0, inputs["input_ids"].shape[1]:].tolist()
    assert view.text == models.tokenizer.decode(plain[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert torch.equal(plain, models.target.generate(**inputs, max_new_tokens=max_new, do_sample=False,
                                                     assistant_model=draft))


def test_a_dflash2_draft_is_offered_beside_the_others(tmp_path):
    """Without a browser: given a DFlash 2 draft, the demo's switch offers it after DFlash, and it generates the
    target's own tokens."""
    from dflash_hf.demo import DemoModels, build_demo, stream_generation

    target_dir, dflash_dir = save_tiny_pair(tmp_path, agreeable=True)
    _, dflash2_dir = save_tiny_pair(tmp_path / "dflash2", kind="dflash2", agreeable=True)
    models = DemoModels.load(str(target_dir), [str(dflash2_dir), str(dflash_dir)], device="cpu")
    assert list(models.drafts) == ["dflash2", "dflash"] and type(models.drafts["dflash2"]).__name__ == \
        "DFlash2DraftModel"
    demo = build_demo(models=models)
    switch = next(block for block in demo.blocks.values() if getattr(block, "elem_id", None) == "kind")
    assert [choice[0] for choice in switch.choices] == ["dflash", "dflash2"]
    inputs = models.encode(PROMPT)
    stats = {}
    steps = list(stream_generation(models.target, inputs, {"max_new_tokens": 16, "do_sample": False},
                                   models.drafts["dflash2"], stats))
    ids = [token for step_ids, _, _ in steps for token in step_ids]
    plain = models.target.generate(**inputs, max_new_tokens=16, do_sample=False)
    assert ids == plain[0, inputs["input_ids"].shape[1]:].tolist() and stats["acceptance_lengths"]
