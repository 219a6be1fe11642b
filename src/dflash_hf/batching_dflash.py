"""Batched block speculation: `target.generate(**batch, assistant_model=draft)` with B > 1, every row at its own pace.

A Hub remote-code file (torch and transformers only), entered by the generate hook in `generation_dflash.py` when the
batch has more than one row (transformers' assisted decoding runs one sequence at a time).

Layout: the rows share one target cache and one draft context cache, as left padding already has them share one.
Each step verifies one rectangular block [B, k + 1] (one k for the batch, chosen by the length policy against what B
rows of k + 1 cost); each row keeps the columns it accepted and the columns other rows accepted beyond its own become
holes, masked out of the 2-D attention mask like padding, with every row's position ids counting only its real
tokens. So a row's tokens see exactly the keys and positions they would see alone, and each row advances by its own
accepted length. Finished rows leave the batch, and the holes are then closed (each row's real columns gathered to
the right), as they are whenever they grow past `COMPACT_HOLE_FRACTION` of the cache.

What plain batched generate does per row is kept per row: the logits processors and stopping criteria see each row's
own ids (as plain generate would have them at that length), a row stops at its EOS, stop strings or length, and
finished rows are padded with `pad_token_id` to the batch's common length.
"""

import inspect
import logging
import time

import torch
from transformers import GenerationMixin
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    PrefixConstrainedLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .layers_dflash import gather_columns
from .verify_matmul import verifying

# Close the holes (and the left padding) once they make up this share of the cache's columns: attention over masked
# columns costs what attention over real ones does, while a compaction copies the whole cache once.
COMPACT_HOLE_FRACTION = 0.5
# Logits processors that treat every row alone and ignore the ids: applied to all rows and positions in one call.
ROW_WISE_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)
UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")

logger = logging.getLogger(__name__)
# The cache's name among generate's model kwargs and `prepare_inputs_for_generation`'s parameters: transformers 5.24
# renamed `past_key_values` to `cache`.
CACHE_KWARG = "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters \
    else "past_key_values"


def note_nonfinite_draft(draft, stats: dict) -> None:
    """Count a step whose draft logits held NaN or inf (it became a plain decode) and warn once per draft."""
    stats["nonfinite_steps"] += 1
    if not getattr(draft, "_warned_nonfinite", False):
        draft._warned_nonfinite = True
        logger.warning(
            "The draft %s (%s) produced NaN or inf logits; those steps decode without it (the output stays the "
            "target's). `generation_stats['nonfinite_steps']` counts them. Check the draft's weights and dtype (float16 "
            "overflows where bfloat16 does not).", getattr(draft, "name_or_path", "") or "(unnamed)",
            type(draft).__name__)


def check_batchable(target, generation_config, logits_processor, streamer, synced_gpus: bool, cache) -> None:
    """Raise, naming the setting, for what the batched loop does not do."""
    for name in UNSUPPORTED_OUTPUTS:
        if generation_config.return_dict_in_generate and getattr(generation_config, name, False):
            raise ValueError(
                f"`{name}=True` is not available with a batch and a block draft: rows advance by different numbers "
                "of tokens per step, so there is no per-step tensor to return. Generate one prompt at a time for it."
            )
    if streamer is not None:
        raise ValueError("A `streamer` takes one sequence; with a batch and a block draft, generate without it.")
    if synced_gpus:
        raise ValueError("`synced_gpus` is not supported with a batch and a block draft.")
    if generation_config.num_beams > 1:
        raise ValueError(f"`num_beams` = {generation_config.num_beams}: block speculation decodes greedily or samples.")
    if generation_config.prompt_lookup_num_tokens:
        raise ValueError(
            "`prompt_lookup_num_tokens` beside a block draft runs one sequence at a time; with a batch, drop it."
        )
    if any(isinstance(p, PrefixConstrainedLogitsProcessor) for p in logits_processor):
        raise ValueError(
            "`prefix_allowed_tokens_fn` reads the batch index, which the batched loop does not keep per call; "
            "generate one prompt at a time with it."
        )
    if not isinstance(cache, DynamicCache) or any(type(layer) is not DynamicLayer for layer in cache.layers):
        kinds = sorted({type(layer).__name__ for layer in getattr(cache, "layers", [])}) or [type(cache).__name__]
        raise ValueError(
            f"Batched block speculation keeps rejected drafts as masked holes in a dynamic full-attention cache; this "
            f"target's cache has {', '.join(kinds)} (sliding windows, static or quantized caches count positions by "
            "column). Generate one prompt at a time."
        )


def right_aligned(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a column-validity mask [B, T]: per row, the index of its valid columns moved to the right end in order
    ([B, W], W = most valid columns in a row; the left is filled with invalid ones) and the mask of the result."""
    counts = valid.sum(1)
    width = int(counts.max()) if valid.numel() else 0
    order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices  # invalid first, each kind in order
    index = order[:, valid.shape[1] - width:]
    new_valid = torch.arange(width, device=valid.device)[None, :] >= (width - counts)[:, None]
    return index, new_valid


def speculative_accept(p: torch.Tensor, q: torch.Tensor, candidates: torch.Tensor,
                       uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al.'s rejection step for every row: p [B, k+1, V] target probabilities, q [B, k, V] the draft's,
    candidates [B, k] drawn from q, `uniforms` [B, k] the draws r in [0, 1) (fresh ones by default). Returns (accepted
    count n [B], the token after them [B]: from (p - q)+ at the first rejection, from p after a fully accepted block).
    Each row's emitted tokens are then distributed as p's."""
    batch, k = candidates.shape
    p_tok = p[:, :k].gather(-1, candidates[..., None])[..., 0]
    q_tok = q.gather(-1, candidates[..., None])[..., 0]
    r = torch.rand_like(p_tok) if uniforms is None else uniforms
    # r < p/q, as transformers >= 5.25 has it (accepts with probability exactly p/q, never a token p rules out),
    # without dividing by a zero q
    accepted = r * q_tok < p_tok
    n = accepted.to(torch.long).cumprod(1).sum(1)
    rows = torch.arange(batch, device=p.device)
    p_next = p[rows, n]
    q_next = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, n]  # no q after a full block: sample from p
    residual = (p_next - q_next).clamp(min=0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p == q up to rounding: (p - q)+ is all zero, p is the answer
    residual = torch.where(empty, p_next, residual)
    return n, torch.multinomial(residual / residual.sum(-1, keepdim=True), 1)[:, 0]


class InBatchSlots:
    """Logits processors called on some rows of a batch, each placed in its original slot (processors may keep state
    per batch row, such as each row's prompt length), the other slots filled with padding."""

    def __init__(self, processors, rows: torch.Tensor, batch: int, pad_id: int):
        self.processors, self.rows, self.batch, self.pad_id = processors, rows, batch, pad_id

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ids = input_ids.new_full((self.batch, input_ids.shape[1]), self.pad_id)
        ids[self.rows] = input_ids
        full = scores.new_zeros(self.batch, scores.shape[1])
        full[self.rows] = scores
        return self.processors(ids, full)[self.rows]


class BatchedSpeculation:
    """One batched generate call: the target's cache, the draft's context cache and the books of every row."""

    def __init__(self, target, draft, input_ids, logits_processor, stopping_criteria, generation_config,
                 model_kwargs: dict, settings):
        self.target, self.draft, self.settings = target, draft, settings
        self.policy = settings.policy
        self.do_sample = bool(generation_config.do_sample)
        self.processors = logits_processor if logits_processor else LogitsProcessorList()
        self.row_wise = all(isinstance(p, ROW_WISE_PROCESSORS) for p in self.processors)
        # EOS and length are checked here for all rows at once; the rest (stop strings, the caller's) row by row.
        self.criteria = [c for c in stopping_criteria if not isinstance(c, (EosTokenCriteria, MaxLengthCriteria))]
        self.pads_finished = any(hasattr(c, "eos_token_id") for c in stopping_criteria)  # as plain generate
        eos = getattr(generation_config, "_eos_token_tensor", None)
        self.eos = None if eos is None else eos.flatten().to(input_ids.device)
        pad = getattr(generation_config, "_pad_token_tensor", None)
        self.pad_id = int(pad) if pad is not None else 0
        self.model_kwargs = model_kwargs
        # What every verify forward passes on unchanged (the prefill's mask, positions and cache are replaced per step).
        self.step_kwargs = {key: value for key, value in model_kwargs.items()
                            if key not in ("attention_mask", "position_ids", CACHE_KWARG)}
        self.cache = model_kwargs[CACHE_KWARG]
        batch, prompt_len = input_ids.shape
        device = input_ids.device
        max_length = generation_config.max_length
        self.tokens = torch.full((batch, max(max_length, prompt_len)), self.pad_id, dtype=input_ids.dtype,
                                 device=device)
        self.tokens[:, :prompt_len] = input_ids
        self.lengths = torch.full((batch,), prompt_len, dtype=torch.long, device=device)  # each row's, pads included
        self.limit = torch.full((batch,), max_length, dtype=torch.long, device=device)
        self.stopped = torch.zeros(batch, dtype=torch.bool, device=device)  # a criterion fired (no EOS padding)
        self.rows = torch.arange(batch, device=device)  # the original index of each row still in the batch
        mask = model_kwargs.get("attention_mask")
        self.valid = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
        self.column_pos = (self.valid.long().cumsum(1) - 1).clamp(min=0)  # each cache column's position
        self.context_columns = 0  # columns the draft's context cache holds; the rest are `pending` states
        self.pending = None  # [B, T - context_columns, K*H] target states the draft has not read yet
        self.draft_cache = draft.new_context_cache()
        self.stats = {
            "batch_size": batch, "target_forwards": 0, "draft_forwards": 0, "drafted_tokens": 0,
            "accepted_tokens": 0, "policy": [], "compactions": 0, "nonfinite_steps": 0,
            "time_s": {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "total": 0.0},
            "rows": [{"acceptance_lengths": []} for _ in range(batch)],
        }

    # -- the loop ------------------------------------------------------------------------------------------------------

    def run(self, capture) -> torch.Tensor:
        start = time.perf_counter()
        self.capture = capture
        input_ids = self.tokens[:, : int(self.lengths[0])]
        inputs = self.target.prepare_inputs_for_generation(input_ids, is_first_iteration=True, **self.model_kwargs)
        inputs |= capture.model_kwargs_overrides
        outputs = self.target(**inputs, return_dict=True)
        self.stats["target_forwards"] += 1
        logits = outputs.logits[:, -1:].to(dtype=torch.float32, device=input_ids.device)
        # The first token exactly as plain generate picks it: one processor call over the whole batch.
        scores = self.processors(input_ids, logits[:, 0]) if self.processors else logits[:, 0]
        first = torch.multinomial(scores.softmax(-1), 1)[:, 0] if self.do_sample else scores.argmax(-1)
        self._keep_states(outputs, input_ids.shape[1])  # the prompt's columns: valid as its mask says
        self.stats["time_s"]["prefill"] = time.perf_counter() - start
        self._emit(first[:, None], torch.ones_like(self.rows), verify=False)
        while self.rows.numel():
            self._step()
        self.stats["time_s"]["total"] = time.perf_counter() - start
        return self.tokens[:, : int(self.lengths.max())]

    def _step(self) -> None:
        begin = time.perf_counter()
        rows, lengths = self.rows, self.lengths[self.rows]
        last = self.tokens[rows, lengths - 1]
        next_pos = self.valid.sum(1)  # each row's last token's position: its real tokens before it
        budget = int((self.limit[rows] - lengths).max()) - 1  # most candidates a row could still emit after `last`
        slots, probe = self.policy.plan_draft("draft")
        slots = min(slots, max(budget, 0))
        candidates, q, expected, seconds, source = last.new_zeros(len(rows), 0), None, float(len(rows)), None, None
        if slots:
            candidates, q, expected, seconds, probe = self._draft(last, next_pos, slots, probe, begin)
            source = "draft" if candidates.shape[1] else None
        drafted = time.perf_counter()
        self.stats["time_s"]["draft"] += drafted - begin
        k = candidates.shape[1]
        self.stats["drafted_tokens"] += k * len(rows)
        self.stats["policy"].append({"k": k, "source": source or "decode", "expected_tokens": expected,
                                     "estimated_ms": None if seconds is None else 1000 * seconds, "probe": probe,
                                     "batch": len(rows)})

        block = torch.cat([last[:, None], candidates], 1)
        positions = next_pos[:, None] + torch.arange(k + 1, device=block.device)
        mask = torch.cat([self.valid, self.valid.new_ones(len(rows), k + 1)], 1).long()
        inputs = self.target.prepare_inputs_for_generation(block, attention_mask=mask, position_ids=positions,
                                                           **{CACHE_KWARG: self.cache}, **self.step_kwargs)
        if "logits_to_keep" in inputs:
            inputs["logits_to_keep"] = k + 1
        inputs |= self.capture.model_kwargs_overrides
        with verifying(k > 0):
            outputs = self.target(**inputs, return_dict=True)
        self.stats["target_forwards"] += 1
        logits = outputs.logits[:, -(k + 1):].to(dtype=torch.float32, device=block.device)
        scores = self._process(logits, candidates)
        if self.do_sample and q is not None and k:
            accepted, after = speculative_accept(scores.softmax(-1), q.softmax(-1), candidates)
        else:
            picked = torch.multinomial(scores.flatten(0, 1).softmax(-1), 1).view(len(rows), k + 1) \
                if self.do_sample else scores.argmax(-1)
            accepted = (candidates == picked[:, :k]).long().cumprod(1).sum(1)
            after = picked.gather(1, accepted[:, None])[:, 0]
        emitted = torch.cat([candidates, candidates.new_zeros(len(rows), 1)], 1)
        emitted.scatter_(1, accepted[:, None], after[:, None])  # accepted candidates, then the target's own token

        # The columns this forward added: each row keeps `last` and its accepted candidates; past the longest such
        # run they are cropped, short of it they become holes.
        kept = int(accepted.max()) + 1
        self.cache.crop(kept - (k + 1))
        self._keep_states(outputs, kept, accepted + 1, positions[:, :kept])
        verified = time.perf_counter()
        self.stats["time_s"]["verify"] += verified - drafted
        self.stats["accepted_tokens"] += int(accepted.sum())
        self.policy.record(source, k, accepted.tolist(), probe, verified - drafted)
        self._emit(emitted, accepted + 1, verify=True)

    def _draft(self, last, next_pos, slots: int, probe: bool, begin: float):
        """Draft a block for every row (reading the states pending since the draft last ran) and let the policy
        choose how many of its slots to verify: (candidates [B, k], their q or None, expected tokens, estimated
        seconds, probe)."""
        rows = len(self.rows)
        block_pos = next_pos[:, None] + torch.arange(self.settings.block_size, device=next_pos.device)
        device = self.settings.device
        prefix, processors = None, None
        if self.processors:  # the draft's picks only need to be drawn from the q it reports: ids right-padded
            prefix = self.tokens[self.rows, : int(self.lengths[self.rows].max())].to(device)
            processors = InBatchSlots(self.processors, self.rows.to(device), self.tokens.shape[0], self.pad_id)
        proposal = self.draft.propose(
            self.pending.to(device), last.to(device), self.draft_cache,
            prefix_ids=prefix, logits_processor=processors, do_sample=self.do_sample,
            need_logits=self.do_sample,
            confidence_threshold=None if self.policy.adaptive else self.settings.confidence_threshold,
            block_size=self.settings.block_size, max_slots=slots,
            position_ids=torch.cat([self.column_pos[:, self.context_columns:], block_pos], 1).to(device),
            attention_mask=torch.cat([self.valid, self.valid.new_ones(rows, self.settings.block_size)], 1).to(device),
        )
        self.context_columns, self.pending = self.valid.shape[1], None
        self.stats["draft_forwards"] += 1
        if not proposal.finite:
            note_nonfinite_draft(self.draft, self.stats)
            return last.new_zeros(rows, 0), None, float(rows), None, False
        self.policy.observe_draft("draft", slots, time.perf_counter() - begin)
        confidence = None
        if proposal.confidence is not None and self.policy.adaptive:
            confidence = proposal.confidence.tolist()
        k, expected, seconds = self.policy.choose("draft", proposal.draft_ids.shape[1], confidence)
        if probe:
            k = max(k, 1)
        candidates = proposal.draft_ids[:, :k].to(last.device)
        q = None
        if proposal.draft_logits is not None and k:
            q = proposal.draft_logits[:, :k].to(last.device, torch.float32)
        return candidates, q, expected if expected is not None else float(rows), seconds, probe

    def _views(self, extra: torch.Tensor, lengths: torch.Tensor):
        """Each row's ids as plain generate holds them in the whole batch at a given length: for every distinct
        length L in `lengths` [B, m] (a row's own ids then `extra` [B, n] after them; -1 = none), yields (L, the
        (row, column) pairs of `lengths` equal to L, ids [B_all, L] holding those rows' ids in their original batch
        slots). Processors and criteria that keep per-row state (a prompt length per row, say) thus index it right."""
        own = self.lengths[self.rows]
        width = int(own.max()) + extra.shape[1]
        ids = self.tokens.new_full((len(self.rows), width), self.pad_id)
        ids[:, : self.tokens.shape[1]] = self.tokens[self.rows, :width]
        columns = own[:, None] + torch.arange(extra.shape[1], device=ids.device)
        ids.scatter_(1, columns, extra)
        for length in sorted(set(lengths[lengths >= 0].tolist())):
            pairs = (lengths == length).nonzero()
            view = self.tokens.new_full((self.tokens.shape[0], length), self.pad_id)
            view[self.rows[pairs[:, 0]]] = ids[pairs[:, 0], :length]
            yield length, pairs, view

    def _process(self, logits: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """The target's logits [B, k+1, V] through the logits processors, each position seeing its row's ids up to
        it (its own ids, then the candidates before that position) as plain generate would."""
        if not self.processors:
            return logits
        if self.row_wise:
            flat = logits.flatten(0, 1)
            return self.processors(flat.new_zeros(flat.shape[0], 1, dtype=torch.long), flat).view_as(logits)
        out = torch.empty_like(logits)
        lengths = self.lengths[self.rows][:, None] + torch.arange(logits.shape[1], device=logits.device)
        for _, pairs, view in self._views(candidates, lengths):
            scores = logits.new_zeros(view.shape[0], logits.shape[-1])
            scores[self.rows[pairs[:, 0]]] = logits[pairs[:, 0], pairs[:, 1]]
            out[pairs[:, 0], pairs[:, 1]] = self.processors(view, scores)[self.rows[pairs[:, 0]]]
        return out

    # -- books ---------------------------------------------------------------------------------------------------------

    def _keep_states(self, outputs, count: int, real: torch.Tensor | None = None, positions=None) -> None:
        """Add the first `count` columns of the last forward to the books: their validity (the first `real` of each
        row), their positions and the captured target states, which wait in `pending` until the draft next runs."""
        states = self.capture.states(outputs, count, self.settings.device)
        if real is not None:
            self.valid = torch.cat([self.valid, torch.arange(count, device=real.device)[None] < real[:, None]], 1)
            self.column_pos = torch.cat([self.column_pos, positions], 1)
        self.pending = states if self.pending is None else torch.cat([self.pending, states], 1)

    def _emit(self, emitted: torch.Tensor, counts: torch.Tensor, verify: bool) -> None:
        """Append each row's first `counts` tokens of `emitted` [B, n], cut at its EOS, its length limit and its
        stopping criteria; then let finished rows leave the batch."""
        rows = self.rows
        lengths = self.lengths[rows]
        n = emitted.shape[1]
        counts = torch.minimum(counts, self.limit[rows] - lengths)
        if self.eos is not None:
            is_eos = torch.isin(emitted, self.eos) & (torch.arange(n, device=emitted.device)[None] < counts[:, None])
            first_eos = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, counts)
            hit_eos = is_eos.any(1) & self.pads_finished
            counts = torch.where(hit_eos, first_eos, counts)
        else:
            hit_eos = torch.zeros_like(counts, dtype=torch.bool)
        if self.criteria:
            counts, stopped = self._apply_criteria(emitted, counts)
        else:
            stopped = torch.zeros_like(hit_eos)
        columns = lengths[:, None] + torch.arange(n, device=emitted.device)
        write = torch.arange(n, device=emitted.device)[None] < counts[:, None]
        self.tokens[rows[:, None].expand(-1, n)[write], columns[write]] = emitted[write]
        self.lengths[rows] = lengths + counts
        if verify:
            for i, row in enumerate(rows.tolist()):
                self.stats["rows"][row]["acceptance_lengths"].append(int(counts[i]))
        done = hit_eos | (self.lengths[rows] >= self.limit[rows])
        if self.pads_finished:
            done |= stopped
        else:  # plain generate keeps decoding stopped rows until every row stopped, then cuts all at the longest
            self.stopped[rows[stopped | done]] = True
            if bool(self.stopped.all()):
                self.limit.fill_(int(self.lengths.max()))
                done = self.lengths[rows] >= self.limit[rows]
        if bool(done.any()):
            self._compact(~done)
        elif (~self.valid).sum() > COMPACT_HOLE_FRACTION * self.valid.numel():
            self._compact(torch.ones_like(done))

    def _apply_criteria(self, emitted, counts):
        """Run the remaining stopping criteria on each row after each of its new tokens: (counts cut just after the
        first token that satisfied one, which rows stopped)."""
        steps = torch.arange(emitted.shape[1], device=emitted.device)[None]
        lengths = torch.where(steps < counts[:, None], self.lengths[self.rows][:, None] + steps + 1, -1)
        fired = torch.zeros_like(lengths, dtype=torch.bool)
        for _, pairs, view in self._views(emitted, lengths):
            hit = torch.zeros(view.shape[0], dtype=torch.bool, device=view.device)
            for criterion in self.criteria:
                hit |= criterion(view, None).to(hit.device)
            fired[pairs[:, 0], pairs[:, 1]] = hit[self.rows[pairs[:, 0]]]
        stopped = fired.any(1)
        return torch.where(stopped, fired.long().argmax(1) + 1, counts), stopped

    def _compact(self, keep: torch.Tensor) -> None:
        """Keep the rows `keep` [B] marks, and gather each one's real columns to the right of the target cache, the
        draft's context cache and the pending states (the two parts separately: the draft has read the first)."""
        if not bool(keep.any()):
            self.rows = self.rows[:0]
            return
        kept = keep.nonzero()[:, 0]
        valid = self.valid[kept]
        split = self.context_columns
        read_index, read_valid = right_aligned(valid[:, :split])
        new_index, new_valid = right_aligned(valid[:, split:])
        index = torch.cat([read_index, split + new_index], 1)
        for layer in self.cache.layers:
            if layer.is_initialized and layer.keys.numel():
                layer.keys = gather_columns(layer.keys[kept], index, 2)
                layer.values = gather_columns(layer.values[kept], index, 2)
        if split:
            self.draft_cache.reindex(kept.to(self.settings.device), read_index.to(self.settings.device))
        if self.pending is not None:
            self.pending = gather_columns(self.pending[kept.to(self.pending.device)], new_index.to(self.pending.device),
                                          1)
        self.column_pos = gather_columns(self.column_pos[kept], index, 1)
        self.valid = torch.cat([read_valid, new_valid], 1)
        self.context_columns = read_index.shape[1]
        self.rows = self.rows[kept]
        self.policy.batch = len(self.rows)
        self.stats["compactions"] += 1

    def finish(self) -> dict:
        per_row = self.stats["rows"]
        steps = sum(len(r["acceptance_lengths"]) for r in per_row)
        emitted = sum(sum(r["acceptance_lengths"]) for r in per_row)
        for r in per_row:
            lengths = r["acceptance_lengths"]
            r["mean_acceptance_length"] = sum(lengths) / len(lengths) if lengths else 0.0
        self.stats["mean_acceptance_length"] = emitted / steps if steps else 0.0
        self.stats["kernels"] = self.draft.kernel_label
        self.stats["cost_estimates_ms"] = self.policy.costs.estimates_ms(self.stats["batch_size"])
        return self.stats


def batched_speculation(target, input_ids, logits_processor, stopping_criteria, generation_config, *,
                        assistant_model, settings, capture, synced_gpus=False, streamer=None, **model_kwargs):
    """`generate`'s decoding method for a batch with a block draft: (sequences or a `GenerateDecoderOnlyOutput`,
    the call's stats)."""
    for name in ("inputs_tensor", "assistant_tokenizer", "tokenizer"):
        model_kwargs.pop(name, None)
    cache = model_kwargs.get(CACHE_KWARG)
    check_batchable(target, generation_config, logits_processor or [], streamer, synced_gpus, cache)
    mask = model_kwargs.get("attention_mask")
    if mask is not None and bool((mask[:, -1] == 0).any()):
        raise ValueError(
            "The batch is right-padded (some row's `attention_mask` ends in 0); batched speculation, like batched "
            "generation of decoder-only models, needs left padding: `tokenizer.padding_side = 'left'`."
        )
    loop = BatchedSpeculation(target, assistant_model, input_ids, logits_processor, stopping_criteria,
                              generation_config, model_kwargs, settings)
    sequences = loop.run(capture)
    stats = loop.finish()
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences), stats
    return sequences, stats


__all__ = ["BatchedSpeculation", "batched_speculation", "check_batchable", "note_nonfinite_draft", "right_aligned",
           "speculative_accept"]
