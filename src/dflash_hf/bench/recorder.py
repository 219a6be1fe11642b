"""Timing hooks: every path's forwards counted and timed the same way, whichever code drives its loop."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Self

import torch


@dataclass
class ForwardLog:
    """What the hooks saw during one generate call."""

    starts: list[int] = field(default_factory=list)  # cache length when each target forward began
    target_s: list[float] = field(default_factory=list)  # wall time of each target forward
    draft_module_s: float = 0.0  # time inside a draft model's forward
    head_outside_s: float = 0.0  # time in the target's lm_head called by a drafter (outside the target's forward)


def _cache_length(args, kwargs) -> int:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        return int(position_ids.reshape(-1)[0])
    raise RuntimeError("A target forward ran without a cache or position_ids: the bench cannot tell where it started.")


class ForwardRecorder:
    """Hooks on the target, its lm_head and the drafts that time every forward of one generate call."""

    def __init__(self, target: torch.nn.Module, drafts: list[torch.nn.Module]):
        self.target = target
        self.head = target.get_output_embeddings()
        self.drafts = drafts
        self.log = ForwardLog()
        self._handles = []
        self._target_depth = 0
        self._draft_depth = 0
        self._t0 = self._draft_t0 = self._head_t0 = 0.0

    def __enter__(self) -> Self:
        self._handles.append(self.target.register_forward_pre_hook(self._target_pre, with_kwargs=True))
        self._handles.append(self.target.register_forward_hook(self._target_post, always_call=True))
        if self.head is not None:
            self._handles.append(self.head.register_forward_pre_hook(self._head_pre))
            self._handles.append(self.head.register_forward_hook(self._head_post, always_call=True))
        for draft in self.drafts:
            self._handles.append(draft.register_forward_pre_hook(self._draft_pre))
            self._handles.append(draft.register_forward_hook(self._draft_post, always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset(self) -> None:
        self.log = ForwardLog()

    def _target_pre(self, module, args, kwargs):
        self._target_depth += 1
        if self._target_depth == 1:
            self.log.starts.append(_cache_length(args, kwargs))
            self._t0 = time.perf_counter()

    def _target_post(self, module, args, output):
        self._target_depth -= 1
        if self._target_depth == 0:
            self.log.target_s.append(time.perf_counter() - self._t0)

    def _head_pre(self, module, args):
        if self._target_depth == 0:
            self._head_t0 = time.perf_counter()

    def _head_post(self, module, args, output):
        if self._target_depth == 0:
            self.log.head_outside_s += time.perf_counter() - self._head_t0

    def _draft_pre(self, module, args):
        self._draft_depth += 1
        if self._draft_depth == 1:
            self._draft_t0 = time.perf_counter()

    def _draft_post(self, module, args, output):
        self._draft_depth -= 1
        if self._draft_depth == 0:
            self.log.draft_module_s += time.perf_counter() - self._draft_t0
