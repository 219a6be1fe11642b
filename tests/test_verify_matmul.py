"""Weight-first linear layers in verify forwards (CPU float32): the same products, only where a verify runs, and the
target's layers as they were once the generate calls end."""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dflash_hf import verify_matmul
from dflash_hf.verify_matmul import VERIFY_ROWS, verify_matmuls, verifying
from tiny import random_dflash, random_dspark, tiny_target


class CalledFunctions(TorchFunctionMode):
    """Records which of F.linear and torch.mm ran (the recorder for the path taken, not a stand-in for either)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (F.linear, torch.mm):
            self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def swapped(model) -> list[str]:
    return [name for name, module in model.named_modules() if "forward" in vars(module)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (1, 3), (2, 2), (1, 5), (1, 6), (3, 4), (1, 40)])
def test_a_verify_forward_computes_the_same_product_weight_first(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape, 24)
    want = F.linear(x, layer.weight, layer.bias)
    with verify_matmuls(layer), verifying(), CalledFunctions() as calls:
        got = layer(x)
    rows = shape[0] * shape[1]
    assert calls.names == (["mm"] if rows in VERIFY_ROWS else ["linear"])
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert swapped(layer) == []


@pytest.mark.parametrize("bias", [False, True])
def test_one_row_by_a_weight_past_the_caches_is_taken_as_two(bias):
    torch.manual_seed(0)
    weight = torch.randn(verify_matmul.LARGE_WEIGHT // 64, 64)
    b = torch.randn(weight.shape[0]) if bias else None
    for x, path in ((torch.randn(1, 1, 64), ["mm"]), (torch.randn(64), ["mm"])):
        with CalledFunctions() as calls:
            got = verify_matmul.linear(x, weight, b)
        assert calls.names == path and got.shape == F.linear(x, weight, b).shape and got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)
    small = weight[: weight.shape[0] // 2]  # below the threshold: the one-row product stays F.linear's
    with CalledFunctions() as calls:
        verify_matmul.linear(torch.randn(1, 64), small)
    assert calls.names == ["linear"]


def test_outside_a_verify_the_layers_run_f_linear_bit_for_bit():
    torch.manual_seed(0)
    layer = nn.Linear(24, 40)
    x = torch.randn(1, 3, 24)
    with verify_matmuls(layer), CalledFunctions() as calls:
        assert swapped(layer) == [""]
        got = layer(x)
    assert calls.names == ["linear"]
    assert torch.equal(got, F.linear(x, layer.weight, layer.bias))


def test_only_plain_float32_cpu_linears_switch():
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), Custom(8, 8), nn.Linear(8, 8))
    model[3].forward = model[3].forward  # already wrapped by someone else (accelerate's hooks do this)
    with verify_matmuls(model):
        assert swapped(model) == ["0", "3"]
    assert swapped(model) == ["3"]


def test_overlapping_calls_restore_the_layers_when_the_last_ends():
    model = nn.Sequential(nn.Linear(8, 8))
    outer = verify_matmuls(model)
    outer.__enter__()
    with verify_matmuls(model):
        assert swapped(model) == ["0"]
    assert swapped(model) == ["0"]  # the outer call is still running
    outer.__exit__(None, None, None)
    assert swapped(model) == [] and not verify_matmul._live_calls


def test_linear_mode_and_a_bad_mode():
    model = nn.Sequential(nn.Linear(8, 8))
    with verify_matmuls(model, "linear"):
        assert swapped(model) == []
    with pytest.raises(ValueError, match="dflash_verify_matmul"):
        with verify_matmuls(model, "fast"):
            pass


class ForwardLog:
    """Per forward of the target's first linear layer: its rows, whether a verify was in flight, and whether the
    layer was switched."""

    def __init__(self, layer: nn.Linear):
        self.entries = []
        self.handle = layer.register_forward_hook(self.record)

    def record(self, module, args, output):
        x = args[0]
        self.entries.append((x.numel() // x.shape[-1], verify_matmul._verifying.get(), "forward" in vars(module)))


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_generate_switches_exactly_the_verify_forwards(kind):
    target = tiny_target("llama")
    draft = (random_dflash if kind == "dflash" else random_dspark)(target, block_size=3)
    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 11]])
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    log = ForwardLog(target.model.layers[0].mlp.gate_proj)
    try:
        out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft, dflash_policy="fixed")
    finally:
        log.handle.remove()
    assert torch.equal(out, plain)
    prefill, *steps = log.entries
    assert prefill == (ids.shape[1], False, True)
    assert steps and all(verify == (rows > 1) and switched for rows, verify, switched in steps)
    assert any(rows in VERIFY_ROWS for rows, _, _ in steps)
    assert swapped(target) == [] and not verify_matmul._verifying.get()


def test_batched_generate_switches_only_its_verify_forwards():
    target = tiny_target("llama")
    draft = random_dspark(target, block_size=2)
    ids = torch.tensor([[0, 0, 5, 9, 14], [3, 22, 7, 11, 4]])
    mask = (ids != 0).long()
    mask[1, 0] = 1
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    log = ForwardLog(target.model.layers[0].mlp.gate_proj)
    try:
        out = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, assistant_model=draft,
                              dflash_policy="fixed")
    finally:
        log.handle.remove()
    assert torch.equal(out, plain)
    prefill, *steps = log.entries
    assert prefill[1] is False
    # Two rows of one token each (a row that finished early leaves one) are decode steps, not verifies.
    verifies = [rows for rows, verify, _ in steps if verify]
    assert verifies and all(rows in (2, 4) for rows in verifies)
    assert swapped(target) == []


def test_a_thread_verifying_does_not_switch_another_threads_forwards():
    torch.manual_seed(0)
    layer = nn.Linear(24, 40)
    x = torch.randn(1, 2, 24)
    seen = {}

    def other():
        with CalledFunctions() as calls:
            layer(x)
        seen["names"] = calls.names

    with verify_matmuls(layer), verifying():
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert seen["names"] == ["linear"]


def test_the_drafts_head_product_goes_weight_first_only_in_float32_on_cpu():
    torch.manual_seed(0)
    weight, x = torch.randn(40, 24), torch.randn(3, 24)
    with CalledFunctions() as calls:
        got = verify_matmul.linear(x, weight)
        verify_matmul.linear(x.bfloat16(), weight.bfloat16())
        verify_matmul.linear(torch.randn(8, 24), weight)
    assert calls.names == ["mm", "linear", "linear"]
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)
