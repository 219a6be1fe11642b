"""A tiny target, tokenizer and draft saved to folders, for tests that go through `from_pretrained` by path
(the Hub repo builders, remote-code loading, the demo server) without the network or the real model."""

from pathlib import Path

import torch

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tiny import random_dflash, random_dflash2, random_dspark, tiny_target

SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2 = tiny.py's pad, bos and eos
PRINTABLE = [chr(code) for code in range(32, 127)]
VOCAB_SIZE = 128  # the specials, printable ASCII, then placeholders up to a round size; the mask is the last id


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable character, so any prompt encodes and every id decodes to readable text."""
    tokens = SPECIALS + PRINTABLE
    tokens += [f"<x{i}>" for i in range(VOCAB_SIZE - len(tokens))]
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def make_agreeable(target, draft, tokenizer) -> None:
    """Make the pair accept some drafts, so acceptance (tau > 1, accepted colours) is observable.

    The target's head only knows "a" (+w) and "b" (-w), so it writes a's and b's; the draft's layers add nothing
    (zero output projections), so each slot reads only the mask embedding and proposes one constant letter of the two.
    """
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    with torch.no_grad():
        direction = torch.randn(target.config.hidden_size, generator=torch.Generator().manual_seed(0))
        target.lm_head.weight.zero_()
        target.lm_head.weight[a], target.lm_head.weight[b] = direction, -direction
        for layer in draft.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def save_tiny_pair(folder: Path, kind: str = "dflash", block_size: int = 4,
                   agreeable: bool = False) -> tuple[Path, Path]:
    """(target folder, draft folder) under `folder`: a Llama target with its tokenizer, and a random draft for it."""
    target = tiny_target("llama", vocab_size=VOCAB_SIZE)
    tokenizer = char_tokenizer()
    make = {"dspark": random_dspark, "dflash2": random_dflash2}.get(kind, random_dflash)
    draft = make(target, block_size=block_size)
    if agreeable:
        make_agreeable(target, draft, tokenizer)
    target_dir, draft_dir = Path(folder) / "target", Path(folder) / f"draft-{kind}"
    target.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    draft.save_pretrained(draft_dir)
    return target_dir, draft_dir
