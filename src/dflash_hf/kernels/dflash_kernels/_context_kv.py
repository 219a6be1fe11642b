"""Context K/V of all draft layers in one launch: k_proj/v_proj -> k_norm -> RoPE, written as [L, B, KVH, C, D].

Each program owns a tile of context rows and one (layer, KV head). It accumulates the two halves of the head
separately, so RMSNorm over the head and rotate-half RoPE are both local to the tile and nothing round-trips
through memory between the projection and the cache layout.
"""

import torch
import triton
import triton.language as tl

from ._common import dot_precision, interpreting, next_pow2, prepare


@triton.jit
def _context_kv_kernel(
    x_ptr, wk_ptr, wv_ptr, bk_ptr, bv_ptr, nw_ptr, cos_ptr, sin_ptr, k_out_ptr, v_out_ptr,
    M, C, H, B, eps,
    KVH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_lh = tl.program_id(1)
    layer = (pid_lh // KVH).to(tl.int64)
    head = pid_lh % KVH
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < HALF
    ks = tl.arange(0, BLOCK_K)
    proj_ty = x_ptr.dtype.element_ty

    # Weight rows of this head's first and second half, as [K, D] tiles (the transposed weight, read in place).
    first = (layer * (KVH * D) + head * D + cols).to(tl.int64)
    second = first + HALF
    acc_k1 = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    acc_k2 = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    acc_v1 = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    acc_v2 = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < H
        x = tl.load(x_ptr + rows64[:, None] * H + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        off1 = first[None, :] * H + kk[:, None]
        off2 = second[None, :] * H + kk[:, None]
        wk1 = tl.load(wk_ptr + off1, mask=w_ok, other=0.0)
        wk2 = tl.load(wk_ptr + off2, mask=w_ok, other=0.0)
        wv1 = tl.load(wv_ptr + off1, mask=w_ok, other=0.0)
        wv2 = tl.load(wv_ptr + off2, mask=w_ok, other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            wk1 = wk1.to(tl.float32)
            wk2 = wk2.to(tl.float32)
            wv1 = wv1.to(tl.float32)
            wv2 = wv2.to(tl.float32)
        acc_k1 = tl.dot(x, wk1, acc_k1, input_precision=PRECISION)
        acc_k2 = tl.dot(x, wk2, acc_k2, input_precision=PRECISION)
        acc_v1 = tl.dot(x, wv1, acc_v1, input_precision=PRECISION)
        acc_v2 = tl.dot(x, wv2, acc_v2, input_precision=PRECISION)

    if HAS_BIAS:
        acc_k1 += tl.load(bk_ptr + first, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_k2 += tl.load(bk_ptr + second, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_v1 += tl.load(bv_ptr + first, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_v2 += tl.load(bv_ptr + second, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    # nn.Linear hands k_norm its output in the model dtype: round there, as the model does.
    k1 = acc_k1.to(proj_ty).to(tl.float32)
    k2 = acc_k2.to(proj_ty).to(tl.float32)

    # k_norm over the whole head (padded columns are zero).
    rstd = tl.rsqrt((tl.sum(k1 * k1, 1) + tl.sum(k2 * k2, 1)) / D + eps)
    norm_row = nw_ptr + layer * D
    n1 = tl.load(norm_row + cols, mask=col_ok, other=0.0).to(tl.float32)
    n2 = tl.load(norm_row + HALF + cols, mask=col_ok, other=0.0).to(tl.float32)
    k1 = (k1 * rstd[:, None]).to(proj_ty).to(tl.float32) * n1[None, :]
    k2 = (k2 * rstd[:, None]).to(proj_ty).to(tl.float32) * n2[None, :]

    # RoPE, rotate-half convention: [k1, k2] * cos + [-k2, k1] * sin.
    tile_ok = row_ok[:, None] & col_ok[None, :]
    trig = rows64[:, None] * D + cols[None, :]
    c1 = tl.load(cos_ptr + trig, mask=tile_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + trig + HALF, mask=tile_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + trig, mask=tile_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + trig + HALF, mask=tile_ok, other=0.0).to(tl.float32)
    out1 = k1 * c1 - k2 * s1
    out2 = k2 * c2 + k1 * s2

    batch = rows64 // C
    pos = rows64 % C
    out = (((layer * B + batch) * KVH + head) * C + pos) * D
    dst = out[:, None] + cols[None, :]
    k_ty = k_out_ptr.dtype.element_ty
    v_ty = v_out_ptr.dtype.element_ty
    tl.store(k_out_ptr + dst, out1.to(k_ty), mask=tile_ok)
    tl.store(k_out_ptr + dst + HALF, out2.to(k_ty), mask=tile_ok)
    tl.store(v_out_ptr + dst, acc_v1.to(v_ty), mask=tile_ok)
    tl.store(v_out_ptr + dst + HALF, acc_v2.to(v_ty), mask=tile_ok)


def context_kv(
    x: torch.Tensor,
    k_weight: torch.Tensor,
    v_weight: torch.Tensor,
    k_bias: torch.Tensor | None,
    v_bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, length, hidden = x.shape
    layers, width, _ = k_weight.shape
    head_dim = norm_weight.shape[-1]
    kv_heads = width // head_dim
    k_dtype = torch.promote_types(torch.promote_types(x.dtype, norm_weight.dtype), cos.dtype)
    v_dtype = x.dtype
    xc, wk, wv, bk, bv, nw, cc, sc = (prepare(t) for t in (x, k_weight, v_weight, k_bias, v_bias, norm_weight, cos, sin))
    run_k = torch.promote_types(torch.promote_types(xc.dtype, nw.dtype), cc.dtype)
    keys = torch.empty((layers, batch, kv_heads, length, head_dim), dtype=run_k, device=x.device)
    values = torch.empty((layers, batch, kv_heads, length, head_dim), dtype=xc.dtype, device=x.device)
    rows = batch * length
    if rows and layers:
        half = head_dim // 2
        block_d = max(16, next_pow2(half))
        block_m = 32 if block_d >= 64 else 64
        block_k = 32 if block_d >= 128 else 64
        upcast = interpreting() or xc.dtype != wk.dtype
        grid = (triton.cdiv(rows, block_m), layers * kv_heads)
        _context_kv_kernel[grid](
            xc, wk, wv, bk if bk is not None else wk, bv if bv is not None else wv, nw, cc, sc, keys, values,
            rows, length, hidden, batch, float(eps),
            KVH=kv_heads, D=head_dim, HALF=half, HAS_BIAS=bk is not None,
            UPCAST=upcast, PRECISION=dot_precision(torch.float32 if upcast else xc.dtype),
            BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_D=block_d, num_warps=4,
        )
    return keys.to(k_dtype), values.to(v_dtype)
