"""maskprior_fast: the prior at the kernel's speed, beside the method (maskprior.py).

maskprior.prior_attention, the fused path of a layer with a prior, hands each call to `prior_attention` here when
this file is importable, and runs scaled_dot_product_attention with the bias itself where this returns None. Every
path here is exact: outputs and gradients of q, k, v and M equal the explicit softmax's to rounding (tested).

- On the CPU: torch's fused attention kernel reads the prior's bias as a constant (and skips the future's blocks
  when causal); our own backward (`_backward`) gives M its gradient beside q's, k's and v's (the kernel's gives none).
- A causal relative prior of W distances (`mask_window`) over many more keys (`_prior_band`): its band, distances
  0 .. W - 1, by hand in O(T x W); the keys further back share the table's last logit, so that part is the fused
  kernel's causal attention with no bias, forward and backward, the two merged by their log-sum-exps.
- flex_attention (`prior_flex`), where asked: M read inside the kernel, compiled on CUDA.

It imports torch alone and reads a prior through MaskPrior's attributes (bias, param, causal, n, n_keys, heads, roles),
helpers (_logits, _index, _pairs, _first_row, at_distance, check_set) and call prior(t, dtype, k_len).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


def prior_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prior, flex: bool = False):
    """softmax(q k^T / sqrt(d) + log sigmoid(M)) v by a speed path: `prior_flex` where asked (`flex`) for plain
    self-attention; on the CPU `_prior_band` for a causal relative prior of W distances over at least max(BAND_FROM,
    8 W) keys, else `_FusedPrior`; None where none applies. q (B, H, T, d), k, v (B, H, S, d) -> (B, H, T, d)."""
    if flex and prior.roles is None and q.shape[-2] == k.shape[-2]:
        return prior_flex(q, k, v, prior)
    if (q.device.type == "cpu" and prior.roles is None and _cpu_kernel() is not None
            and q.dtype in (torch.float32, torch.bfloat16) and q.dtype == k.dtype == v.dtype):
        if prior.param == "relative" and prior.causal and k.shape[-2] >= max(BAND_FROM, 8 * prior.n):
            return _prior_band(q, k, v, prior)
        return _FusedPrior.apply(q, k, v, prior.bias, prior)
    return None


# the band and far part (`_prior_band`) from max(BAND_FROM, 8 W) keys on: below, the fused kernel with the whole bias
# and our backward is as fast or faster (one CPU thread, W = 64 .. 256, T = 256 .. 4,096: the band costs about 1.3x the
# kernel's time a logit; the whole bias's backward grows past the kernel's from T = 2,048 on)
BAND_FROM = 2048


def mask_bias_grad(mask_logits: torch.Tensor) -> torch.Tensor:
    """d log sigmoid(M) / dM = sigmoid(-M), elementwise, in (0, 1): what the hand backward multiplies dM by (autograd
    of maskprior.mask_bias gives the same; a test keeps the two equal)."""
    return torch.sigmoid(-mask_logits)


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
    (`prior_roles` takes the bias path). q, k, v: (B, heads, T, d) -> (B, heads, T, d). Compiled on CUDA."""
    t = q.shape[-2]
    prior._first_row(t, t)
    prior.check_set()
    if q.device.type == "cpu" and torch.is_grad_enabled() and (q.requires_grad or prior.bias.requires_grad):
        raise ValueError(f"{prior.where}: torch's flex_attention has no backward on the CPU: train with it on CUDA, "
                         "or use the fused or explicit path here (its forward runs on the CPU under torch.no_grad)")
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


# log2(e); P below 2^-115 (e^-80) adds nothing, and exp2 of a number past -126 is many times slower
LOG2E, LOG2_FLOOR = 1.4426950408889634, 115.0


def _cpu_kernel():
    """torch's fused CPU attention kernel as an op that takes a float mask beside is_causal and gives the row
    log-sum-exp (the aten op behind F.scaled_dot_product_attention, torch >= 2.3); None where this torch lacks it."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _skewed_sums(ds: torch.Tensor) -> torch.Tensor:
    """(H, R, C) -> (H, R + C) sums of ds along its diagonals: entry e holds the (i, j) with j - i = e - R (a padded
    copy, skewed: for small pieces)."""
    h, r, c = ds.shape
    # R zeros before each row, a zero row after the last: the skewed rows read only zeros past
    pad = F.pad(ds, (r, 0, 0, 1))
    return pad.as_strided((h, r, r + c), ((r + 1) * (r + c), r + c + 1, 1)).sum(1)


def _diagonal_sums(ds: torch.Tensor) -> torch.Tensor:
    """(H, R, C) -> (H, R + C) sums of ds along its diagonals: entry e holds the (i, j) with j - i = e - R. The
    diagonals every row crosses (j - i = 0 .. C - R) are a strided view of ds itself, summed in place of a copy;
    the two corners (j < i in its first R - 1 columns, j - i > C - R in its last) by `_skewed_sums`."""
    h, r, c = ds.shape
    if c < r or r == 1:
        return _skewed_sums(ds)
    ds = ds.contiguous()
    out = ds.new_zeros(h, r + c)
    out[:, r:c + 1] = ds.as_strided((h, r, c - r + 1), (r * c, c + 1, 1)).sum(1)
    out[:, :r] += _skewed_sums(ds[:, :, :r - 1])[:, :r]
    out[:, c + 1:] += _skewed_sums(ds[:, :, c - r + 1:])[:, r:]
    return out


@torch.no_grad()
def _backward(prior, q, k, v, out, lse, dout, bias, need_m: bool = True, block: int | None = None):
    """The gradients (dq, dk, dv, dM) of softmax(q k^T / sqrt(d) + bias) v, from the forward kernel's output and row
    log-sum-exp: P = exp(S - lse), dV = P^T dO, dS = P (dP - D) with dP = dO V^T and D = rowsum(dO O), dQ = dS K /
    sqrt(d), dK = dS^T Q / sqrt(d), a block of query rows at a time (only the keys a causal block sees), in float32 and
    base 2 (exp2 is 3x faster than exp); dM from dS by `_MGrad`. q, out, dout (B, H, T, d); k, v (B, H, S, d); lse
    (B, H, T); bias (H, T, S), float32 or q's dtype -> dq, dk, dv float32 as q, k, v; dM as M (None unless `need_m`)."""
    h, t, s = bias.shape
    b, d = q.shape[0], q.shape[-1]
    # query i is at position first + i (after a KV cache); blocks of 64 rows (fastest of 16 .. 128 at T = 1,024, 2,048)
    first, scale = s - t, d ** -0.5
    block = block or 64
    # S - lse and dP - D (base 2) as one product each: q and dO gain a column (-lse, -D), k and v a column of ones
    qa, da = _augmented(q, lse, scale * LOG2E, LOG2E), _augmented(dout, (dout.float() * out.float()).sum(-1), 1.0)
    ka, va = _augmented(k, None, 1.0), _augmented(v, None, 1.0)
    dq = q.new_empty(b * h, q.shape[-2], d, dtype=torch.float32)
    dk, dv = (x.new_zeros(b * h, x.shape[-2], d, dtype=torch.float32) for x in (k, v))
    grads = _MGrad(prior, t, s, q.device) if need_m else None
    for r0 in range(0, t, block):
        r1 = min(t, r0 + block)
        c = first + r1 if prior.causal else s  # keys after the block's last query are future keys
        p = torch.bmm(qa[:, r0:r1], ka[:, :c].transpose(1, 2)).view(b, h, r1 - r0, c)
        p = p.add_(bias[:, r0:r1, :c], alpha=LOG2E).clamp_(min=-LOG2_FLOOR).exp2_().view(b * h, r1 - r0, c)
        if prior.causal:  # the future, only in the block's last keys (above their diagonal): exactly 0
            p[..., c - (r1 - r0):].tril_()
        dv[:, :c] += torch.bmm(p.transpose(1, 2), da[:, r0:r1, :d])
        ds = p.mul_(torch.bmm(da[:, r0:r1], va[:, :c].transpose(1, 2)))
        dq[:, r0:r1] = torch.bmm(ds, ka[:, :c, :d])
        dk[:, :c] += torch.bmm(ds.transpose(1, 2), qa[:, r0:r1, :d])
        if grads is not None:
            grads.add(ds.view(b, h, r1 - r0, c), r0, r1, c, first)
    shape = (b, h, -1, d)
    # qa holds q scale log2(e): dK = dS^T Q scale
    return (dq.mul_(scale).view(shape), dk.div_(LOG2E).view(shape), dv.view(shape),
            None if grads is None else grads.result())


def _augmented(x: torch.Tensor, col, factor: float, col_factor: float = 1.0) -> torch.Tensor:
    """(B, H, L, d) -> (B H, L, d + 1) float32: x times `factor`, a column after it: -col (B, H, L) times
    `col_factor`, or ones where col is None; one pass of dtype conversion."""
    b, h, n, d = x.shape
    out = torch.empty(b * h, n, d + 1, dtype=torch.float32, device=x.device)
    torch.mul(x.reshape(b * h, n, d), factor, out=out[..., :d])
    if col is None:
        out[..., d] = 1.0
    else:
        torch.mul(col.reshape(b * h, n), -col_factor, out=out[..., d])
    return out


class _MGrad:
    """dM of `_backward`, block by block: a full M's rows times sigmoid(-M) into M's shape, a grid's dS by (query,
    key) into its slots at the end, a relative M's by distance (float64)."""

    def __init__(self, prior, t: int, s: int, device):
        self.prior = prior
        if prior.param == "full":
            self.dm, self.row = torch.zeros_like(prior.bias), prior._first_row(t, s)
        elif prior.param == "grid":
            self.dm = torch.zeros(prior.heads, t, s, device=device)
        else:
            self.dm = torch.zeros(prior.bias.shape, dtype=torch.float64, device=device)

    def add(self, ds: torch.Tensor, r0: int, r1: int, c: int, first: int) -> None:
        """ds (B, H, rows, c): dS of query rows r0 .. r1 - 1 and keys 0 .. c - 1."""
        ds, prior = ds.sum(0), self.prior
        if prior.param == "full":
            cc, rows = min(c, prior.n_keys), slice(self.row + r0, self.row + r1)
            torch.mul(ds[..., :cc], mask_bias_grad(prior.bias[:, rows, :cc]), out=self.dm[:, rows, :cc])
        elif prior.param == "grid":
            self.dm[:, r0:r1, :c] = ds
        else:                   # by diagonal: entry e holds key - query = e - rows
            dist = first + r1 - torch.arange(r1 - r0 + c, device=ds.device)
            self.dm.index_add_(1, prior._index(dist), _diagonal_sums(ds).double())

    def result(self) -> torch.Tensor:
        """dM, M's shape and dtype."""
        prior, dm = self.prior, self.dm
        if prior.param == "full":
            return dm
        if prior.param == "grid":                  # by (query, key) into the slots, then as a relative table
            dm = torch.zeros(prior.bias.shape, dtype=torch.float64, device=dm.device).index_add_(
                1, prior._pairs(dm.device).flatten(), dm.flatten(1).double())
        return (dm * mask_bias_grad(prior.bias.double())).to(prior.bias.dtype)


def _log_sigmoid(m: torch.Tensor) -> torch.Tensor:
    """log sigmoid(M) elementwise, as maskprior.mask_bias, to float rounding, in a fresh tensor and four passes (torch's
    logsigmoid takes 25 ns a value on the CPU): log(sigmoid(M)) down to M = -80, M itself below (log sigmoid(M) = M -
    log1p(e^M), and e^-80 is below M's rounding)."""
    out = m.clamp(min=-80.0).sigmoid_().log_()
    return torch.minimum(out, m, out=out)


def _bias(prior, t: int, s: int, dtype: torch.dtype, future: bool = True) -> torch.Tensor:
    """prior(t, dtype, k_len=s), a constant: the (H, T, S) bias of t queries and s keys; a full M's computed here, the
    same to rounding, in one fresh tensor. `future=False`: a causal full M's future keys are left as they come (the
    kernel with is_causal never reads them, nor does `_backward`)."""
    if prior.param != "full" or prior.roles is not None or torch.jit.is_tracing():
        return prior(t, dtype, k_len=s)
    prior.check_set()
    r, c = prior._first_row(t, s), min(s, prior.n_keys)
    bias = _log_sigmoid(prior._logits(prior.bias.detach()[:, r:r + t, :c]))
    if prior.causal and (future or c < s):
        bias = bias.masked_fill_(torch.ones(t, c, dtype=torch.bool, device=bias.device).triu(r + 1), float("-inf"))
        bias = bias if c == s else F.pad(bias, (0, s - c), value=float("-inf"))
    return bias.to(dtype)


class _FusedPrior(torch.autograd.Function):
    """softmax(q k^T / sqrt(d) + log sigmoid(M)) v: forward by torch's fused CPU kernel (the bias a constant, the row
    log-sum-exp saved), backward by `_backward` (M's gradient beside q's, k's and v's)."""

    @staticmethod
    def forward(ctx, q, k, v, m, prior):
        fwd = _cpu_kernel()
        t, s = q.shape[-2], k.shape[-2]
        causal = prior.causal and t == s
        bias = _bias(prior, t, s, q.dtype, future=not causal)
        out, lse = fwd(q, k, v, 0.0, causal, attn_mask=bias.unsqueeze(0))
        ctx.save_for_backward(q, k, v, out, lse, bias)
        ctx.prior = prior
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, bias = ctx.saved_tensors
        dq, dk, dv, dm = _backward(ctx.prior, q, k, v, out, lse, dout, bias, ctx.needs_input_grad[3])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dm, None


# ----------------------------------------------------------------------------------------
# The CPU: a windowed relative prior (a causal table of W distances, the last read past them). Query position p reads
# keys p - W + 1 .. p through the table (the band: by hand, O(T x W)) and keys 0 .. p - W through its last logit c
# (the far part: one logit a head, so the fused kernel's causal attention of the queries shifted by W, no bias, c added
# to its log-sum-exp). The two merge by their log-sum-exps; the backward gives the far part to the kernel's own
# backward (with the merged output and log-sum-exp, as blockwise attention combines blocks), the band's by hand.


def _band_block(t: int, w: int) -> int:
    """The band's query block R for t queries and W distances: each block of R queries reads a window of (m + 1) R
    keys, m = ceil((W - 1) / R); fastest measured (W = 64 .. 256, T = 1,024 .. 2,048): R = 32, 64 from W = 256 on."""
    return max(1, min(t, 64 if w >= 256 else 32 if w >= 32 else 16))


def _band_chunk(bh: int, r: int, m: int, device, budget: int = 1 << 18) -> int:
    """Blocks of queries a step of the band's loop takes: its logits (B H, blocks, R, (m + 1) R) float32 near
    `budget` values (1 MiB) on the CPU, so that each pass over them stays in the cache; 64 times that on a GPU."""
    return max(1, budget * (1 if device.type == "cpu" else 64) // (bh * r * (m + 1) * r))


def _padded(x: torch.Tensor, first: int, r: int, m: int, nb: int) -> torch.Tensor:
    """(B, H, S, e) keys or values -> (B, H, (nb + m) R, e) those at positions first - m R .. first + nb R - 1, where
    the windows of nb blocks of R queries (the first at position `first`) read; zeros before 0 and from S on."""
    s, lo, hi = x.shape[-2], first - m * r, first + nb * r
    inner = x[..., max(lo, 0):min(hi, s), :]
    return inner if lo >= 0 and hi <= s else F.pad(inner, (0, 0, max(0, -lo), max(0, hi - s)))


def _window(xp: torch.Tensor, b0: int, b1: int, r: int, m: int) -> torch.Tensor:
    """(B, H, (nb + m) R, e) `_padded` -> (B, H, b1 - b0, (m + 1) R, e) the windows of query blocks b0 .. b1 - 1 (a
    view): block b's queries at positions first + b R .., its window at first + (b - m) R .. first + (b + 1) R - 1."""
    return xp[:, :, b0 * r:(b1 + m) * r].unfold(2, (m + 1) * r, r).transpose(-2, -1)


def _unpadded(acc: torch.Tensor, s: int, first: int, r: int, m: int) -> torch.Tensor:
    """The adjoint of `_padded`: (B, H, nb + m, R, e) gradients of the padded positions -> (B, H, S, e)."""
    b, h, nbm, _, e = acc.shape
    lo, hi = first - m * r, first + (nbm - m) * r
    acc = acc.view(b, h, nbm * r, e)[:, :, max(0, -lo):nbm * r - max(0, hi - s)]
    return acc if acc.shape[2] == s else F.pad(acc, (0, 0, max(lo, 0), s - min(hi, s)))


def _fold(acc: torch.Tensor, g: torch.Tensor, b0: int, m: int) -> None:
    """The adjoint of `_window`, added in place: g (B, H, n, (m + 1) R, e), the gradients of blocks b0 .. b0 + n - 1's
    windows, into acc (B, H, nb + m, R, e), `_padded`'s positions R at a time."""
    b, h, n, _, e = g.shape
    g = g.view(b, h, n, m + 1, acc.shape[3], e)
    for o in range(m + 1):
        acc[:, :, b0 + o:b0 + o + n] += g[:, :, :, o]


def _band_bias(line: torch.Tensor, r: int, m: int) -> torch.Tensor:
    """(H, >= W) the bias at distances 0 .. W - 1 -> (H, 1, R, (m + 1) R) the bias of a block's window, the same for
    every block: row a, window column c is at distance a + m R - c, the table's there, -inf outside 0 .. W - 1."""
    w = line.shape[1] - 1
    dist = torch.arange(r, device=line.device)[:, None] + m * r - torch.arange((m + 1) * r, device=line.device)
    inside = (dist >= 0) & (dist < w)
    return line[:, dist.clamp(0, w - 1)].masked_fill(~inside, float("-inf")).unsqueeze(1)


def _hide_before_zero(s: torch.Tensor, first: int, r: int, m: int, b0: int) -> torch.Tensor:
    """(B, H, n, R, (m + 1) R) logits of the windows of query blocks b0 .., their keys at positions before 0 set to
    -inf, in place: block b's window column c is at position first + (b - m) R + c."""
    for i in range(s.shape[2]):
        cut = (m - b0 - i) * r - first
        if cut <= 0:
            break
        s[:, :, i, :, :cut] = float("-inf")
    return s


def _blocks(x: torch.Tensor, r: int, nb: int) -> torch.Tensor:
    """(B, H, T, e) -> (B, H, nb, R, e) rows in blocks of R, zeros after the last (a view where nb R = T)."""
    b, h, t, e = x.shape
    return (x if nb * r == t else F.pad(x, (0, 0, 0, nb * r - t))).view(b, h, nb, r, e)


def _band_forward(q, k, v, line, first: int, r: int):
    """softmax over the band alone, R queries a block, a few blocks a step (`_band_chunk`): q (B, H, T, d), k, v
    (B, H, S, d) float32, line (H, W + 1) the bias at distances 0 .. W -> out (B, H, T, d) float32 normalised over the
    band, lse (B, H, T) its log-sum-exp."""
    b, h, t, d = q.shape
    m, nb = -(-(line.shape[1] - 2) // r), -(-t // r)
    qb = _blocks(q * (d ** -0.5 * LOG2E), r, nb)  # in base 2 (exp2 is 3x faster than exp): logits times log2(e)
    kp, vp, bias = _padded(k, first, r, m, nb), _padded(v, first, r, m, nb), _band_bias(line * LOG2E, r, m)
    out, lse = q.new_empty(b, h, nb, r, d), q.new_empty(b, h, nb, r, 1)
    step = _band_chunk(b * h, r, m, q.device)
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        s = torch.matmul(qb[:, :, b0:b1], _window(kp, b0, b1, r, m).transpose(-2, -1)).add_(bias)
        top = _hide_before_zero(s, first, r, m, b0).amax(-1, keepdim=True)
        p = s.sub_(top).clamp_(min=-LOG2_FLOOR).exp2_()
        total = p.sum(-1, keepdim=True)
        out[:, :, b0:b1] = torch.matmul(p, _window(vp, b0, b1, r, m)).div_(total)
        lse[:, :, b0:b1] = top.add_(total.log2_()).div_(LOG2E)
    return out.view(b, h, nb * r, d)[:, :, :t], lse.view(b, h, nb * r)[..., :t]


def _far_call(q, k, v, first: int, w: int):
    """The far part's kernel arguments: (i0, qf, kf, vf, is_causal, mask) where queries i0.. (positions first + i0 ..,
    at least W) read keys 0 .. position - W; None where no query has a far key. Square and causal when the cache
    holds at most W keys, else a -inf mask ((T, S - W), in q's dtype)."""
    t, s = q.shape[-2], k.shape[-2]
    i0 = max(0, w - first)
    if i0 >= t:
        return None
    qf, kf, vf = q[:, :, i0:], k[:, :, :s - w], v[:, :, :s - w]
    if first <= w:
        return i0, qf, kf, vf, True, None
    # CUDA's kernel reads a mask whose rows start 16-aligned (as SDPA pads it)
    wide = s - w if q.device.type == "cpu" else -(-(s - w) // 16) * 16
    late = torch.ones(t, wide, dtype=torch.bool, device=q.device).triu(first - w + 1)
    mask = torch.zeros(t, wide, dtype=q.dtype, device=q.device).masked_fill_(late, float("-inf"))
    return i0, qf, kf, vf, False, mask[None, None, :, :s - w]


def _far_forward(far) -> tuple:
    """The far part's kernel call (`_far_call`'s arguments): (out (B, H, Tf, d), lse (B, H, Tf) float32, what its
    backward needs). The CPU's fused kernel; on CUDA the memory-efficient kernel (it takes float32 too, and a mask),
    whose lse is padded to a multiple of 32 rows."""
    _, qf, kf, vf, causal, mask = far
    if qf.device.type == "cpu":
        out, lse = _cpu_kernel()(qf, kf, vf, 0.0, causal, attn_mask=mask)
        return out, lse, None
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(qf, kf, vf, mask, True, 0.0, causal)
    return out, lse[..., :qf.shape[-2]], (lse.shape[-1], seed, offset)


def _far_backward(far, dout, out, lse, aux) -> tuple:
    """The far part's kernel backward -> (dq (B, H, Tf, d), dk, dv (B, H, S - W, d)), from the merged output, its
    gradient dout (B, H, Tf, d), lse (B, H, Tf) (its probabilities are exp(S - lse)) and `_far_forward`'s aux."""
    _, qf, kf, vf, causal, mask = far
    if aux is None:
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        return kernel(dout, qf, kf, vf, out, lse, 0.0, causal, attn_mask=mask)
    rows, seed, offset = aux
    lse = F.pad(lse, (0, rows - lse.shape[-1])).contiguous()
    grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, qf, kf, vf, mask, out, lse, seed, offset, 0.0, [True, True, True, False], causal)
    return grads[:3]


def _band_merge(out, lse, far, far_out, far_lse, c):
    """The band's (out (B, H, T, d) float32, lse (B, H, T)) and the far part's (its kernel output and log-sum-exp of
    queries i0.., c (H,) its logit added) merged by log-sum-exp -> (out, lse, far lse with c) of all keys."""
    if far is None:
        return out, lse, None
    i0 = far[0]
    far_lse = far_lse + c[:, None]
    both = torch.logaddexp(lse[..., i0:], far_lse)
    out = out.clone()
    out[..., i0:, :].mul_((lse[..., i0:] - both).exp_().unsqueeze(-1))
    out[..., i0:, :].add_(far_out.float() * (far_lse - both).exp_().unsqueeze(-1))
    lse = torch.cat([lse[..., :i0], both], -1)
    return out, lse, far_lse


def _band_backward(q, k, v, dout, lse, d_rows, line, first: int, r: int):
    """The band's part of the gradients (as `_backward`'s), from D = rowsum(dO O) and the merged output's log-sum-exp
    lse, both (B, H, T); the bias's by distance, dS summed over the batch and each diagonal; a few blocks a step.
    q, dout (B, H, T, d), k, v (B, H, S, d), all float32; line (H, W + 1) -> dq, dk, dv as q, k, v; dline (H, W)."""
    b, h, t, d = q.shape
    s, w = k.shape[-2], line.shape[1] - 1
    m, nb = -(-(w - 1) // r), -(-t // r)
    # in base 2 (exp2 is 3x faster than exp): logits and lse times log2(e)
    qb, db = (_blocks(x, r, nb) for x in (q * (d ** -0.5 * LOG2E), dout))
    lse, d_rows = (_blocks(x.unsqueeze(-1), r, nb) for x in (lse * LOG2E, d_rows))
    kp, vp = _padded(k, first, r, m, nb), _padded(v, first, r, m, nb)
    bias, dq, dsum = _band_bias(line * LOG2E, r, m), q.new_empty(b, h, nb, r, d), q.new_zeros(h, r, (m + 1) * r)
    dkp, dvp = q.new_zeros(b, h, nb + m, r, d), q.new_zeros(b, h, nb + m, r, d)
    step = _band_chunk(b * h, r, m, q.device)
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        kw = _window(kp, b0, b1, r, m).contiguous()
        p = torch.matmul(qb[:, :, b0:b1], kw.transpose(-2, -1)).add_(bias).sub_(lse[:, :, b0:b1])
        p = _hide_before_zero(p, first, r, m, b0).clamp_(min=-LOG2_FLOOR).exp2_()
        _fold(dvp, torch.matmul(p.transpose(-2, -1), db[:, :, b0:b1]), b0, m)
        dp = torch.matmul(db[:, :, b0:b1], _window(vp, b0, b1, r, m).transpose(-2, -1))
        ds = p.mul_(dp.sub_(d_rows[:, :, b0:b1]))
        dq[:, :, b0:b1] = torch.matmul(ds, kw)
        _fold(dkp, torch.matmul(ds.transpose(-2, -1), qb[:, :, b0:b1]), b0, m)
        dsum += ds.sum(0).sum(1)
    # a window's diagonal e holds column - row = e - R, distance (m + 1) R - e
    dline = _diagonal_sums(dsum)[:, (m + 1) * r - torch.arange(w, device=q.device)]
    dq = dq.view(b, h, nb * r, d)[:, :, :t].mul_(d ** -0.5)
    return dq, _unpadded(dkp.div_(LOG2E), s, first, r, m), _unpadded(dvp, s, first, r, m), dline


class _BandPrior(torch.autograd.Function):
    """The band and the far part (above) as one function. Backward: the far part's by the kernel's own, given the
    merged output and log-sum-exp (minus c); the band's by hand (`_band_backward`); c's gradient, sum_ij P_ij
    (dP_ij - D_i) = sum_i w_i (dO_i . O_far,i - D_i), w_i the far part's share of row i, O_far its output.
    q (B, H, T, d), k, v (B, H, S, d), line (H, W + 1) the bias at distances 0 .. W -> (B, H, T, d)."""

    @staticmethod
    def forward(ctx, q, k, v, line, w):
        t, s = q.shape[-2], k.shape[-2]
        # the band in float32 under autocast too (the far part's kernel takes q's dtype)
        with torch.autocast(q.device.type, enabled=False):
            lf, far = line.detach().float(), _far_call(q, k, v, s - t, w)
            out, lse = _band_forward(q.float(), k.float(), v.float(), lf, s - t, _band_block(t, w))
            far_out, far_lse, ctx.aux = (None, None, None) if far is None else _far_forward(far)
            out, lse, far_lse = _band_merge(out, lse, far, far_out, far_lse, lf[:, w])
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, far_out, far_lse, line)
        ctx.w = w
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, far_out, far_lse, line = ctx.saved_tensors
        t, s, w, lf = q.shape[-2], k.shape[-2], ctx.w, line.float()
        dout = dout.contiguous()
        d_rows = (dout.float() * out.float()).sum(-1)
        dq, dk, dv, dline = _band_backward(q.float(), k.float(), v.float(), dout.float(), lse, d_rows, lf, s - t,
                                           _band_block(t, w))
        far, dfar = _far_call(q, k, v, s - t, w), torch.zeros(line.shape[0], 1, device=q.device)
        if far is not None:
            i0 = far[0]
            gq, gk, gv = _far_backward(far, dout[:, :, i0:], out[:, :, i0:], lse[..., i0:] - lf[:, w, None], ctx.aux)
            dq[:, :, i0:] += gq
            dk[:, :, :s - w] += gk
            dv[:, :, :s - w] += gv
            mass = (far_lse - lse[..., i0:]).exp_()
            each = (dout[:, :, i0:].float() * far_out.float()).sum(-1).sub_(d_rows[..., i0:])
            dfar = (mass * each).sum((0, 2)).unsqueeze(1)
        dline = torch.cat([dline, dfar], 1).to(line.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dline, None


def _prior_band(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prior) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + log sigmoid(M)) v of a causal relative prior of W = prior.n distances by the band and
    the far part (`_BandPrior`; on CUDA the far part is the memory-efficient kernel's). q (B, H, T, d), k, v
    (B, H, S, d) float32 or bfloat16, queries after a cache of S - T keys -> (B, H, T, d)."""
    t, s = q.shape[-2], k.shape[-2]
    prior._first_row(t, s)
    prior.check_set()
    line = prior.at_distance(torch.arange(prior.n + 1, device=q.device))
    return _BandPrior.apply(q, k, v, line, prior.n)


__all__ = ["prior_attention", "prior_flex", "mask_bias_grad"]  # the public names (`from maskprior_fast import *`)
