"""The Gradio demo: the target alone and the target with a DFlash/DSpark/DFlash 2 draft, side by side, streamed.

`dflash-hf demo` runs it locally; the Hub Space (`dflash-hf upload space`) runs this same module from its `app.py`.
Both generations are greedy, so the two texts must match token for token; what differs is tokens/s. The speculative
text is coloured per token from what each verify step emitted and what the draft had proposed for it.
"""

from __future__ import annotations

import html
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from .defaults import DTYPE_HELP, SHIPPED_DRAFTS
from .exact_attention import EXACT_VERIFY_ROWS
from .generation_dflash import LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM

logger = logging.getLogger(__name__)

# The kinds a demo offers, in the order of its switch.
KINDS = tuple(SHIPPED_DRAFTS)

try:  # ZeroGPU Spaces hand out a GPU per call through this decorator; elsewhere generation runs where the models are.
    import spaces

    on_gpu = spaces.GPU
except ImportError:
    def on_gpu(function):
        return function

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number."
DEFAULT_MAX_NEW_TOKENS = 96
# auto: bfloat16 on AMX CPUs (fast there, and kept exact), float32 elsewhere. In half precision the target gets
# row-exact attention (`exact_attention`) so a block verify rounds like a one-token decode and the texts stay identical.
DEFAULT_DTYPE = "auto"
MAX_NEW_TOKENS_LIMIT = 512
BLOCK_SIZE_MIN, BLOCK_SIZE_MAX = 2, 16
LOOKUP_TOKENS_MAX = EXACT_VERIFY_ROWS - 1  # candidates plus the target's own token: a bf16 verify that stays exact
# Tokens decoded before the new one when turning ids into text pieces: enough context for byte-level BPE and
# sentencepiece to render the new token's leading space and multi-byte characters as they appear in the full text.
DETOKENIZE_WINDOW = 6
COLOURS = {  # inline styles: gr.Blocks takes no page CSS since Gradio 6, and inline keeps the Space app unchanged
    "accepted": "background:#c8f7c5;color:#0b3d0b;",
    "looked_up": "background:#fff0b3;color:#4a3b00;",
    "target": "background:#cfe3ff;color:#0a2a5c;",
    "rejected": "color:#b00020;text-decoration:line-through;opacity:0.75;font-size:0.85em;",
}
TEXT_STYLE = "white-space:pre-wrap;overflow-wrap:anywhere;font-family:monospace;line-height:1.6;min-height:6em"
LEGEND = (
    f'<span style="{COLOURS["accepted"]}">drafted and accepted</span> · '
    f'<span style="{COLOURS["looked_up"]}">looked up (prompt lookup) and accepted</span> · '
    f'<span style="{COLOURS["target"]}">from the target (correction or bonus)</span> · '
    f'<span style="{COLOURS["rejected"]}">proposal the target rejected</span>'
)


class StepStreamer(BaseStreamer):
    """Queues each decoding step's new token ids (skipping the prompt), and each step's candidates.

    A text streamer would lose the step boundaries; here one `put` is one target forward: one token for plain
    decoding, the accepted run plus the target's own token for assisted decoding. The draft's generator calls
    `put_candidates` with what a step proposes before the target verifies it.
    """

    def __init__(self):
        self.steps: queue.Queue = queue.Queue()
        self.candidates: queue.Queue = queue.Queue()
        self._prompt_seen = False

    def put_candidates(self, ids: list[int], looked_up: bool) -> None:
        self.candidates.put((ids, looked_up))

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.steps.put(value.reshape(-1).tolist())

    def end(self) -> None:
        self.steps.put(None)


class IncrementalDetokenizer:
    """Text piece per token, such that the pieces concatenate to the decoded text of the whole sequence."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def piece(self, token_id: int) -> str:
        window = self.ids[-DETOKENIZE_WINDOW:]
        before = self._decode(window)
        after = self._decode([*window, token_id])
        self.ids.append(token_id)
        return after[len(before):] if after.startswith(before) else self._decode([token_id])


@dataclass
class RunView:
    """What one streamed generation has produced so far, in the shapes the UI shows."""

    detokenizer: IncrementalDetokenizer
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None
    tokens: int = 0
    verify_steps: int = 0
    text: str = ""
    spans: list[tuple[str, str]] = field(default_factory=list)  # (text piece, COLOURS key)

    @property
    def seconds(self) -> float:
        return (self.finished or time.perf_counter()) - self.started

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tau(self) -> float:
        """Tokens per verify forward; the prefill's single token is not a verify step."""
        return (self.tokens - 1) / self.verify_steps if self.verify_steps else 0.0

    def add_plain_step(self, ids: list[int]) -> None:
        for token_id in ids:
            piece = self.detokenizer.piece(token_id)
            self.text += piece
            self.spans.append((piece, "target"))
        self.tokens += len(ids)

    def add_speculative_step(self, ids: list[int], proposal: list[int] | None, max_new_tokens: int,
                             looked_up: bool = False) -> None:
        """Colour one step: slot k is accepted when the target emitted the proposed token there (drafted, or
        `looked_up` by prompt lookup).

        `proposal` is None for the prefill's token. Slots past the length budget were never sent to the target (the
        candidate generator trims them the same way), so they are not shown as rejected.
        """
        if proposal is not None:
            self.verify_steps += 1
        proposal = (proposal or [])[: max(max_new_tokens - self.tokens - 1, 0)]
        for k, token_id in enumerate(ids):
            piece = self.detokenizer.piece(token_id)
            self.text += piece
            if k < len(proposal) and proposal[k] == token_id:
                self.spans.append((piece, "looked_up" if looked_up else "accepted"))
                continue
            if k < len(proposal):
                rejected = self.detokenizer.tokenizer.decode([proposal[k]], skip_special_tokens=False)
                self.spans.append((rejected, "rejected"))
            self.spans.append((piece, "target"))
        self.tokens += len(ids)

    def html(self) -> str:
        body = "".join(f'<span style="{COLOURS[kind]}">{html.escape(piece)}</span>' for piece, kind in self.spans)
        return (f'<div style="{TEXT_STYLE}">{body}</div>'
                f'<div style="margin-top:0.5em;font-size:0.85em">{LEGEND}</div>')


def stream_generation(target, inputs: dict, settings: dict, draft=None, books: dict | None = None):
    """Run `target.generate` in a thread and yield (step ids, that step's proposal or None, whether prompt lookup made
    it) as they come; with a draft, `books` receives the call's `generation_stats` when it ends.

    A step's tokens reach the streamer only after the candidates they verified were proposed (`put_candidates`).
    """
    streamer = StepStreamer()
    failure: list[BaseException] = []

    def work():
        try:
            extra = {"assistant_model": draft, "return_dict_in_generate": True} if draft is not None else {}
            out = target.generate(**inputs, **settings, **extra, streamer=streamer)
            if draft is not None and books is not None:
                books.update(out.generation_stats)
        except BaseException as error:  # handed to the caller's thread, which reports it in the UI
            failure.append(error)
        finally:
            streamer.end()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        step = 0
        while (ids := streamer.steps.get()) is not None:
            # Step 0 is the prefill's token (no proposal); step j >= 1 was verified against proposal j - 1.
            proposal, looked_up = None, False
            if draft is not None and step > 0:
                proposal, looked_up = streamer.candidates.get_nowait()
            yield ids, proposal, looked_up
            step += 1
    finally:
        thread.join()
    if failure:
        raise failure[0]


class DemoModels:
    """The target, its tokenizer and one draft per kind, loaded once and shared by every request."""

    def __init__(self, target, tokenizer, drafts: dict, notes: dict):
        self.target, self.tokenizer, self.drafts, self.notes = target, tokenizer, drafts, notes

    @classmethod
    def load(cls, target: str | None = None, drafts: list[str] | tuple = (), device: str | None = None,
             dtype: str = DEFAULT_DTYPE):
        from .defaults import load_default_draft, load_target, random_draft_for
        from .formats import load_draft

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        target_model, tokenizer = load_target(target, dtype, device)
        dtype = target_model.dtype
        loaded, notes = {}, {}
        for draft_id in drafts:
            draft = load_draft(draft_id).eval()
            kind = draft.config.model_type if draft.config.model_type in KINDS else "dflash"
            if kind in loaded:
                logger.warning("Two %s drafts given; using %s", kind, draft_id)
            loaded[kind], notes[kind] = draft, f"`{draft_id}`"
        if not drafts:
            for kind in KINDS:
                if target is None:
                    draft, trained = load_default_draft(target_model, kind)
                else:
                    draft, trained = random_draft_for(target_model, kind), False
                loaded[kind] = draft
                notes[kind] = (f"embedded trained {kind} draft" if trained else
                               f"**randomly initialised** {kind} draft (no trained one for this target): expect "
                               "tau near 1 and a slow-down; the output is still the target's own")
        for kind in loaded:
            loaded[kind] = loaded[kind].to(device=device, dtype=dtype)
        return cls(target_model, tokenizer, loaded, notes)

    def encode(self, prompt: str) -> dict:
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": prompt}]
            inputs = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                        return_dict=True)
        else:
            inputs = self.tokenizer(prompt, return_tensors="pt")
        return {name: tensor.to(self.target.device) for name, tensor in inputs.items()}


def _stats_line(view: RunView, speculative: bool) -> str:
    line = f"**{view.tokens}** tokens · **{view.tokens_per_s:.1f}** tokens/s · {view.seconds:.2f} s"
    if speculative:
        line += f" · tau **{view.tau:.2f}** tokens per target forward"
    return line


def build_demo(target: str | None = None, drafts: list[str] | tuple = (), device: str | None = None,
               dtype: str = DEFAULT_DTYPE, models: DemoModels | None = None):
    """The Gradio Blocks app; `target`/`drafts` are Hub ids or folders (default: the embedded SmolLM2 pair)."""
    import gradio as gr

    models = models or DemoModels.load(target, drafts, device, dtype)
    kinds = [kind for kind in KINDS if kind in models.drafts]
    # The slider sets the block size of one request (the drafts are shared); the switch goes back to each draft's own.
    own_block_size = {kind: models.drafts[kind].config.block_size for kind in kinds}

    @on_gpu
    def compare(prompt: str, kind: str, block_size: float, max_new_tokens: float, lookup_tokens: float):
        if not prompt.strip():
            raise gr.Error("Type a prompt first.")
        draft = models.drafts[kind]
        inputs = models.encode(prompt)
        settings = dict(max_new_tokens=int(max_new_tokens), do_sample=False)
        plain = RunView(IncrementalDetokenizer(models.tokenizer))
        spec = RunView(IncrementalDetokenizer(models.tokenizer))
        waiting = "*waiting for the target alone to finish*"
        # One after the other, never together: each gets the whole machine, so the tokens/s are comparable.
        for ids, _, _ in stream_generation(models.target, inputs, settings):
            plain.add_plain_step(ids)
            yield plain.text, _stats_line(plain, False), "", "", waiting, "Generating with the target alone..."
        plain.finished = time.perf_counter()
        speculative = GenerationConfig(**settings, dflash_block_size=int(block_size),
                                       prompt_lookup_num_tokens=int(lookup_tokens) or None)
        stats = {}
        for ids, proposal, looked_up in stream_generation(models.target, inputs,
                                                          {"generation_config": speculative}, draft, stats):
            spec.add_speculative_step(ids, proposal, int(max_new_tokens), looked_up)
            yield (plain.text, _stats_line(plain, False), spec.text, spec.html(), _stats_line(spec, True),
                   f"Generating with the {kind} draft...")
        spec.finished = time.perf_counter()
        identical = plain.detokenizer.ids == spec.detokenizer.ids
        summary = (f"{_stats_line(spec, True)}<br>tau from the generator's own books: "
                   f"**{stats.get('mean_acceptance_length', 0.0):.2f}** · speed-up over the target alone: "
                   f"**{plain.seconds / spec.seconds:.2f}x**")
        looked = (f", prompt lookup ({int(lookup_tokens)} tokens) on {sum(stats['looked_up'])} of "
                  f"{len(stats['looked_up'])} steps" if lookup_tokens else "")
        chosen = " ".join(str(step["k"]) for step in stats["policy"])
        summary += (f"<br>tokens proposed per step (the length policy's choice; 0 = a plain decode step): "
                    f"<code>{chosen}</code>")
        status = (f"Done. Identical to the target alone: **{'yes' if identical else 'NO'}** "
                  f"({spec.tokens} tokens, {kind}, block size {int(block_size)}{looked}).")
        yield plain.text, _stats_line(plain, False), spec.text, spec.html(), summary, status

    with gr.Blocks(title="dflash-hf: block-diffusion speculative decoding") as demo:
        gr.Markdown(
            "## dflash-hf: block-diffusion speculative decoding in transformers\n"
            "The same greedy generation twice: the target alone (left), then the target verifying blocks drafted "
            "by a DFlash, DSpark or DFlash 2 draft (right). The texts must be identical; watch tokens/s and tau."
        )
        gr.Markdown("Drafts: " + "; ".join(f"{kind}: {models.notes[kind]}" for kind in kinds))
        prompt = gr.Textbox(label="Prompt", value=DEFAULT_PROMPT, lines=3, elem_id="prompt")
        with gr.Row():
            kind = gr.Radio(kinds, value=kinds[0], label="Draft", elem_id="kind")
            block_size = gr.Slider(BLOCK_SIZE_MIN, BLOCK_SIZE_MAX, step=1, value=own_block_size[kinds[0]],
                                   label="Block size (anchor + drafted slots)", elem_id="block-size")
            max_new_tokens = gr.Slider(8, MAX_NEW_TOKENS_LIMIT, step=8, value=DEFAULT_MAX_NEW_TOKENS,
                                       label="Max new tokens", elem_id="max-new-tokens")
            lookup_tokens = gr.Slider(0, LOOKUP_TOKENS_MAX, step=1, value=0, label="Prompt lookup tokens (0: off)",
                                      info=f"where the last {LOOKUP_MIN_NGRAM}-{LOOKUP_MAX_NGRAM} tokens occurred "
                                           "before, try what followed them instead of a draft block",
                                      elem_id="lookup-tokens")
        run_button = gr.Button("Generate", variant="primary", elem_id="run")
        status = gr.Markdown("", elem_id="status")
        with gr.Row(equal_height=False):
            with gr.Column():
                gr.Markdown("### Target alone")
                plain_stats = gr.Markdown("", elem_id="target-stats")
                plain_text = gr.Textbox(label="Output", lines=12, interactive=False, elem_id="target-output")
            with gr.Column():
                gr.Markdown("### Target + draft (speculative)")
                spec_stats = gr.Markdown("", elem_id="spec-stats")
                spec_html = gr.HTML("", elem_id="spec-colored")
                spec_text = gr.Textbox(label="Output (plain text)", lines=6, interactive=False, elem_id="spec-output")
        kind.change(lambda k: gr.update(value=own_block_size[k]), kind, block_size)
        outputs = [plain_text, plain_stats, spec_text, spec_html, spec_stats, status]
        # One queue for both triggers: requests share the models (and the draft's block size), so they take turns.
        for trigger in (run_button.click, prompt.submit):
            trigger(compare, [prompt, kind, block_size, max_new_tokens, lookup_tokens], outputs, concurrency_limit=1,
                    concurrency_id="generate")
    return demo


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="the Gradio demo: target alone vs speculative, side by side")
    parser.add_argument("--target", default=None, help="target id or folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--draft", action="append", default=[],
                        help="draft id or folder; repeat to offer several kinds (DFlash, DSpark, DFlash 2)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    parser.add_argument("--dtype", default=DEFAULT_DTYPE, help=DTYPE_HELP)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=7860)
    parser.set_defaults(func=run)


def run(args) -> int:
    demo = build_demo(args.target, args.draft, args.device, args.dtype)
    print(f"dflash-hf demo on http://{args.host}:{args.port} (Ctrl-C stops it)", flush=True)
    demo.queue().launch(server_name=args.host, server_port=args.port, show_error=True)
    return 0
