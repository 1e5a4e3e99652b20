"""maskprior_fast: the prior at the kernel's speed, beside the method (maskprior.py).

maskprior.prior_attention, the fused path of a layer with a prior, hands each call to `prior_attention` here when
this file is importable, and computes the same itself (scaled_dot_product_attention with the bias) where this
returns None or is absent. Every path here is exact: its outputs and the gradients of q, k, v and M equal the
explicit softmax's to rounding (the tests hold them equal).

- On the CPU: torch's fused attention kernel reads the prior's bias as a constant (and skips the future's blocks
  when causal) and saves the row log-sum-exp; the backward is our own (`_backward`), which gives M its gradient
  beside q's, k's and v's (the kernel's own backward gives no gradient for a mask).
- flex_attention (`prior_flex`), where asked: M read inside the kernel, compiled on CUDA.

It imports torch alone and reads a prior through the attributes MaskPrior has (bias, param, causal, n, n_keys,
roles and the helpers _logits, _index, _pairs, _first_row, check_set, and the call prior(t, dtype, k_len)).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


def prior_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prior, flex: bool = False):
    """softmax(q k^T / sqrt(d) + log sigmoid(M)) v by a speed path: flex_attention where asked (`flex`) for plain
    self-attention, else on the CPU the fused kernel with our backward (`_FusedPrior`); None where neither applies
    (the caller then runs scaled_dot_product_attention with the bias). q (B, H, T, d), k, v (B, H, S, d)."""
    if flex and prior.roles is None and q.shape[-2] == k.shape[-2]:
        return prior_flex(q, k, v, prior)
    if (q.device.type == "cpu" and prior.roles is None and _cpu_kernel() is not None
            and q.dtype in (torch.float32, torch.bfloat16) and q.dtype == k.dtype == v.dtype):
        return _FusedPrior.apply(q, k, v, prior.bias, prior)
    return None


def mask_bias_grad(mask_logits: torch.Tensor) -> torch.Tensor:
    """d log sigmoid(M) / dM = sigmoid(-M), elementwise, in (0, 1): what the hand backward multiplies dM by (autograd
    of maskprior.mask_bias gives the same; a test keeps the two equal)."""
    return torch.sigmoid(-mask_logits)


def _future_keys(t: int, device) -> torch.Tensor:
    """(T, T) bool, True where key j > query i."""
    return torch.ones(t, t, dtype=torch.bool, device=device).triu(1)


# ----------------------------------------------------------------------------------------
# flex_attention, compiled for CUDA, and causal block masks, made on first use (not at import)

_FLEX: dict = {}


def _flex_attention(device_type: str):
    """torch's flex_attention: compiled on CUDA (its fused kernel), as it is elsewhere (the
    reference implementation, torch's warning about it silenced: it is what runs on a CPU)."""
    from torch.nn.attention.flex_attention import flex_attention
    if device_type == "cuda":
        if "cuda" not in _FLEX:
            _FLEX["cuda"] = torch.compile(flex_attention, dynamic=False)
        return _FLEX["cuda"]

    def eager(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return flex_attention(*args, **kwargs)
    return eager


def _causal_block_mask(t: int, device: torch.device):
    """flex_attention's block mask of a causal layer of t tokens (key j <= query i), cached per size and device."""
    from torch.nn.attention.flex_attention import create_block_mask
    key = ("causal", t, str(device))
    if key not in _FLEX:
        _FLEX[key] = create_block_mask(lambda b, h, i, j: i >= j, None, None, t, t, device=device)
    return _FLEX[key]


def prior_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prior) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + log sigmoid(M)) v through torch's flex_attention: M is read inside the kernel (a
    score_mod indexing the (heads, N, N) bias, or the relative table by distance), never a (B, heads, T, T) bias in
    memory, and stays learnable; a causal prior's future is a block mask. Self-attention of T <= N tokens
    (`prior_roles` takes the bias path). q, k, v: (B, heads, T, d) -> (B, heads, T, d). Compiled on CUDA (a fused
    kernel, forward and backward), torch's reference implementation elsewhere."""
    t = q.shape[-2]
    prior._first_row(t, t)
    prior.check_set()
    if q.device.type == "cpu" and torch.is_grad_enabled() and (q.requires_grad or prior.bias.requires_grad):
        raise ValueError(f"{prior.where}: torch's flex_attention has no backward on the CPU: "
                         "train with it on CUDA, or use the fused or explicit path here (its "
                         "forward runs on the CPU under torch.no_grad)")
    table = F.logsigmoid(prior._logits(prior.bias)).to(q.dtype)
    if prior.param == "full":
        def score_mod(score, b, h, i, j):
            return score + table[h, i, j]
    elif prior.param == "grid":
        slot = prior._pairs(q.device)

        def score_mod(score, b, h, i, j):
            return score + table[h, slot[i, j]]
    else:
        n = prior.n
        lo, hi, offset = (0, n - 1, 0) if prior.causal else (1 - n, n - 1, n - 1)

        def score_mod(score, b, h, i, j):               # `_index`, written out for the kernel
            return score + table[h, (i - j).clamp(lo, hi) + offset]
    block = _causal_block_mask(t, q.device) if prior.causal else None
    return _flex_attention(q.device.type)(q, k, v, score_mod=score_mod, block_mask=block)


# ----------------------------------------------------------------------------------------
# The CPU: torch's fused kernel forward, our backward


def _cpu_kernel():
    """torch's fused CPU attention kernel as an op that takes a float mask beside is_causal and gives the row
    log-sum-exp (the aten op behind F.scaled_dot_product_attention, torch >= 2.3); None where this torch lacks it."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _diagonal_sums(ds: torch.Tensor) -> torch.Tensor:
    """(H, R, C) -> (H, R + C) sums of ds along its diagonals: entry e holds the (i, j) with j - i = e - R."""
    h, r, c = ds.shape
    # R zeros before each row, a zero row after the last: the
    pad = F.pad(ds, (r, 0, 0, 1))
    # skewed rows read only zeros past
    return pad.as_strided((h, r, r + c), ((r + 1) * (r + c), r + c + 1, 1)).sum(1)


@torch.no_grad()
def _backward(prior, q, k, v, out, lse, dout, bias, need_m: bool = True, block: int = 64):
    """The gradients (dq, dk, dv, dM) of softmax(q k^T / sqrt(d) + bias) v, from the forward
    kernel's output and row log-sum-exp: P = exp(S - lse), dV = P^T dO, dS = P (dP - D) with dP =
    dO V^T and D = rowsum(dO O), dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d), a block of query rows
    at a time (only the keys a causal block sees), in float32. dM: dS summed over the batch, by (query, key) for a
    full M (a grid's then into its slots), by distance for a relative one (float64), then back through the bias
    (`mask_bias_grad`). About what the kernel's own backward costs on the CPU (which gives no dS).
    q, out, dout (B, H, T, d); k, v (B, H, S, d); lse (B, H, T); bias (H, T, S). dM is None unless `need_m`."""
    h, t, s = bias.shape
    # query i is at position first + i (after a KV cache)
    first, scale = s - t, q.shape[-1] ** -0.5
    q, k, v, out, dout = (x.float() for x in (q, k, v, out, dout))
    d_rows = (dout * out).sum(-1, keepdim=True)
    # S - lse and dP - D as one product each: q and dO gain a column (-lse, -D), k and v a column of ones
    qa, da = torch.cat([q * scale, -lse.unsqueeze(-1)], -1), torch.cat([dout, -d_rows], -1)
    ka, va = F.pad(k, (0, 1), value=1.0), F.pad(v, (0, 1), value=1.0)
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    full = prior.param != "relative"          # dM by (query, key), a grid's gathered into its slots at the end
    dm = torch.zeros(h, t, s, device=q.device) if full else torch.zeros(prior.bias.shape,
                                                                        dtype=torch.float64,
                                                                        device=q.device)
    for r0 in range(0, t, block):
        r1 = min(t, r0 + block)
        # keys after the block's last query are future keys
        c = first + r1 if prior.causal else s
        p = (qa[:, :, r0:r1] @ ka[:, :, :c].transpose(-2, -1)).add_(bias[:, r0:r1, :c])
        # P < e^-80 adds nothing; exp of a number past -87 is 20x slower
        p.clamp_(min=-80.0).exp_()
        # the future, only in the block's last keys: exactly 0
        if prior.causal:
            p[..., c - (r1 - r0):].masked_fill_(_future_keys(r1 - r0, p.device), 0.0)
        dv[:, :, :c] += p.transpose(-2, -1) @ dout[:, :, r0:r1]
        ds = p.mul_(da[:, :, r0:r1] @ va[:, :, :c].transpose(-2, -1))
        dq[:, :, r0:r1] = (ds @ k[:, :, :c]).mul_(scale)
        dk[:, :, :c] += (ds.transpose(-2, -1) @ q[:, :, r0:r1]).mul_(scale)
        if not need_m:
            continue
        ds = ds.sum(0)                              # (H, rows, keys): the bias is the batch's
        if full:
            dm[:, r0:r1, :c] = ds
        # by diagonal: entry e holds key - query = e - rows
        else:
            dist = first + r1 - torch.arange(r1 - r0 + c, device=q.device)
            dm.index_add_(1, prior._index(dist), _diagonal_sums(ds).double())
    if not need_m:
        return dq, dk, dv, None
    # M's rows r .. r + t - 1 and keys 0 .. c - 1 made this bias; back through mask_bias
    if prior.param == "grid":                  # by (query, key) into the slots, then as a relative table
        dm = torch.zeros(prior.bias.shape, dtype=torch.float64, device=q.device).index_add_(
            1, prior._pairs(q.device).flatten(), dm.flatten(1).double())
    if prior.param == "full":
        r, c = prior._first_row(t, s), min(s, prior.n_keys)
        dm, rows = torch.zeros_like(prior.bias), dm
        dm[:, r:r + t, :c] = rows[..., :c] * mask_bias_grad(prior.bias[:, r:r + t, :c])
    else:
        dm = (dm * mask_bias_grad(prior.bias.double())).to(prior.bias.dtype)
    return dq, dk, dv, dm


class _FusedPrior(torch.autograd.Function):
    """softmax(q k^T / sqrt(d) + log sigmoid(M)) v: forward through torch's fused CPU kernel, which
    reads the bias as a constant (and skips the future's blocks when causal) and saves the row
    log-sum-exp; backward by `_backward`, which gives M its gradient beside q's, k's and v's.
    Exact: the explicit path's outputs and gradients (to rounding)."""

    @staticmethod
    def forward(ctx, q, k, v, m, prior):
        fwd = _cpu_kernel()
        t, s = q.shape[-2], k.shape[-2]
        bias = prior(t, q.dtype, k_len=s)
        out, lse = fwd(q, k, v, 0.0, prior.causal and t == s, attn_mask=bias.unsqueeze(0))
        ctx.save_for_backward(q, k, v, out, lse, bias)
        ctx.prior = prior
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, bias = ctx.saved_tensors
        dq, dk, dv, dm = _backward(ctx.prior, q, k, v, out, lse, dout, bias.float(), ctx.needs_input_grad[3])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dm, None



# the public names (`from maskprior_fast import *`)
__all__ = ["prior_attention", "prior_flex", "mask_bias_grad"]
