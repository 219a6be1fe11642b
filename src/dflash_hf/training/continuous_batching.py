"""Decoding many prompts with a batch that is refilled as its rows finish (continuous batching), for the corpus.

`model.generate` on a left-padded batch decodes until its longest row ends, so the rows that ended early ride along
as padding (about 29% of the corpus's decode rows at 256 new tokens). Here a finished row leaves the batch at once and
the next prompt takes its place: it is prefilled alone and its cache joins the others', right-aligned like a
left-padded row, so every row keeps its own positions and an attention mask hides the padding. transformers' own
`generate_batch` does this with paged attention, which on a CPU ran at half the speed of `generate` (36.6 vs 71.2
answer tokens/s, SmolLM2-135M float32, one core, 32 prompts); this keeps SDPA and a `DynamicCache` grown in place.
"""

import inspect
from collections import deque

import torch
from transformers import (DynamicCache, DynamicLayer, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper)


class _GrowingLayer(DynamicLayer):
    """A `DynamicLayer` that appends into spare room at the end of its buffers instead of concatenating (a copy of the
    whole layer every step: a quarter of a CPU decode step at 25 rows of 400 columns); `keys` and `values` are views.
    Keys replaced from outside (a row joins or leaves) are copied into fresh buffers at the next update."""

    spare = 32

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        used, added = (self.keys.shape[-2] if self.keys.numel() else 0), key_states.shape[-2]
        room = getattr(self, "room", None)
        if (room is None or room[0].data_ptr() != self.keys.data_ptr() or room[0].shape[:2] != key_states.shape[:2]
                or room[0].shape[-2] < used + added):
            shape = (*key_states.shape[:2], used + added + self.spare, key_states.shape[-1])
            room = self.room = (key_states.new_empty(shape), value_states.new_empty(shape))
            if used:
                room[0][:, :, :used], room[1][:, :, :used] = self.keys, self.values
        room[0][:, :, used : used + added], room[1][:, :, used : used + added] = key_states, value_states
        self.keys, self.values = room[0][:, :, : used + added], room[1][:, :, : used + added]
        return self.keys, self.values


class _GrowingCache(DynamicCache):
    def __init__(self):
        super().__init__()
        self.layer_class_to_replicate = _GrowingLayer


def _layers(cache: DynamicCache):
    return [layer for layer in cache.layers if layer.is_initialized]


def _left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


class _Batch:
    """The live rows: which prompt each answers, which cache columns it attends to, and the next token to feed."""

    def __init__(self):
        self.cache = _GrowingCache()
        self.prompts: list[int] = []
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.tokens = torch.zeros(0, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.prompts)

    def join(self, prompt: int, cache: DynamicCache, token: int) -> None:
        """Adds a row whose prompt was prefilled into `cache`, right-aligned with the rows already here."""
        length = cache.get_seq_length()
        if not len(self):
            self.cache, self.mask = cache, torch.ones(1, length, dtype=torch.long)
        else:
            width = max(self.mask.shape[1], length)
            self.mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(torch.ones(1, length, dtype=torch.long),
                                                                             width, 1)])
            for mine, theirs in zip(_layers(self.cache), _layers(cache), strict=True):
                mine.keys = torch.cat([_left_pad(mine.keys, width, 2), _left_pad(theirs.keys, width, 2)])
                mine.values = torch.cat([_left_pad(mine.values, width, 2), _left_pad(theirs.values, width, 2)])
        self.prompts.append(prompt)
        self.tokens = torch.cat([self.tokens, torch.tensor([token])])

    def keep(self, rows: torch.Tensor) -> None:
        """Keeps only `rows` and drops the cache columns that none of them attends to."""
        self.prompts = [self.prompts[r] for r in rows.tolist()]
        self.mask, self.tokens = self.mask[rows], self.tokens[rows]
        used = self.mask.any(0).nonzero()
        start = int(used[0]) if len(used) else self.mask.shape[1]
        self.mask = self.mask[:, start:]
        for layer in _layers(self.cache):
            layer.keys = layer.keys[rows.to(layer.keys.device), :, start:]
            layer.values = layer.values[rows.to(layer.values.device), :, start:]


@torch.no_grad()
def continuous_generate(model, prompts: list[list[int]], max_new_tokens: int, eos: set[int], batch_size: int,
                        sampled: list[bool] | None = None, temperature: float = 1.0, top_k: int = 50,
                        top_p: float = 1.0, seed: int = 0) -> list[list[int]]:
    """The answer to each prompt (ids up to and including its EOS, at most `max_new_tokens`), at most `batch_size`
    rows decoded at a time, prompts taken in order; greedy, or sampled where `sampled[i]` (temperature, top-k and
    top-p as `generate` applies them, drawn from a generator seeded with `seed`)."""
    sampled = sampled or [False] * len(prompts)
    warp = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k),
                                TopPLogitsWarper(top_p)])
    generator = torch.Generator().manual_seed(seed)
    device = model.device
    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # 5.24

    def choose(rows: list[int], logits: torch.Tensor) -> torch.Tensor:
        tokens = logits.argmax(-1)
        draw = torch.tensor([sampled[r] for r in rows])
        if draw.any():
            scores = warp(None, logits[draw].float())
            tokens[draw] = torch.multinomial(scores.softmax(-1).cpu(), 1, generator=generator)[:, 0].to(device)
        return tokens.cpu()

    answers: list[list[int]] = [[] for _ in prompts]
    queue = deque(range(len(prompts)))
    batch = _Batch()
    while queue or len(batch):
        while queue and len(batch) < batch_size:
            prompt = queue.popleft()
            cache = _GrowingCache()
            out = model(input_ids=torch.tensor([prompts[prompt]], device=device), use_cache=True, logits_to_keep=1,
                        **{cache_kwarg: cache})
            token = int(choose([prompt], out.logits[:, -1])[0])
            answers[prompt].append(token)
            if token not in eos and max_new_tokens > 1:
                batch.join(prompt, cache, token)
        if not len(batch):
            continue
        mask = torch.cat([batch.mask, torch.ones(len(batch), 1, dtype=torch.long)], dim=1)
        positions = batch.mask.sum(1, keepdim=True)
        out = model(input_ids=batch.tokens[:, None].to(device), attention_mask=mask.to(device),
                    position_ids=positions.to(device), use_cache=True, **{cache_kwarg: batch.cache})
        batch.mask, batch.tokens = mask, choose(batch.prompts, out.logits[:, -1])
        done = []
        for prompt, token in zip(batch.prompts, batch.tokens.tolist()):
            answers[prompt].append(token)
            done.append(token in eos or len(answers[prompt]) >= max_new_tokens)
        if any(done):
            batch.keep(torch.tensor([row for row, d in enumerate(done) if not d], dtype=torch.long))
    return answers
