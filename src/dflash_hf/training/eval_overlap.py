"""The guard that keeps evaluation prompts (MT-Bench, HumanEval) and anything close to them out of the training corpus.

Text is compared as lowercase words: an eval text shorter than 8 words must not be contained in a prompt, and a prompt
may not hold a fifth (or, for short texts, any) of an eval text's word 8-grams, which catches copies with a few words
changed or added. Code named like a HumanEval function is rejected outright.
"""

import re

NGRAM = 8
NGRAM_SHARE = 0.2  # a prompt holding this fraction of an eval text's word 8-grams is a near-duplicate of it


def normalized_words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def ngrams(words: list[str], n: int = NGRAM) -> set[tuple]:
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


class EvalOverlap:
    """Flags text that copies or nearly copies an evaluation prompt, and code named like a HumanEval function."""

    def __init__(self, texts: list[str], function_names: set[str]):
        self.function_names = set(function_names)
        self.short = []  # eval texts too short for 8-grams: matched by containment
        self.owners: dict[tuple, list[int]] = {}
        self.sizes = []
        for index, text in enumerate(texts):
            words = normalized_words(text)
            grams = ngrams(words)
            self.sizes.append(len(grams))
            if not grams and len(words) >= 4:
                self.short.append(" " + " ".join(words) + " ")
            for gram in grams:
                self.owners.setdefault(gram, []).append(index)

    @classmethod
    def from_installed(cls) -> "EvalOverlap":
        """MT-Bench turns and HumanEval prompts (whole, and docstrings alone) from their installed packages."""
        from ..bench.datasets import _package_file, _read_jsonl

        texts, names = [], set()
        for row in _read_jsonl(_package_file("mt-bench")):
            texts.extend(row["turns"])
        for row in _read_jsonl(_package_file("humaneval")):
            texts.append(row["prompt"])
            texts.extend(re.findall(r'"""(.*?)"""', row["prompt"], flags=re.S))
            texts.extend(re.findall(r"'''(.*?)'''", row["prompt"], flags=re.S))
            names.add(row["entry_point"])
            names.update(re.findall(r"def\s+(\w+)\s*\(", row["prompt"]))
        return cls([t for t in texts if t], names)

    def reason(self, text: str, function_name: str | None = None) -> str | None:
        """Why `text` may not be used (None: it may)."""
        if function_name and function_name in self.function_names:
            return f"HumanEval function name {function_name!r}"
        words = normalized_words(text)
        joined = " " + " ".join(words) + " "
        for short in self.short:
            if short in joined:
                return f"contains eval text {short.strip()!r}"
        shared: dict[int, int] = {}
        for gram in ngrams(words):
            for owner in self.owners.get(gram, ()):
                shared[owner] = shared.get(owner, 0) + 1
        for owner, count in shared.items():
            if count >= NGRAM_SHARE * self.sizes[owner]:  # one shared 8-gram is enough for an eval text of <13 words
                return f"shares {count} of {self.sizes[owner]} word {NGRAM}-grams with eval text #{owner}"
        return None
