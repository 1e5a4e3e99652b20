"""maskprior: a structural prior written into the attention logits as a learnable mask.

Reference implementation of "Mask-Based Priors Are More Persistent than Query-Key
Initializations" (Ma, Saratchandran, Gordon, Lucey, 2026):

    Attention(X) = softmax( X Wq (X Wk)^T / sqrt(d_head) + log sigmoid(M) ) X Wv

M is a learnable (heads, N, N) matrix per layer, initialised from a task's interaction
pattern P (bool, True = allowed pair): M = +m_on where P, -m_off elsewhere. Because
log sigmoid(M) <= 0 the mask can only suppress, and its gradient is bounded by the
attention probability (see `mask_grad_bound`), so the prior survives training. The
baselines write the same pattern into Wq, Wk instead (`init_qk_svd_`, `init_qk_opt_`).

Models: `Transformer` (a token encoder with a CLS / mean / per-token readout, or with
`causal=True` a decoder / language model; `generate` samples from it) and `ViT`, two
embeddings on one `Trunk` of `Block`s.

This file imports only torch and the standard library: copy it into your codebase.
Reading order: pattern builders -> mask helpers -> attention -> blocks -> models ->
sampling -> initialisers -> optimiser groups -> probes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------
# Pattern builders: bool tensors, (N, N) for all heads or (H, N, N) per head.
# Row i lists the keys that query i is allowed to attend to.


def pattern_from_pairs(n: int, pairs, symmetric: bool = False, self_loops: bool = True) -> torch.Tensor:
    """(N, N) bool pattern with True at each (query, key) pair; optionally symmetric, with diagonal."""
    p = torch.zeros(n, n, dtype=torch.bool)
    for i, j in pairs:
        p[i, j] = True
        if symmetric:
            p[j, i] = True
    if self_loops:
        p.fill_diagonal_(True)
    return p


def banded_pattern(n: int, width: int, circulant: bool = False) -> torch.Tensor:
    """(N, N) bool pattern, True where |i - j| <= width (distance taken mod N if circulant)."""
    i = torch.arange(n)
    d = (i[:, None] - i[None, :]).abs()
    if circulant:
        d = torch.minimum(d, n - d)
    return d <= width


def embed_pattern(pattern: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    """Place a (..., K, K) pattern at rows/cols [offset, offset+K) of a (..., N, N) False pattern."""
    out = torch.zeros(*pattern.shape[:-2], n, n, dtype=torch.bool)
    k = pattern.shape[-1]
    out[..., offset:offset + k, offset:offset + k] = pattern
    return out


def impulse_pattern(grid_h: int, grid_w: int, offsets, n_prefix: int = 0, prefix_all: bool = True) -> torch.Tensor:
    """(H, N, N) convolution-like patterns on a patch grid, one (dr, dc) offset per head.

    Patch (r, c) attends to patch (r + dr, c + dc); a patch whose neighbour leaves the grid
    falls back to itself. `n_prefix` tokens (e.g. CLS) come first in the sequence; with
    `prefix_all` they attend to, and are attended by, every token.
    """
    n = n_prefix + grid_h * grid_w
    pats = []
    for dr, dc in offsets:
        p = torch.zeros(n, n, dtype=torch.bool)
        for r in range(grid_h):
            for c in range(grid_w):
                rr, cc = r + dr, c + dc
                if not (0 <= rr < grid_h and 0 <= cc < grid_w):
                    rr, cc = r, c
                p[n_prefix + r * grid_w + c, n_prefix + rr * grid_w + cc] = True
        if n_prefix:
            p[:n_prefix, :] = prefix_all
            p[:, :n_prefix] = prefix_all
            p[:n_prefix, :n_prefix] |= torch.eye(n_prefix, dtype=torch.bool)
        pats.append(p)
    return torch.stack(pats)


# The 3x3 offsets in the order of the 2025 structured-initialization code:
# self, up, right, left, down, then the diagonals.
IMPULSE_OFFSETS = [(0, 0), (-1, 0), (0, 1), (0, -1), (1, 0), (-1, -1), (-1, 1), (1, -1), (1, 1)]


def random_impulse_offsets(n_heads: int, kernel: int = 3, generator: torch.Generator | None = None):
    """One random (dr, dc) offset per head inside a kernel x kernel window (heads may repeat)."""
    idx = torch.randint(0, kernel * kernel, (n_heads,), generator=generator).tolist()
    return [(k // kernel - kernel // 2, k % kernel - kernel // 2) for k in idx]


def causal_pattern(n: int) -> torch.Tensor:
    """(N, N) bool, True where key j <= query i."""
    return torch.ones(n, n, dtype=torch.bool).tril()


def future_keys(t: int, device=None) -> torch.Tensor:
    """(T, T) bool, True where key j > query i: what a causal layer never sees."""
    return torch.ones(t, t, dtype=torch.bool, device=device).triu(1)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """(H,) ALiBi slopes 2^(-8 h / H), h = 1..H."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / n_heads) for h in range(n_heads)])


def causal_distance_logits(n: int, n_heads: int, self_logit: float = 10.0) -> torch.Tensor:
    """(H, N, N) mask logits M with log sigmoid(M) = -slope_h * (i - j) on the past (ALiBi-like).

    M = logit(exp(-slope * d)) for distance d = i - j >= 1; at d = 0 the logit is infinite
    and is clamped to `self_logit` (log sigmoid(10) = -4.5e-5). Future entries get
    -self_logit; the hard causal mask removes them anyway.
    """
    i = torch.arange(n)
    d = (i[:, None] - i[None, :]).float()
    p = torch.exp(-alibi_slopes(n_heads)[:, None, None].double() * d.clamp(min=1).double())
    m = (torch.log(p) - torch.log1p(-p)).float()          # logit(p), finite for d >= 1
    m = m.masked_fill(d == 0, self_logit)
    return m.masked_fill(d < 0, -self_logit)


# ----------------------------------------------------------------------------------------
# Mask helpers


def mask_logits_from_pattern(pattern: torch.Tensor, m_on: float = 5.0, m_off: float = 5.0) -> torch.Tensor:
    """Initial M: +m_on on allowed pairs, -m_off elsewhere (same shape as `pattern`)."""
    return torch.where(pattern, torch.tensor(float(m_on)), torch.tensor(-float(m_off)))


def mask_bias(mask_logits: torch.Tensor) -> torch.Tensor:
    """The additive attention bias log sigmoid(M), always <= 0."""
    return F.logsigmoid(mask_logits)


def mask_grad_bound(attn: torch.Tensor, attn_grad: torch.Tensor, mask_logits: torch.Tensor) -> torch.Tensor:
    """Theorem 1's bound on |dL/dM| (H, N, N), from the attention probabilities.

    attn, attn_grad: (B, H, N, N) probabilities p and upstream gradients g = dL/dp of one
    layer; mask_logits: (H, N, N). Through the softmax and d logsigmoid(m)/dm = sigma(-m),
        dL/dM_ij = sigma(-M_ij) * sum_b p_bij * (g_bij - sum_k p_bik g_bik),
    and the bracket lies within max_k g_bik - min_k g_bik, so
        |dL/dM_ij| <= sigma(-M_ij) * sum_b p_bij * (max_k g_bik - min_k g_bik).
    The mask's gradient is thus at most the attention probability (times sigma(-M) <= 1)
    times the gradient's spread; it does not grow with ||q|| or ||k|| as the QK gradients do.
    """
    spread = attn_grad.amax(-1, keepdim=True) - attn_grad.amin(-1, keepdim=True)
    return torch.sigmoid(-mask_logits) * (attn * spread).sum(0)


# ----------------------------------------------------------------------------------------
# The prior: one small module that owns M and gives the additive bias, for our Attention or
# for any attention that adds a mask to its logits.


class MaskPrior(nn.Module):
    """The learnable prior of one attention layer: M -> the additive bias log sigmoid(M), plus -inf
    on future keys when `causal`. `param="full"`: M is (heads, n, n), one logit per (query, key);
    `param="relative"`: one logit per head and distance i - j, a (heads, n) table when causal
    ((heads, 2n - 1) otherwise), log sigmoid taken on the table and then gathered, so the prior
    costs O(heads x n) parameters instead of O(heads x n^2). M starts from `pattern` (bool (n, n)
    or (heads, n, n): +m_on on allowed pairs, -m_off elsewhere), from `logits`, or at 0 (the same
    constant on every logit: no prior until `init_mask_` sets it). Shaped for the caller:

        prior(t)                -> (heads, t, t)          F.scaled_dot_product_attention(attn_mask=...)
        prior.for_mha(b, t)     -> (b * heads, t, t)      nn.MultiheadAttention(attn_mask=...)
        prior.for_4d(b, t)      -> (b, heads, t, t)       a 4-D additive mask (Hugging Face style)

    t defaults to n and must equal it, except in a causal prior, which may read a prefix (a
    prompt). Keep M out of weight decay (`param_groups` does), or the decay erases the prior.
    """

    def __init__(self, n: int, heads: int = 1, pattern: torch.Tensor | None = None, m_on: float = 5.0,
                 m_off: float = 5.0, causal: bool = False, logits: torch.Tensor | None = None, param: str = "full"):
        super().__init__()
        if param not in ("full", "relative"):
            raise ValueError(f"MaskPrior param must be 'full' or 'relative', got {param!r}")
        self.n, self.heads, self.causal, self.param = n, heads, causal, param
        size = (heads, n, n) if param == "full" else (heads, n if causal else 2 * n - 1)
        self.mask_logits = nn.Parameter(torch.zeros(size))
        src = logits if logits is not None else None if pattern is None else mask_logits_from_pattern(pattern, m_on,
                                                                                                       m_off)
        if src is not None:
            self.set_logits(src)

    def extra_repr(self) -> str:
        return f"n={self.n}, heads={self.heads}, causal={self.causal}, param={self.param}"

    def _distance(self, t: int) -> torch.Tensor:
        """(t, t) index into the relative table: i - j (causal; future keys clamped to 0, masked
        later), or i - j + n - 1."""
        i = torch.arange(t, device=self.mask_logits.device)
        d = i[:, None] - i[None, :]
        return d.clamp(min=0) if self.causal else d + self.n - 1

    @torch.no_grad()
    def set_logits(self, logits: torch.Tensor) -> None:
        """M from full logits (n, n) or (heads, n, n); a relative prior takes them only if they depend
        on i - j alone (on and below the diagonal when causal)."""
        full = _per_head(logits, self.heads, self.n).float().to(self.mask_logits.device)
        if self.param == "full":
            self.mask_logits.copy_(full)
            return
        idx = self._distance(self.n).expand(self.heads, -1, -1)
        seen = torch.ones(self.n, self.n, dtype=torch.bool, device=full.device)
        seen = seen.tril() if self.causal else seen
        table = torch.zeros_like(self.mask_logits).scatter_(1, idx[:, seen].view(self.heads, -1),
                                                            full[:, seen].view(self.heads, -1))
        if not torch.equal(table.gather(1, idx[:, seen].view(self.heads, -1)), full[:, seen].view(self.heads, -1)):
            raise ValueError("a relative MaskPrior holds one logit per head and distance i - j, but these logits "
                             "differ along a diagonal; use param='full' for them")
        self.mask_logits.copy_(table)

    def full_logits(self) -> torch.Tensor:
        """M as (heads, n, n) logits (a relative table expanded; future entries of a causal one are
        its distance-0 logit, and masked in the bias)."""
        if self.param == "full":
            return self.mask_logits
        return self.mask_logits[:, self._distance(self.n)]

    def forward(self, t: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = self.n if t is None else t
        if t > self.n or (t < self.n and not self.causal):
            raise ValueError(f"sequence length {t} does not fit the mask size {self.n}: M covers exactly {self.n} "
                             f"positions (a shorter sequence is allowed only in a causal layer, as a prefix)")
        if self.param == "full":
            bias = mask_bias(self.mask_logits[:, :t, :t].float())
        else:                                       # log sigmoid on the small table, then a gather
            bias = mask_bias(self.mask_logits.float())[:, self._distance(t)]
        if self.causal:
            bias = bias.masked_fill(future_keys(t, bias.device), float("-inf"))
        return bias if dtype is None else bias.to(dtype)

    def for_mha(self, batch: int, t: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """(batch * heads, t, t), batch-major as nn.MultiheadAttention reads a 3-D attn_mask."""
        return self(t, dtype).repeat(batch, 1, 1)

    def for_4d(self, batch: int, t: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """(batch, heads, t, t): add a padding mask of shape (batch, 1, 1, t) to it if you have one."""
        b = self(t, dtype)
        return b.unsqueeze(0).expand(batch, *b.shape)


def mask_priors(model: nn.Module) -> list[MaskPrior]:
    return [m for m in model.modules() if isinstance(m, MaskPrior)]


def _mha_prior_hook(mha: nn.MultiheadAttention, args: tuple, kwargs: dict):
    """Forward pre-hook of a retrofitted nn.MultiheadAttention: its MaskPrior's bias becomes the
    attn_mask (added to one the caller gave; a causal call's -inf folded in, since MHA drops a
    mask it takes for the causal one)."""
    names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights",
             "is_causal")
    kwargs = {**dict(zip(names, args)), **kwargs}
    query, key = kwargs["query"], kwargs["key"]
    batched = query.dim() == 3
    t = query.shape[1 if mha.batch_first else 0] if batched else query.shape[0]
    s = key.shape[1 if mha.batch_first else 0] if batched else key.shape[0]
    if s != t:
        raise ValueError(f"a MaskPrior needs self-attention: {t} queries but {s} keys in this nn.MultiheadAttention")
    bias = mha.mask_prior(t, query.dtype)
    if batched:
        bias = bias.repeat(query.shape[0 if mha.batch_first else 1], 1, 1)
    given = kwargs.get("attn_mask")
    if given is not None:
        if given.dtype == torch.bool:                    # True = not allowed, for nn.MultiheadAttention
            given = torch.zeros(given.shape, dtype=bias.dtype, device=bias.device).masked_fill(given, float("-inf"))
        bias = bias + given
    if kwargs.get("is_causal"):
        bias = bias.masked_fill(future_keys(t, bias.device), float("-inf"))
        kwargs["is_causal"] = False
    padding = kwargs.get("key_padding_mask")
    if padding is not None and padding.dtype == torch.bool:  # one mask type for both, as MHA wants
        kwargs["key_padding_mask"] = torch.zeros(padding.shape, dtype=bias.dtype,
                                                 device=bias.device).masked_fill(padding, float("-inf"))
    kwargs["attn_mask"] = bias
    return (), kwargs


def add_mask_prior(model: nn.Module, pattern: torch.Tensor | None = None, m_on: float = 5.0, m_off: float = 5.0,
                   causal: bool = False, logits: torch.Tensor | None = None) -> list[MaskPrior]:
    """Give every nn.MultiheadAttention inside `model` (e.g. an nn.TransformerEncoder's layers) its
    own MaskPrior, started from `pattern` (bool (N, N) or (heads, N, N)) or `logits`, and passed as
    its attn_mask on every call (a forward pre-hook; any hook also turns off PyTorch's fused
    encoder fast path, which would bypass the mask, and nested-tensor inputs are turned off).
    The priors are submodules (`mha.mask_prior`): make the optimiser after this call, with
    `param_groups`. Returns the priors. Self-attention over exactly N positions only."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    if not found:
        raise ValueError(f"add_mask_prior: {type(model).__name__} holds no nn.MultiheadAttention; for an attention "
                         f"that calls scaled_dot_product_attention itself, own a MaskPrior and pass prior(T) as "
                         f"its attn_mask")
    src = logits if logits is not None else pattern
    if src is None or src.dim() not in (2, 3):
        raise ValueError("add_mask_prior needs a pattern or logits of shape (N, N) or (heads, N, N)")
    priors = []
    for name, mha in found:
        where = name or type(model).__name__
        if hasattr(mha, "mask_prior"):
            raise ValueError(f"add_mask_prior: {where} already has a MaskPrior")
        if src.dim() == 3 and src.shape[0] != mha.num_heads:
            raise ValueError(f"add_mask_prior: {where} has {mha.num_heads} heads, but the pattern has shape "
                             f"{tuple(src.shape)}; give (N, N) or ({mha.num_heads}, N, N)")
        prior = MaskPrior(src.shape[-1], mha.num_heads, pattern, m_on, m_off, causal, logits)
        mha.mask_prior = prior.to(mha.out_proj.weight.device)
        mha.register_forward_pre_hook(_mha_prior_hook, with_kwargs=True)
        priors.append(mha.mask_prior)
    for m in model.modules():
        if isinstance(m, nn.TransformerEncoder):
            m.use_nested_tensor = False          # a nested (padded) batch would skip the attn_mask
    return priors


# ----------------------------------------------------------------------------------------
# Attention


class Attention(nn.Module):
    """Multi-head self-attention with an optional learnable log-sigmoid mask.

    x: (B, T, dim) -> (B, T, dim). With `mask_size=N` the module owns M, a (heads, N, N)
    parameter, and T must equal N; the bias log sigmoid(M) is added to the logits. M starts
    at 0, which adds the same constant to every logit, i.e. no prior until `init_mask_` sets
    it. `causal=True` adds a hard -inf on future keys; only then may T be shorter than N
    (a prefix, e.g. a prompt while generating), and the bias is M's top-left T x T block.
    `fused=True` uses F.scaled_dot_product_attention; the explicit path (`fused=False`, or
    `return_attn=True`) also returns the (B, heads, T, T) attention probabilities.
    """

    def __init__(self, dim: int, n_heads: int, head_dim: int | None = None, mask_size: int | None = None,
                 causal: bool = False, qkv_bias: bool = False, fused: bool = True, mask_param: str = "full"):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = head_dim or dim // n_heads
        self.causal = causal
        self.fused = fused
        inner = n_heads * self.head_dim
        # registered first, so that parameters (and optimiser states) keep the order they had when
        # M was the layer's own parameter
        self.prior = MaskPrior(mask_size, n_heads, causal=causal, param=mask_param) if mask_size else None
        self.qkv = nn.Linear(dim, 3 * inner, bias=qkv_bias)
        self.proj = nn.Linear(inner, dim)

    @property
    def mask_logits(self) -> nn.Parameter | None:
        """The layer's M (heads, N, N), or None without a prior."""
        return None if self.prior is None else self.prior.mask_logits

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        old = prefix + "mask_logits"                   # checkpoints written before M moved into `prior`
        if old in state_dict:
            state_dict[prefix + "prior.mask_logits"] = state_dict.pop(old)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def attn_bias(self, t: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """(heads, T, T) additive bias: log sigmoid(M) plus -inf on the future if causal (None without M)."""
        return None if self.prior is None else self.prior(t, dtype)

    def forward(self, x: torch.Tensor, return_attn: bool = False):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        bias = self.attn_bias(t, q.dtype, q.device)
        attn = None
        if self.fused and not return_attn:
            if bias is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
            else:  # never pass both attn_mask and is_causal: the causal -inf is already in bias
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            logits = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5
            if bias is not None:
                logits = logits + bias
            elif self.causal:
                logits = logits.masked_fill(future_keys(t, x.device), float("-inf"))
            attn = logits.softmax(dim=-1)
            out = attn @ v
        out = out.transpose(1, 2).reshape(b, t, -1)
        return self.proj(out), attn


class MLP(nn.Sequential):
    def __init__(self, dim: int, hidden: int, dropout: float = 0.0):
        super().__init__(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, dim),
                         nn.Dropout(dropout))


@dataclass
class TrunkConfig:
    """What every model here shares: a stack of pre-LN blocks (the fields of `Block`)."""
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    head_dim: int | None = None     # default dim // n_heads
    mlp_dim: int = 256              # hidden units of the MLP
    learnable_mask: bool = False    # own an M per layer (set it with init_mask_)
    fused: bool = True              # F.scaled_dot_product_attention, or the explicit softmax
    qkv_bias: bool = False
    dropout: float = 0.0
    pos_init_std: float = 1.0       # positional embedding ~ N(0, std^2)
    drop_path: float = 0.0          # stochastic depth: the last block skips its branches with this probability
    mask_param: str = "full"        # M per (query, key), or "relative": per distance i - j (MaskPrior)


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth: zero a residual branch for a random fraction p of the samples, scale the
    others by 1 / (1 - p). x: (B, ...) -> same; the identity when not training or p = 0."""
    if not training or p == 0.0:
        return x
    keep = x.new_empty(x.shape[0], *([1] * (x.dim() - 1))).bernoulli_(1.0 - p)
    return x * keep / (1.0 - p)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(LN(x)), then x + mlp(LN(x)). (B, T, dim) -> same.

    `mask_size`: the positions N of the layer's M (None: no M); `causal`: hide future keys;
    `drop_path`: this block's stochastic-depth probability."""

    def __init__(self, cfg: TrunkConfig, mask_size: int | None = None, causal: bool = False, drop_path: float = 0.0):
        super().__init__()
        self.drop_path = drop_path
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.n_heads, cfg.head_dim, mask_size, causal, cfg.qkv_bias, cfg.fused,
                              cfg.mask_param)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg.dim, cfg.mlp_dim, cfg.dropout)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, return_attn: bool = False):
        a, attn = self.attn(self.ln1(x), return_attn)
        x = x + drop_path(self.drop(a), self.drop_path, self.training)
        x = x + drop_path(self.mlp(self.ln2(x)), self.drop_path, self.training)
        return x, attn


# ----------------------------------------------------------------------------------------
# Models: one trunk, two front ends. `Transformer` embeds tokens, `ViT` embeds patches;
# both then run the same blocks, final LayerNorm, readout and linear head.


class Trunk(nn.Module):
    """The shared part of every model: embed -> blocks -> LayerNorm -> readout -> head.

    A subclass sets `blocks` (via `_build_trunk`), `head`, `readout` ('cls': the first
    token, 'mean': average over tokens, 'tokens': every token) and defines `embed(inputs)
    -> (B, N, dim)`. The QK initialisers and probes rely on `blocks` and `pos_emb` (1, N, dim).
    """

    def _build_trunk(self, cfg: TrunkConfig, n_positions: int, causal: bool = False) -> None:
        mask_size = n_positions if cfg.learnable_mask else None
        rates = [cfg.drop_path * i / max(1, cfg.n_layers - 1) for i in range(cfg.n_layers)]   # timm's: 0 to drop_path
        self.blocks = nn.ModuleList([Block(cfg, mask_size, causal, rate) for rate in rates])
        self.ln_f = nn.LayerNorm(cfg.dim)

    def forward(self, inputs: torch.Tensor, return_attn: bool = False):
        """-> outputs, or (outputs, [per-layer (B, heads, N, N) attention]) with `return_attn`."""
        x = self.embed(inputs)
        maps = []
        for block in self.blocks:
            x, attn = block(x, return_attn)
            maps.append(attn)
        x = self.ln_f(x)
        if self.readout == "cls":
            x = x[:, 0]
        elif self.readout == "mean":
            x = x.mean(dim=1)
        out = self.head(x)
        return (out, maps) if return_attn else out


@dataclass
class TransformerConfig(TrunkConfig):
    """A token-input Transformer. N = seq_len (+1 with a CLS token) positions."""
    vocab_size: int = 2
    seq_len: int = 15
    n_outputs: int = 1
    readout: str = "cls"            # 'cls' (prepend a CLS token), 'mean' (average pool), 'tokens' (per token)
    causal: bool = False
    emb_init_std: float = 1.0       # token and CLS embeddings ~ N(0, std^2) (GOTU: 1)
    tie_embeddings: bool = False    # output head shares the token embedding (language models)

    @property
    def n_positions(self) -> int:
        return self.seq_len + (1 if self.readout == "cls" else 0)


class Transformer(Trunk):
    """Token ids (B, T) with T <= seq_len -> (B, n_outputs) for 'cls'/'mean', (B, T, n_outputs) for 'tokens'.

    With the GOTU settings (vocab 2, CLS readout, one output) this is the Boolean model of
    Abbe et al. 2023; with `causal=True, readout='tokens'` it is a decoder / language model.
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        if cfg.readout not in ("cls", "mean", "tokens"):
            raise ValueError(f"readout must be 'cls', 'mean' or 'tokens', got {cfg.readout!r}")
        self.cfg, self.readout = cfg, cfg.readout
        n = cfg.n_positions
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.dim)) if cfg.readout == "cls" else None
        self.pos_emb = nn.Parameter(torch.zeros(1, n, cfg.dim))
        self.drop = nn.Dropout(cfg.dropout)
        self._build_trunk(cfg, n, cfg.causal)
        self.head = nn.Linear(cfg.dim, cfg.n_outputs, bias=not cfg.tie_embeddings)
        for emb in (self.tok_emb.weight, self.cls):
            if emb is not None:
                nn.init.normal_(emb, std=cfg.emb_init_std)
        nn.init.normal_(self.pos_emb, std=cfg.pos_init_std)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) ids -> (B, N, dim) input to the first block (CLS prepended, positions added)."""
        x = self.tok_emb(idx)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        return self.drop(x + self.pos_emb[:, :x.shape[1]])


@dataclass
class ViTConfig(TrunkConfig):
    """Vision Transformer; ViT-Tiny by default (dim 192, depth 12, 3 heads, MLP 768)."""
    dim: int = 192
    n_layers: int = 12
    n_heads: int = 3
    mlp_dim: int = 768
    qkv_bias: bool = True
    pos_init_std: float = 0.02
    image_size: int = 32
    patch_size: int = 4
    in_chans: int = 3
    n_classes: int = 10
    pool: str = "mean"              # 'mean' (global average pooling) or 'cls'

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def n_prefix(self) -> int:
        return 1 if self.pool == "cls" else 0

    @property
    def n_positions(self) -> int:
        return self.n_prefix + self.grid ** 2


class ViT(Trunk):
    """Images (B, C, H, W) float -> logits (B, n_classes). Patches are numbered row-major after the prefix."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        if cfg.pool not in ("mean", "cls"):
            raise ValueError(f"pool must be 'mean' or 'cls', got {cfg.pool!r}")
        if cfg.image_size % cfg.patch_size:
            raise ValueError(f"image size {cfg.image_size} is not a multiple of patch size {cfg.patch_size}")
        self.cfg, self.readout = cfg, cfg.pool
        n = cfg.n_positions
        self.patch_embed = nn.Conv2d(cfg.in_chans, cfg.dim, cfg.patch_size, cfg.patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.dim)) if cfg.pool == "cls" else None
        self.pos_emb = nn.Parameter(torch.randn(1, n, cfg.dim) * cfg.pos_init_std)
        self.drop = nn.Dropout(cfg.dropout)
        self._build_trunk(cfg, n)
        self.head = nn.Linear(cfg.dim, cfg.n_classes)
        self.apply(_vit_init)
        if self.cls is not None:
            nn.init.normal_(self.cls, std=0.02)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, N, dim) tokens (CLS first if any) with positions added."""
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        return self.drop(x + self.pos_emb)


def _vit_init(m: nn.Module):
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


# ----------------------------------------------------------------------------------------
# Sampling from a causal Transformer


@torch.no_grad()
def generate(model: Transformer, idx: torch.Tensor, n_new: int, temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample `n_new` tokens after `idx` (B, T) from a causal Transformer with readout 'tokens';
    the context is cropped to the last seq_len tokens. temperature 0 = greedy. -> (B, T + n_new)."""
    for _ in range(n_new):
        logits = model(idx[:, -model.cfg.seq_len:])[:, -1].float()
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


# ----------------------------------------------------------------------------------------
# Initialisers: act in place, return a small report. `pattern` is (N, N) or (H, N, N) bool.


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def _per_head(pattern: torch.Tensor, n_heads: int, n: int) -> torch.Tensor:
    """(N, N) or (H, N, N) -> (H, N, N); raises unless N is the layer's `n` positions."""
    if pattern.dim() not in (2, 3) or (pattern.dim() == 3 and pattern.shape[0] != n_heads) \
            or tuple(pattern.shape[-2:]) != (n, n):
        raise ValueError(f"a pattern or mask of shape {tuple(pattern.shape)} does not fit a layer with {n_heads} "
                         f"heads and {n} positions: expected ({n}, {n}) or ({n_heads}, {n}, {n}); build it "
                         f"for the model's own token layout (with or without a CLS token)")
    return pattern.unsqueeze(0).expand(n_heads, -1, -1) if pattern.dim() == 2 else pattern


@torch.no_grad()
def init_mask_(model: nn.Module, pattern: torch.Tensor | None = None, m_on: float = 5.0, m_off: float = 5.0,
               logits: torch.Tensor | None = None) -> dict:
    """Set the M of every MaskPrior in the model to +m_on on `pattern`, -m_off elsewhere (or to
    given `logits`).

    `pattern` (N, N) or (H, N, N) bool, or `logits` of those shapes, must be built for the
    model's own N positions (e.g. with or without a CLS token in front): every attention layer
    must already own an M (build the model with `learnable_mask=True`, `Attention(mask_size=N)`,
    or `add_mask_prior`) of that size, or this raises; it never creates or resizes M, since an
    optimiser made earlier would not see a new parameter. Give M to the optimiser without weight decay
    (`param_groups`), or the decay pulls it to 0 and erases the prior.
    """
    src = logits if logits is not None else mask_logits_from_pattern(pattern, m_on, m_off)
    if any(attn.prior is None for attn in attention_layers(model)) or not mask_priors(model):
        raise ValueError("init_mask_: an attention layer has no M; build the model with learnable_mask=True "
                         "(or Attention(..., mask_size=N)), or give your own attention a MaskPrior")
    for prior in mask_priors(model):
        prior.set_logits(src)
    if logits is not None:
        return {"m_min": float(logits.min()), "m_max": float(logits.max())}
    return {"m_on": m_on, "m_off": m_off, "allowed_fraction": float(pattern.float().mean())}


def pseudo_input(model: nn.Module, block: Block | None = None) -> torch.Tensor:
    """(N, dim) LayerNorm(positional embedding): what the QK inits fit the pattern on. Expects
    `model.pos_emb` (1, N, dim) and `model.blocks` (each with `ln1`), as `Transformer` and `ViT` have."""
    block = block or model.blocks[0]
    with torch.no_grad():
        return block.ln1(model.pos_emb[0]).detach()


def _set_qk_(attn: Attention, wq: torch.Tensor, wk: torch.Tensor):
    """wq, wk: (H, dim, head_dim) so that head h computes q = x @ wq[h]."""
    inner = attn.n_heads * attn.head_dim
    w = attn.qkv.weight
    w[:inner].copy_(wq.transpose(1, 2).reshape(inner, -1))
    w[inner:2 * inner].copy_(wk.transpose(1, 2).reshape(inner, -1))
    if attn.qkv.bias is not None:
        attn.qkv.bias[:2 * inner].zero_()


def qk_weights(attn: Attention) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, dim, head_dim) query and key maps of one attention layer."""
    h, r = attn.n_heads, attn.head_dim
    w = attn.qkv.weight
    wq = w[:h * r].reshape(h, r, -1).transpose(1, 2)
    wk = w[h * r:2 * h * r].reshape(h, r, -1).transpose(1, 2)
    return wq, wk


@torch.no_grad()
def pseudo_attention(attn: Attention, pseudo: torch.Tensor) -> torch.Tensor:
    """(H, N, N) attention of the pseudo input (N, dim) through one layer's Wq, Wk (no mask)."""
    wq, wk = qk_weights(attn)
    q = torch.einsum("nd,hdr->hnr", pseudo, wq)
    k = torch.einsum("nd,hdr->hnr", pseudo, wk)
    return (q @ k.transpose(1, 2) * attn.head_dim ** -0.5).softmax(-1)


def _trunc_normal(shape, std: float, bound: float, generator=None) -> torch.Tensor:
    """N(0, std^2) samples redrawn until they fall inside [-bound, bound]."""
    x = torch.randn(shape, generator=generator) * std
    while True:
        bad = x.abs() > bound
        if not bad.any():
            return x
        x[bad] = torch.randn(int(bad.sum()), generator=generator) * std


def _pinv_rank(p: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank-truncated pseudo-inverse of p (N, D) -> (D, N): keep the top `rank` singular values."""
    u, s, vh = torch.linalg.svd(p, full_matrices=False)
    keep = min(rank, int((s > s[0] * 1e-6).sum()))
    return vh[:keep].T @ torch.diag(1.0 / s[:keep]) @ u[:, :keep].T


@torch.no_grad()
def init_qk_svd_(model: nn.Module, pattern: torch.Tensor, scale: float = 1000.0, noise: float = 3.0,
                 factor_norm: float = 7.0, pos_scale: float | None = None,
                 generator: torch.Generator | None = None) -> dict:
    """Closed-form QK init (Zheng, Li, Saratchandran, Lucey 2025), solved for every layer.

    Per layer and head: target logits L = scale * pattern + noise * trunc_normal(0.6) off the
    pattern; A = pinv(P) L pinv(P)^T with P = LayerNorm(pos_emb) (rank-truncated at
    head_dim); A ~ U S V^T; Wq = U_r S_r^1/2, Wk = V_r S_r^1/2, each scaled to Frobenius
    norm `factor_norm`. `pos_scale` (the source uses 18 with a 0.02-std embedding) multiplies
    the model's positional embedding first. Returns the pseudo input's attention mass on
    the pattern, per layer.

    Expects of `model`: `blocks` (each with `ln1` and a maskprior `attn`) and `pos_emb`
    (1, N, dim), the positional embedding the pseudo input is made from (`Transformer`, `ViT`).
    """
    if pos_scale is not None:
        model.pos_emb.mul_(pos_scale)
    masses = []
    for block in model.blocks:
        attn = block.attn
        p = pseudo_input(model, block).float()
        pat = _per_head(pattern, attn.n_heads, p.shape[0]).to(p.device)
        pinv = _pinv_rank(p, attn.head_dim)
        wqs, wks = [], []
        for h in range(attn.n_heads):
            off = _trunc_normal(pat.shape[-2:], std=0.6, bound=2.0, generator=generator)
            target = torch.where(pat[h], torch.tensor(scale), noise * off.to(pat.device))
            a = pinv @ target @ pinv.T
            u, s, vh = torch.linalg.svd(a)
            r = attn.head_dim
            wq = u[:, :r] * s[:r].sqrt()
            wk = vh[:r].T * s[:r].sqrt()
            wqs.append(wq / wq.norm().clamp_min(1e-12) * factor_norm)
            wks.append(wk / wk.norm().clamp_min(1e-12) * factor_norm)
        _set_qk_(attn, torch.stack(wqs), torch.stack(wks))
        masses.append(float(pattern_mass(pseudo_attention(attn, p).unsqueeze(0), pat)))
    return {"pseudo_mass": masses}


def init_qk_opt_(model: nn.Module, pattern: torch.Tensor, steps: int = 10000, lr: float = 1e-4,
                 norm_every: int = 100, tol: float = 0.0, pos_scale: float | None = None,
                 generator: torch.Generator | None = None) -> dict:
    """Optimised QK init (Zheng, Li, Lucey 2024): fit layer 0, copy it to every layer.

    Adam on per-head Q (H, dim, r), K (H, dim, r) minimising
    MSE(softmax(P Q K^T P^T / sqrt(r)), pattern) with P = LayerNorm(pos_emb); every
    `norm_every` steps the columns of Q and the rows of K (per input feature) are rescaled
    to their initial mean norm. Stops early when the loss improves by less than `tol` over
    `norm_every` steps. `pos_scale` multiplies the positional embedding first (as in
    `init_qk_svd_`: a prior fitted on positions reaches real inputs only if the positions are
    not drowned by the token embeddings). Returns the final loss, steps taken and
    pseudo-input masses. Expects of `model`: `blocks` (each with `ln1` and `attn`, all of the
    same heads and head_dim) and `pos_emb` (1, N, dim), as `Transformer` and `ViT` have.
    """
    if pos_scale is not None:
        with torch.no_grad():
            model.pos_emb.mul_(pos_scale)
    attn0 = model.blocks[0].attn
    h, r = attn0.n_heads, attn0.head_dim
    p = pseudo_input(model).float()
    pat = _per_head(pattern, h, p.shape[0]).to(p.device)
    target = pat.float()
    d = p.shape[1]
    bound = math.sqrt(1.0 / (r * h))
    q = ((torch.rand(h, d, r, generator=generator) * 2 - 1) * bound).to(p.device).requires_grad_()
    k = ((torch.rand(h, d, r, generator=generator) * 2 - 1) * bound).to(p.device).requires_grad_()
    nq = q.detach().norm(dim=1).mean()   # per head and column: norm over the input axis
    nk = k.detach().norm(dim=2).mean()   # per head and input feature: norm over the r axis
    opt = torch.optim.Adam([q, k], lr=lr)
    prev, loss_val, step = float("inf"), float("nan"), 0
    with torch.enable_grad():
        for step in range(1, steps + 1):
            att = ((p @ q) @ (p @ k).transpose(1, 2) * r ** -0.5).softmax(-1)
            loss = F.mse_loss(att, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_val = float(loss.detach())
            if step % norm_every == 0:
                with torch.no_grad():
                    q.mul_(nq / q.norm(dim=1, keepdim=True).clamp_min(1e-12))
                    k.mul_(nk / k.norm(dim=2, keepdim=True).clamp_min(1e-12))
                if prev - loss_val < tol:
                    break
                prev = loss_val
    with torch.no_grad():
        masses = []
        for block in model.blocks:
            _set_qk_(block.attn, q.detach(), k.detach())
            masses.append(float(pattern_mass(pseudo_attention(block.attn, p).unsqueeze(0), pat)))
    return {"loss": loss_val, "steps": step, "pseudo_mass": masses}


def _ortho_like(dim: int, alpha: float, beta: float, sign: float, generator=None):
    """A = alpha * U(-sqrt(3/D), sqrt(3/D)) + sign * beta * I = L R, split by SVD."""
    z = (torch.rand(dim, dim, generator=generator) * 2 - 1) * math.sqrt(3.0 / dim)
    a = alpha * z + sign * beta * torch.eye(dim)
    u, s, vh = torch.linalg.svd(a)
    return u * s.sqrt(), s.sqrt()[:, None] * vh


@torch.no_grad()
def init_mimetic_(model: nn.Module, qk: tuple[float, float] | None = (0.7, 0.7),
                  vo: tuple[float, float] | None = (0.4, 0.4), generator: torch.Generator | None = None) -> dict:
    """Mimetic init (Trockman and Kolter 2023): per head Wq Wk^T ~ a Z + b I; per layer Wv Wproj ~ a Z - b I.

    Z has entries of variance 1/D; `qk` and `vo` are the (a, b) pairs, None to leave that
    product alone. Returns the relative error of the V-proj products to their targets
    (non-zero only when heads x head_dim < dim truncates them). Works on any model whose
    attention layers are maskprior `Attention` modules (no positional embedding needed).
    """
    errs = []
    for attn in attention_layers(model):
        h, r = attn.n_heads, attn.head_dim
        dim = attn.qkv.weight.shape[1]
        dev = attn.qkv.weight.device
        inner = h * r
        if qk is not None:
            wq, wk = [], []
            for _ in range(h):
                left, right = _ortho_like(dim, *qk, sign=1.0, generator=generator)
                wq.append(left[:, :r])
                wk.append(right.T[:, :r])
            _set_qk_(attn, torch.stack(wq).to(dev), torch.stack(wk).to(dev))
        if vo is not None:
            left, right = _ortho_like(dim, *vo, sign=-1.0, generator=generator)
            attn.qkv.weight[2 * inner:].copy_(left[:, :inner].T.to(dev))     # v = x @ left[:, :inner]
            attn.proj.weight.copy_(right[:inner].T.to(dev))                  # out = v @ right[:inner]
            if attn.qkv.bias is not None:
                attn.qkv.bias[2 * inner:].zero_()
            full = left @ right
            errs.append(float((left[:, :inner] @ right[:inner] - full).norm() / full.norm()))
    return {"vo_truncation_error": errs}


# ----------------------------------------------------------------------------------------
# Optimiser parameter groups


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW/Adam groups: decay on matrices of Linear/Conv layers; none on M, biases,
    norms and embeddings (decay would pull M to 0 and erase the prior). A head tied to
    the token embedding counts as the embedding (modules are visited in order)."""
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            if name == "weight" and isinstance(module, (nn.Linear, nn.Conv2d)):
                decay.append(p)
            else:
                no_decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# ----------------------------------------------------------------------------------------
# Probes: how much of the prior survives.


def pattern_mass(attn: torch.Tensor, pattern: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Mean attention probability mass on the pattern.

    attn: (B, H, N, N) probabilities; pattern: (N, N) or (H, N, N) bool; rows: optional (N,) or
    (H, N) bool, the query rows (per head) to average over (default all). Sums each row's mass
    on allowed keys, averages over batch, heads and rows -> scalar in [0, 1].
    """
    n = attn.shape[-1]
    if pattern.shape[-1] != n or (rows is not None and rows.shape[-1] != n):
        rows_shape = "" if rows is None else f" and rows of shape {tuple(rows.shape)}"
        raise ValueError(f"pattern_mass: attention over {n} positions, but a pattern of shape "
                         f"{tuple(pattern.shape)}{rows_shape}")
    pat = pattern.to(attn.device)
    mass = (attn.float() * pat).sum(-1)                      # (B, H, N)
    if rows is not None:
        rows = rows.to(attn.device)
        mass = mass[:, rows] if rows.dim() == 2 else mass[..., rows]
    return mass.mean()


def prior_rows(pattern: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """The query rows the pattern constrains: (N,) bool for an (N, N) pattern, (H, N) for an
    (H, N, N) one. A row is free when it allows every key the query can see (all keys, or keys
    j <= i when causal); free rows carry no prior and are left out of the mass."""
    n = pattern.shape[-1]
    visible = causal_pattern(n) if causal else torch.ones(n, n, dtype=torch.bool)
    return ~(pattern.cpu() == visible).all(-1)


def layer_margin(attn: Attention, a: torch.Tensor, pattern: torch.Tensor, rows: torch.Tensor) -> float:
    """One layer's content margin (see `content_margin`) from its (B, H, T, T) attention map `a`:
    the bias log sigmoid(M) is taken out of log a, then log-sum-exp over the visible keys off
    `pattern` minus over those on it, averaged over the constrained `rows`, heads and batch."""
    n = a.shape[-1]
    on = pattern.to(a.device)
    off = ~on & (causal_pattern(n) if attn.causal else torch.ones(n, n, dtype=torch.bool)).to(a.device)
    c = a.float().clamp_min(1e-30).log()
    bias = attn.attn_bias(n, torch.float32, a.device)
    if bias is not None:
        c = c - bias.nan_to_num(neginf=0.0)                      # future keys (causal) are left out below
    margin = c.masked_fill(~off, float("-inf")).logsumexp(-1) - c.masked_fill(~on, float("-inf")).logsumexp(-1)
    rows = rows.to(a.device)
    margin = margin[:, rows] if rows.dim() == 2 else margin[..., rows]
    return float(margin[margin.isfinite()].mean())


@torch.no_grad()
def prior_probe(model: nn.Module, inputs: torch.Tensor, pattern: torch.Tensor) -> tuple[list[float], list[float]]:
    """(`prior_mass`, `content_margin`) per layer from one explicit forward pass of `inputs`.
    The pattern must cover the model's positions exactly; only a causal model may read a
    prefix of it (shorter inputs). Raises ValueError when the pattern constrains no row
    (`prior_rows` all False: e.g. a causal window wider than the context), where the mass
    would be an empty mean."""
    _, maps = model(inputs, return_attn=True)
    layers = attention_layers(model)
    causal = layers[0].causal
    n = maps[0].shape[-1]
    if causal and n < pattern.shape[-1]:
        pattern = pattern[..., :n, :n]
    rows = prior_rows(pattern, causal)
    if not rows.any():
        raise ValueError(f"the pattern of shape {tuple(pattern.shape)} constrains no query row (each row allows "
                         f"every key it can see), so there is no prior mass to measure")
    mass = [float(pattern_mass(a, pattern, rows)) for a in maps]
    return mass, [layer_margin(attn, a, pattern, rows) for attn, a in zip(layers, maps)]


def prior_mass(model: nn.Module, inputs: torch.Tensor, pattern: torch.Tensor) -> list[float]:
    """Per-layer attention mass on `pattern` for a real batch `inputs` (explicit path),
    averaged over the rows the pattern constrains (`prior_rows`)."""
    return prior_probe(model, inputs, pattern)[0]


def content_margin(model: nn.Module, inputs: torch.Tensor, pattern: torch.Tensor) -> list[float]:
    """Per layer: by how many nats the content logits (q.k / sqrt(d), the layer's bias taken
    out) favour the visible keys off `pattern` over those on it, log sum_off exp(c) - log
    sum_on exp(c), averaged over the constrained rows (`prior_rows`), heads and batch. Read from
    the attention map a = softmax(c + bias): c = log a - bias up to a per-row constant. With
    a bias of b_on on the pattern and b_off off it, a row's off/on mass ratio is
    exp(margin - (b_on - b_off)): the prior holds the majority while the margin stays below
    its gap (about m_off for a `mask` at m_on = 5)."""
    return prior_probe(model, inputs, pattern)[1]


@torch.no_grad()
def prior_snapshot(model: nn.Module) -> list[dict]:
    """Per layer: a copy of M (if any) and of the per-head Wq Wk^T products (H, dim, dim); for a
    model whose attention is not ours (`add_mask_prior`), per MaskPrior: M alone (qk None)."""
    snap = []
    for attn in attention_layers(model):
        wq, wk = qk_weights(attn)
        m = attn.mask_logits.detach().clone() if attn.mask_logits is not None else None
        snap.append({"mask": m, "qk": (wq @ wk.transpose(1, 2)).detach().clone()})
    if not snap:
        snap = [{"mask": prior.mask_logits.detach().clone(), "qk": None} for prior in mask_priors(model)]
    return snap


@torch.no_grad()
def prior_drift(model: nn.Module, start: list[dict]) -> dict:
    """Relative distance of M and of Wq Wk^T from a `prior_snapshot`, per layer."""
    now = prior_snapshot(model)
    out = {"qk_drift": [float((b["qk"] - a["qk"]).norm() / a["qk"].norm().clamp_min(1e-12))
                        for a, b in zip(start, now) if a["qk"] is not None]}
    if all(a["mask"] is not None for a in start) and start:
        out["mask_drift"] = [float((b["mask"] - a["mask"]).norm() / a["mask"].norm().clamp_min(1e-12))
                             for a, b in zip(start, now)]
    return out
