"""maskprior: a structural prior written into the attention logits as a learnable mask.

Reference implementation of "Mask-Based Priors Are More Persistent than Query-Key Initializations" (Ma,
Saratchandran, Gordon, Lucey, 2026):

    Attention(X) = softmax( X Wq (X Wk)^T / sqrt(d_head) + log sigmoid(M) ) X Wv

M is a learnable (heads, N, N) matrix per layer, initialised from a task's interaction pattern P (bool, True =
allowed pair): M = +m_on where P, -m_off elsewhere. Because log sigmoid(M) <= 0 the mask can only suppress, and its
gradient is bounded by the attention probability (see `mask_grad_bound`), so the prior survives training. The
baselines write the same pattern into Wq, Wk instead (`init_qk_svd_`, `init_qk_opt_`).

Reading order: the method first, the paper's comparison whole (to the banner "Beyond the comparison"): the
patterns, `MaskPrior`, `Attention` (SDPA with the prior's bias; the explicit softmax, which returns the maps),
`init_mask_`, `param_groups`, both QK baselines on a small view of any model (`QKView`) and the argument readers.
Copy that span: it imports torch alone and is the code that runs here. Then more patterns, the models
(`Transformer`, `ViT`; `MODELS` maps each config class to its model), sampling, the mimetic init, the probes and
the priors read from a trained model's attention. maskprior_fast.py, where importable, serves the fused path at
the kernel's speed (the same to rounding); maskprior_retrofit.py's `add_mask_prior` puts the prior into other
libraries' models (nn.MultiheadAttention, timm's and Hugging Face's attention).
"""
from __future__ import annotations

import contextlib
import math
import numbers
import time
import weakref
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__version__ = "0.1.0"

# ========================================================================================
# The method: the paper's comparison, whole. It imports torch alone and needs nothing below it.
# ========================================================================================

# ----------------------------------------------------------------------------------------
# The initial M and the patterns it reads: bool tensors, (N, N) for all heads or (H, N, N) per head; row i lists the
# keys that query i may attend to. The initial M: +5 on the pattern, -5 off it (log sigmoid: -0.007 and -5.007).

M_ON, M_OFF = 5.0, 5.0


def pattern_from_pairs(n: int, pairs, symmetric: bool = False, self_loops: bool = True) -> torch.Tensor:
    """(N, N) bool pattern with True at each (query, key) pair; optionally symmetric, with diagonal. A pair
    outside 0 .. N-1 is an error (a negative index would wrap around to the end)."""
    who = "pattern_from_pairs"
    n = _int(who, "n", n)
    symmetric, self_loops = _flag(who, "symmetric", symmetric), _flag(who, "self_loops", self_loops)
    if not (isinstance(pairs, (list, tuple)) or isinstance(pairs, torch.Tensor) and pairs.dim() == 2) or not all(
            isinstance(p, (list, tuple, torch.Tensor)) and len(p) == 2 and all(map(_is_index, p)) for p in pairs):
        _refuse(who, "pairs", "a list of (query, key) pairs of integers (not bools or floats)", pairs,
                "e.g. pairs=[(0, 1), (1, 0)]")
    outside = [(int(i), int(j)) for i, j in pairs if not (0 <= i < n and 0 <= j < n)]
    if outside:                    # a negative index would wrap around to the end
        raise ValueError(f"pattern_from_pairs: pair {outside[0]} is outside positions 0 .. {n - 1}")
    check_size(who, "its (n, n) pattern", n * n)
    p = torch.zeros(n, n, dtype=torch.bool)
    for i, j in pairs:
        p[i, j] = True
        if symmetric:
            p[j, i] = True
    if self_loops:
        p.fill_diagonal_(True)
    return p


def _is_index(v) -> bool:
    """An integer, or a 0-d integer tensor with a value (not a bool, not a float)."""
    if isinstance(v, torch.Tensor):
        return (v.dim() == 0 and not v.is_meta and not v.is_floating_point() and not v.is_complex()
                and v.dtype != torch.bool)
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def banded_pattern(n: int, width: int, circulant: bool = False) -> torch.Tensor:
    """(N, N) bool pattern, True where |i - j| <= width (distance taken mod N if circulant)."""
    n, width = _int("banded_pattern", "n", n), _int("banded_pattern", "width", width, 0)
    circulant = _flag("banded_pattern", "circulant", circulant)
    check_size("banded_pattern", "its (n, n) pattern", n * n)
    i = torch.arange(n)
    d = (i[:, None] - i[None, :]).abs()
    if circulant:
        d = torch.minimum(d, n - d)
    return d <= width


def causal_pattern(n: int) -> torch.Tensor:
    """(N, N) bool, True where key j <= query i."""
    n = _int("causal_pattern", "n", n)
    check_size("causal_pattern", "its (n, n) pattern", n * n)
    return torch.ones(n, n, dtype=torch.bool).tril()


def future_keys(t: int, device: torch.device | None = None) -> torch.Tensor:
    """(T, T) bool, True where key j > query i: what a causal layer never sees."""
    return torch.ones(t, t, dtype=torch.bool, device=device).triu(1)


def mask_logits_from_pattern(pattern: torch.Tensor, m_on: float = M_ON, m_off: float = M_OFF) -> torch.Tensor:
    """Initial M: +m_on on allowed pairs, -m_off elsewhere (same shape as `pattern`); both finite."""
    who = "mask_logits_from_pattern"
    pattern, m_on, m_off = _pattern(who, pattern), _real(who, "m_on", m_on), _real(who, "m_off", m_off)
    return torch.where(pattern, torch.tensor(m_on, device=pattern.device), torch.tensor(-m_off, device=pattern.device))


def mask_bias(mask_logits: torch.Tensor) -> torch.Tensor:
    """The additive attention bias log sigmoid(M), always <= 0."""
    return F.logsigmoid(mask_logits)


def _per_head(pattern: torch.Tensor, n_heads: int, n: int, n_keys: int | None = None) -> torch.Tensor:
    """(N, S) or (H, N, S) -> (H, N, S); raises unless N is the layer's `n` positions (S its `n_keys`, default n)."""
    s = n if n_keys is None else n_keys
    if (pattern.dim() not in (2, 3) or (pattern.dim() == 3 and pattern.shape[0] != n_heads)
            or tuple(pattern.shape[-2:]) != (n, s)):
        raise ValueError(f"a pattern or mask of shape {tuple(pattern.shape)} does not fit a layer with {n_heads} "
                         f"heads and {n} positions: expected ({n}, {s}) or ({n_heads}, {n}, {s}); build it for the "
                         "model's own token layout (with or without a CLS token)")
    return pattern.unsqueeze(0).expand(n_heads, -1, -1) if pattern.dim() == 2 else pattern


def _check_past_only(values: torch.Tensor, what: str, way: str) -> None:
    """Refuse, in one line, a pattern or logits `values` (..., n, n) for a causal prior whose future half holds
    structure (allowed pairs, M > 0, that vary from pair to pair: a band, another model's non-causal attention), which
    the causal mask would drop in silence; a future the same everywhere (all allowed, M = +30, all -inf-like) passes."""
    later = torch.ones(values.shape[-2:], dtype=torch.bool, device=values.device).triu(1)    # key j > query i
    future = values[..., later]                                  # (..., pairs above the diagonal)
    allowed = future if future.dtype == torch.bool else future > 0
    if bool(allowed.any()) and not bool((future == future.flatten()[0]).all()):
        i, j = (int(v) for v in later.nonzero()[int(allowed.reshape(-1, future.shape[-1]).any(0).nonzero()[0])])
        raise ValueError(f"{what} {int(allowed.sum())} future keys (e.g. query {i}, key {j}), "
                         f"which a causal layer never sees: {way}")


def depends_on_distance(values: torch.Tensor, causal: bool = False) -> bool:
    """Whether a square pattern or logits (n, n) or (heads, n, n) depend on i - j alone (on and
    below the diagonal when `causal`): what a relative prior (`param="relative"`) holds exactly."""
    causal = _flag("depends_on_distance", "causal", causal)
    if isinstance(values, torch.Tensor) and values.is_meta:
        _refuse("depends_on_distance", "values", "a pattern or logits that hold values", values)
    if not isinstance(values, torch.Tensor) or values.dim() not in (2, 3) or values.shape[-1] != values.shape[-2]:
        return False
    same = values[..., 1:, 1:] == values[..., :-1, :-1]          # (i + 1, j + 1) against (i, j)
    if causal:
        same = same | future_keys(values.shape[-1] - 1, values.device)
    return bool(same.all())


def _grid_sizes(who: str, grid_h, grid_w, n_prefix) -> int:
    """Read a patch grid's sizes; -> its N = n_prefix + grid_h x grid_w."""
    grid_h, grid_w = _int(who, "grid_h", grid_h), _int(who, "grid_w", grid_w)
    return _int(who, "n_prefix", n_prefix, 0) + grid_h * grid_w


def grid_index(grid_h: int, grid_w: int, n_prefix: int = 0, device=None) -> torch.Tensor:
    """(N, N) long, N = n_prefix + grid_h x grid_w (prefix tokens first, patches row-major): the slot of a
    2-D relative M (`param="grid"`) each (query, key) pair reads: two patches, their displacement's; each
    prefix token (a class token), a row and a column of its own. `grid_slots` slots a head."""
    n = _grid_sizes("grid_index", grid_h, grid_w, n_prefix)
    check_size("grid_index", "its (N, N) slots (N = n_prefix + grid_h x grid_w)", n * n)
    p, wide = grid_h * grid_w, 2 * grid_w - 1
    rc = torch.stack(torch.meshgrid(torch.arange(grid_h, device=device), torch.arange(grid_w, device=device),
                                    indexing="ij"), -1).reshape(p, 2)
    d = rc[None] - rc[:, None] + torch.tensor([grid_h - 1, grid_w - 1], device=device)   # (P, P, 2), >= 0
    first = (2 * grid_h - 1) * wide
    idx = torch.empty(n, n, dtype=torch.long, device=device)
    idx[n_prefix:, n_prefix:] = d[..., 0] * wide + d[..., 1]
    idx[:n_prefix] = first + torch.arange(n_prefix * n, device=device).view(n_prefix, n)
    idx[n_prefix:, :n_prefix] = first + n_prefix * n + torch.arange(p * n_prefix, device=device).view(p, n_prefix)
    return idx


def grid_slots(grid_h: int, grid_w: int, n_prefix: int = 0) -> int:
    """The logits a head of a 2-D relative M holds (`grid_index`): one per displacement, plus each
    prefix token's row and column."""
    _grid_sizes("grid_slots", grid_h, grid_w, n_prefix)
    return (2 * grid_h - 1) * (2 * grid_w - 1) + n_prefix * (2 * grid_h * grid_w + n_prefix)


# ----------------------------------------------------------------------------------------
# The prior: a small module that owns M and gives the additive bias, for our Attention or any attention with a mask.


def tracing(x=None) -> bool:
    """Whether this call is compiled (torch.compile), scripted or traced (TorchScript), or traced by fx (`x`, a value
    of the call, is an fx Proxy): there host-side checks (values read back to Python) are left out (one whole graph)."""
    compiling = getattr(torch.compiler, "is_compiling", None)            # torch >= 2.3
    return (bool(compiling and compiling()) or torch.jit.is_scripting() or torch.jit.is_tracing()
            or isinstance(x, torch.fx.Proxy))


def _prior_entries(n: int, heads: int, n_keys, causal: bool, param, src, grid) -> int:
    """The entries of the M a MaskPrior would make: (heads, 2n - 1) relative, (heads, n, n_keys) full, or a grid's
    slots."""
    if param == "grid" and grid:
        return heads * grid_slots(*grid, max(0, n - grid[0] * grid[1]))
    relative = param == "relative" or (param is None and causal and src is not None and depends_on_distance(src, True))
    return heads * (2 * n - 1 if relative else n * (n_keys or n))


class MaskPrior(nn.Module):
    """The learnable prior of one attention layer: M -> the additive bias log sigmoid(M), plus -inf on future keys
    when `causal`. `param="full"`: M is (heads, n, n), one logit per (query, key); `param="relative"`: one logit per
    head and distance i - j, a (heads, n) table when causal ((heads, 2n - 1) otherwise), log sigmoid taken on the
    table and then gathered, so the prior costs O(heads x n) parameters instead of O(heads x n^2); `param="grid"`,
    `grid=(grid_h, grid_w)`: an image's 2-D relative M (`grid_index`: Swin's, BEiT's), given logits averaged over
    each of its slots. By default (`param=None`) a causal prior whose pattern or logits depend on i - j alone
    (`depends_on_distance`: a distance prior, a band) is stored relative, anything else (a layout: a grid, a CLS
    token, a non-causal band) full. M starts from `pattern` (bool (n, n) or (heads, n, n): +m_on on allowed pairs,
    -m_off elsewhere), from `logits`, or at 0 (the same constant on every logit: no prior until `init_mask_` sets
    it). Shaped for the caller:

        prior(t)                -> (heads, t, t)          F.scaled_dot_product_attention(attn_mask=...)
        prior(q_len, k_len=s)   -> (heads, q_len, s)      a causal layer with a KV cache of s keys
        prior(t).repeat(b, 1, 1) (b * heads, t, t)        nn.MultiheadAttention(attn_mask=...)
        prior(t)[None]          -> (1, heads, t, t)       a 4-D additive mask (Hugging Face style)

    Lengths: a relative prior serves any length: a distance past its table reads the table's last logit (the far bucket,
    as T5's relative bias does past its max_distance), so a prior of n = 128 serves 1,024 tokens and generation past n,
    and costs O(heads x n) whatever the length. A full M serves at most n tokens: by default exactly n; a causal one
    reads a prefix (a prompt) and, with a KV cache, the rows of the last q_len of its k_len positions. `prefix=True`
    lets a non-causal prior read t < n tokens as positions 0..t-1 (right-padded text); an image grid of another size is
    another layout, so it is refused, not sliced. `n_keys` makes a cross-attention prior of (heads, n, n_keys). M stays
    float32 when the module is cast to half precision (an Adam step of 1e-3 on |M| ~ 5-10 would round away in bf16).
    Keep M out of weight decay (`param_groups`, `prior_parameter_names`), or the decay erases the prior."""
    def __init__(self, n: int, heads: int = 1, pattern: torch.Tensor | None = None,
                 m_on: float = M_ON, m_off: float = M_OFF, causal: bool = False,
                 logits: torch.Tensor | None = None, param: str | None = None,
                 n_keys: int | None = None, prefix: bool = False, grid: tuple[int, int] | None = None):
        super().__init__()
        who = "MaskPrior"
        n, heads = _int(who, "n", n), _int(who, "heads", heads, 1, MAX_HEADS)
        pattern, logits = _source(who, pattern, logits, needed=False)
        m_on, m_off, causal = _real(who, "m_on", m_on), _real(who, "m_off", m_off), _flag(who, "causal", causal)
        param = None if param is None else _choice(who, "param", param, ("full", "relative", "grid"))
        n_keys = None if n_keys is None else _int(who, "n_keys", n_keys)
        prefix = _flag(who, "prefix", prefix)
        grid = None if grid is None else _grid(who, grid)
        src = logits if logits is not None else pattern
        check_size(who, "its M", _prior_entries(n, heads, n_keys, causal, param, src, grid),
                   "param='relative' holds a prior that depends on i - j alone at heads x (2n - 1); else build it for "
                   "fewer positions or heads")
        if param is None:  # a causal distance prior is stored by distance; anything else (a layout) by pair
            param = "relative" if causal and src is not None and depends_on_distance(src, causal) else "full"
        if (n_keys is not None and (causal or param != "full") or (param == "grid") != (grid is not None)
                or grid and (causal or prefix or grid[0] * grid[1] > n)):
            raise ValueError("MaskPrior: a cross-attention prior (n_keys) is non-causal with param='full'; "
                             "param='grid' (a 2-D relative M) goes with grid=(grid_h, grid_w), an image's patch grid "
                             f"of at most n = {n} positions, non-causal, without prefix (another size is another "
                             f"grid); got n_keys={n_keys!r}, causal={causal}, prefix={prefix}, param={param!r}, "
                             f"grid={grid!r}")
        self.n, self.heads, self.causal, self.param, self.grid = n, heads, causal, param, grid
        self.n_keys, self.cross, self.prefix = n if n_keys is None else n_keys, n_keys is not None, prefix or causal
        self.where = "MaskPrior"            # the layer it serves, for error messages (maskprior_retrofit names it)
        self.record = None                  # a list while `attention_maps` records probabilities
        self.roles = None                   # (rows, cols) (B, L) long while `prior_roles` is in effect
        size = {"full": (heads, n, self.n_keys), "relative": (heads, n if causal else 2 * n - 1),
                "grid": (heads, grid_slots(*grid, n - grid[0] * grid[1]) if grid else 0)}[param]
        # M, named `bias` so that optimiser builders leave it undecayed by their own rule (Hugging Face Trainer's names
        # holding "bias", timm's ".bias", minGPT's): decay would erase the prior. float32 whatever the default dtype.
        self.bias = nn.Parameter(torch.zeros(size, dtype=torch.float32))
        watch_decay(self)
        self.unset = False                  # to_empty gave M memory but no values: set or load it first
        self.start = None                   # what M starts from (a CPU copy), for reset_parameters
        if pattern is not None and causal:
            _check_past_only(pattern, f"{self.where}: the pattern allows", "give pattern & mp.causal_pattern(n)")
        src = logits if logits is not None else None if pattern is None else mask_logits_from_pattern(pattern, m_on,
                                                                                                       m_off)
        if src is not None:
            self.set_logits(src)

    def __setstate__(self, state) -> None:     # a copy (deepcopy, pickle) is watched as its original
        super().__setstate__(state)
        watch_decay(self)

    def extra_repr(self) -> str:
        keys = f", n_keys={self.n_keys}" if self.cross else f", grid={self.grid}" if self.grid else ""
        return f"n={self.n}{keys}, heads={self.heads}, causal={self.causal}, param={self.param}, prefix={self.prefix}"

    def _apply(self, fn, *args, **kwargs):
        """M keeps float32 through model.to(bfloat16) / .half(): a cast to a narrower float is undone on M from the
        float32 values (device moves and float64 pass); memory that to_empty gave is flagged unset."""
        def keep_float32(t):
            out = fn(t)
            if out.is_floating_point() and out.dtype in (torch.float16, torch.bfloat16) and t.dtype == torch.float32:
                return t.to(out.device)
            return out
        was_meta = self.bias.is_meta
        out = super()._apply(keep_float32, *args, **kwargs)
        self.unset = self.unset or (was_meta and not self.bias.is_meta)
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Refuse a saved M that is not finite (log sigmoid of nan or +-inf is no prior: the outputs would be nan)."""
        saved = state_dict.get(prefix + "bias")
        if isinstance(saved, torch.Tensor) and saved.is_floating_point() and not bool(torch.isfinite(saved).all()):
            raise ValueError(f"{prefix}bias ({self.where}): the saved M holds non-finite values "
                             f"({int((~torch.isfinite(saved)).sum())} of {saved.numel()}); it is no prior")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.bias.dtype in (torch.float16, torch.bfloat16):   # assign=True: M keeps float32 all the same
            self.bias = nn.Parameter(self.bias.detach().float(), requires_grad=self.bias.requires_grad)
        self.unset = self.unset and prefix + "bias" not in state_dict

    def __prepare_scriptable__(self):
        """torch.jit.script compiles every forward hook of a model, and a retrofitted layer's are Python: one line
        instead of TorchScript's traceback, naming the ways that work."""
        raise ValueError(f"{self.where}: torch.jit.script cannot compile a model that holds a MaskPrior (the "
                         "prior's hooks and bias are Python); trace it (torch.jit.trace), compile it "
                         "(torch.compile) or export it (torch.export) instead")

    def _logits(self, m: torch.Tensor) -> torch.Tensor:
        """M (or a slice of it) in the precision the bias is computed in: float32, or float64 for a
        float64 M (read off the parameter itself, so an fx trace records no branch)."""
        return m if self._parameters["bias"].dtype == torch.float64 else m.float()

    def at_distance(self, dist: torch.Tensor) -> torch.Tensor:
        """(heads, *dist.shape) bias log sigmoid(M) of a relative prior at distances `dist` = query position - key
        position (any shape; a causal prior's negative distances read distance 0: mask them)."""
        return mask_bias(self._logits(self.bias))[:, self._index(dist)]

    def _index(self, d: torch.Tensor) -> torch.Tensor:
        """The relative table's index of distances d = i - j (any shape): d itself when causal
        (future keys at 0, masked later), else d + n - 1; distances past the table read its last
        logit (its first, for the keys far after the query of a non-causal prior)."""
        return d.clamp(0, self.n - 1) if self.causal else d.clamp(1 - self.n, self.n - 1) + self.n - 1

    def _square(self, device=None) -> torch.Tensor:
        """(n, n) distances i - j of the prior's own n positions (on M's device, or `device`)."""
        i = torch.arange(self.n, device=self.bias.device if device is None else device)
        return i[:, None] - i[None, :]

    def _pairs(self, device=None) -> torch.Tensor:
        """(n, n) the table slot each (query, key) pair of a relative or grid M reads."""
        device = self.bias.device if device is None else device
        if self.param == "grid":
            return grid_index(*self.grid, self.n - self.grid[0] * self.grid[1], device)
        return self._index(self._square(device))

    @torch.no_grad()
    def set_logits(self, logits: torch.Tensor) -> None:
        """M from full logits (n, n_keys) or (heads, n, n_keys); a relative prior takes them only if they depend on
        i - j alone (on and below the diagonal when causal); a causal prior refuses logits that allow a future key
        (`_check_past_only`). Checked where the logits are, and kept (a CPU copy) as M's start for `reset_parameters`: a
        prior on the meta device takes them too, and is set from them once M has memory (`to_empty`, then
        `reset_parameters` or HF's init_weights)."""
        full = _per_head(_logits("MaskPrior.set_logits", logits), self.heads, self.n, self.n_keys)
        full = full.to(dtype=self.bias.dtype)
        if not bool(torch.isfinite(full).all()):
            raise ValueError(f"{self.where}: the logits hold non-finite values; M is a finite "
                             "matrix (log sigmoid(M) of +-inf or nan is no prior)")
        if self.causal:
            _check_past_only(full, f"{self.where}: the logits allow",
                             "set them to at most 0 there (e.g. logits.tril(), or logits built with causal=True)")
        value = full if self.param == "full" else self._table(full)
        self.start = value.to("cpu", copy=True)
        self.reset_parameters()

    def _table(self, full: torch.Tensor) -> torch.Tensor:
        """The table (heads, slots) of a relative or grid prior from full logits (heads, n, n) that hold one logit a
        slot (a distance, a patch displacement, a class token's row or column); refused, naming a slot, elsewhere."""
        idx = self._pairs(full.device).expand(self.heads, -1, -1)
        seen = torch.ones(self.n, self.n, dtype=torch.bool, device=full.device)
        seen = seen.tril() if self.causal else seen
        slots, values = idx[:, seen].view(self.heads, -1), full[:, seen].view(self.heads, -1)
        table = torch.zeros(self.bias.shape, dtype=full.dtype, device=full.device).scatter_(1, slots, values)
        differ = table.gather(1, slots) != values
        if bool(differ.any()):
            slot, wide = int(slots[differ][0]), 2 * self.grid[1] - 1 if self.grid else 0
            where = (f"distance {slot if self.causal else slot - self.n + 1}, these logits differ along a diagonal"
                     if self.param == "relative" else f"patch displacement ({slot // wide - self.grid[0] + 1}, "
                     f"{slot % wide - self.grid[1] + 1}), its pairs differ" if slot < (2 * self.grid[0] - 1) * wide
                     else "class-token row or column, its pairs differ")
            raise ValueError(f"{self.where}: a {self.param} MaskPrior holds one logit a head and slot, but at "
                             f"{where}; use param='full' for them")
        return table

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """M back to where it started (the last `set_logits`, else 0): torch's convention for a module whose
        memory `to_empty` gave without values. Nothing to copy on the meta device."""
        if not self.bias.is_meta:
            self.bias.copy_(self.start if self.start is not None else torch.zeros(()))
            self.unset = False

    def check_set(self) -> None:
        """Refuse to serve an M that `to_empty` moved off the meta device and nothing set since:
        its memory is uninitialised."""
        if self.unset:
            raise ValueError(f"{self.where}: M was built on the meta device and holds no values yet (to_empty "
                             "leaves memory uninitialised): set it (init_mask_, set_logits, reset_parameters, a "
                             "Hugging Face model's init_weights) or load a state dict first")

    def full_logits(self) -> torch.Tensor:
        """M as (heads, n, n_keys) logits (a relative table expanded; future entries of a causal
        one are its distance-0 logit, and masked in the bias)."""
        return self.bias if self.param == "full" else self.bias[:, self._pairs()]

    def _first_row(self, t: int, s: int, start: int | None = None) -> int:
        """The first of the t query rows the prior serves with s keys (`start`, when the caller knows the first
        query's position, e.g. from a static KV cache whose s keys include empty slots; else s - t); raises in one
        line when (t, s) does not fit, naming the way out. A relative prior serves any length."""
        if self.param == "relative":
            first = start if start is not None and self.causal else s - t if self.causal else 0
            fits = (0 <= first and first + t <= s) if self.causal else s == t
        elif start is not None and self.causal:
            first, fits = start, start + t <= min(s, self.n)
        else:
            first = s - t if self.causal else 0
            fits = ((s <= self.n and t <= s) if self.causal else
                    (t <= self.n and s <= self.n_keys and (self.cross or s == t)
                     and (self.prefix or (t == self.n and s == self.n_keys))))
        if not fits:
            raise ValueError(f"{self.where}: {self._misfit(t, s, start)}")
        return first

    def _misfit(self, t: int, s: int, start: int | None) -> str:
        """Why t queries with s keys (the first at `start`) do not fit `_first_row`, and the way out."""
        if self.param == "relative":
            return (f"{t} queries with {s} keys: a relative prior serves self-attention "
                    f"({'q_len <= k_len, with a KV cache' if self.causal else 'as many keys as queries'})")
        if start is not None and self.causal:
            return (f"queries at positions {start} .. {start + t - 1} with {s} keys do not fit the mask size "
                    f"{self.n}: a causal prior serves positions 0 .. {self.n - 1}")
        way = ("a causal prior serves at most its n positions (with a KV cache, q_len <= k_len <= n)" if self.causal
               else "a self-attention prior serves as many keys as queries" if not self.cross and s != t
               else f"build it for {t} positions, or with prefix=True to read a shorter sequence as positions "
                    f"0..{t - 1} (right-padded text)" if t < self.n and s <= self.n_keys
               else "build it for the longer sequence (an image of another size is another grid)")
        return (f"sequence length {t}{f' with {s} keys' if s != t or self.cross else ''} does not fit the mask size "
                f"{f'{self.n} x {self.n_keys}' if self.cross else self.n}: {way}")

    def forward(self, t: int | None = None, dtype: torch.dtype | None = None,
                k_len: int | None = None, start: int | None = None) -> torch.Tensor:
        t = self.n if t is None else t
        s = (self.n_keys if self.cross else t) if k_len is None else k_len
        if torch.jit.is_tracing():              # sizes come as tensors; the traced graph keeps these
            t, s = int(t), int(s)
        if not tracing() and not (isinstance(t, int) and isinstance(s, int) and t >= 1 and s >= 1):
            raise ValueError(f"{self.where}: a prior serves t >= 1 queries and k_len >= 1 keys, "
                             f"got {t!r} and {s!r}")
        self.check_set()
        r = self._first_row(t, s, start)
        # keys past a full M (empty slots of a static cache) are future keys; a relative M reads every key
        c = s if self.param == "relative" else min(s, self.n_keys)
        if self.roles is not None:          # per example: M's row of each query's role, column of each key's
            rows, cols = self.roles
            if rows.shape[1] < r + t or cols.shape[1] < c:
                raise ValueError(f"{self.where}: roles for {rows.shape[1]} positions, but {r + t} "
                                 f"queries and {c} keys")
            rq, kc = rows[:, r:r + t].to(self.bias.device), cols[:, :c].to(self.bias.device)
            bias = mask_bias(self._logits(self.full_logits()))[:, rq[:, :, None], kc[:, None, :]].transpose(0, 1)
        elif self.param == "full":
            bias = mask_bias(self._logits(self.bias[:, r:r + t, :c]))
        elif self.param == "grid":                 # log sigmoid on the table, then gathered (t = c = n)
            bias = mask_bias(self._logits(self.bias))[:, self._pairs()]
        else:  # log sigmoid on the small table, laid along the t + c - 1 distances, then one Toeplitz copy
            dist = torch.arange(r + t - 1, r - c, -1, device=self.bias.device)
            line = mask_bias(self._logits(self.bias))[:, self._index(dist)]
            line = line.masked_fill(dist < 0, float("-inf")) if self.causal else line
            bias = line.unfold(1, c, 1).flip(1)  # row i, key j: line[t - 1 - i + j], distance r + i - j
        if self.causal and self.param == "full":
            bias = bias.masked_fill(future_keys(c, bias.device)[r:r + t], float("-inf"))
            bias = F.pad(bias, (0, s - c), value=float("-inf"))
        return bias if dtype is None else bias.to(dtype)


# ----------------------------------------------------------------------------------------
# Attention: the fused path (SDPA with the prior's bias) and the explicit softmax, which can return the maps.


def _speedups():
    """maskprior_fast (the speed paths of `prior_attention`: torch's fused CPU kernel, flex_attention) where it is
    importable beside this file, else None; imported on the first call with a prior, never at import."""
    global _FAST
    if _FAST is None:
        try:
            import maskprior_fast as fast
        except ImportError:
            fast = False
        _FAST = fast
    return _FAST or None


_FAST = None


def prior_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prior: MaskPrior,
                    use_flex: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + log sigmoid(M)) v, the fused path with a prior: q (B, H, T, d), k, v (B, H, S, d) ->
    (B, H, T, d), a causal prior's future hidden. F.scaled_dot_product_attention with the prior's bias as its mask,
    unless maskprior_fast takes the call (`_speedups`; `use_flex` asks for torch's flex_attention where it applies)."""
    fast = _speedups()
    if fast is None and use_flex:
        raise ValueError(f"{prior.where}: flex_attention is served by maskprior_fast.py, which is not importable "
                         "here: put it beside maskprior.py, or use the fused or explicit path")
    out = None if fast is None else fast.prior_attention(q, k, v, prior, use_flex)
    if out is not None:
        return out
    bias = prior(q.shape[-2], q.dtype, k_len=k.shape[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias if bias.dim() == 4 else bias.unsqueeze(0))


class Attention(nn.Module):
    """Multi-head self-attention with an optional learnable log-sigmoid mask. x: (B, T, dim) -> (B, T, dim). With
    `mask_size=N` the module owns M, a (heads, N, N) parameter, and T must equal N; the bias log sigmoid(M) is added to
    the logits. M starts at 0: no prior until `init_mask_` sets it. `causal=True` adds a hard -inf on future keys; only
    then may T be shorter than N (a prefix, e.g. a prompt while generating), and the bias is M's top-left T x T block.
    `mask_param="relative"`: M per head and distance (`mask_window` of them, default N), any T; `mask_param="grid"`: M
    per head and patch displacement of the `mask_grid` (grid_h, grid_w). `fused=True` uses SDPA (`prior_attention` with
    M); the explicit path (`fused=False`, or `return_attn=True`) also returns the (B, heads, T, T) attention
    probabilities. `flex=True` runs a layer with M through torch's flex_attention instead (maskprior_fast's
    `prior_flex`: M read inside the kernel)."""

    def __init__(self, dim: int, n_heads: int, head_dim: int | None = None, mask_size: int | None = None,
                 causal: bool = False, qkv_bias: bool = False, fused: bool = True, mask_param: str = "full",
                 flex: bool = False, mask_window: int | None = None, mask_grid: tuple[int, int] | None = None):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = head_dim or dim // n_heads
        self.causal = causal
        self.fused, self.flex = fused, flex
        inner = n_heads * self.head_dim
        # the prior first: M is the layer's first parameter (and first in the optimiser's state)
        if mask_window is not None and not (mask_param == "relative" and mask_size and 1 <= mask_window <= mask_size):
            raise ValueError(f"mask_window {mask_window!r}: a relative M's distances, 1 .. its "
                             f"{mask_size} positions (mask_param='relative')")
        self.prior = (MaskPrior(mask_window or mask_size, n_heads, causal=causal, param=mask_param, grid=mask_grid)
                      if mask_size else None)
        self.qkv = nn.Linear(dim, 3 * inner, bias=qkv_bias)
        self.proj = nn.Linear(inner, dim)

    def attn_bias(self, t: int, dtype: torch.dtype, k_len: int | None = None) -> torch.Tensor | None:
        """(heads, T, S) additive bias: log sigmoid(M) plus -inf on the future if causal (None without M)."""
        return None if self.prior is None else self.prior(t, dtype, k_len=k_len)

    def forward(self, x: torch.Tensor, return_attn: bool = False, cache: dict | None = None):
        """x (B, T, dim) -> (B, T, dim) and the (B, heads, T, S) attention (None on the fused path). `cache`: a dict
        this layer keeps its keys and values in across calls (a causal layer decoding token by token: S keys)."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if cache is not None:
            if cache:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
        s = k.shape[2]
        attn = None
        flex = self.flex and self.prior is not None and self.prior.roles is None and s == t
        if (self.fused or flex) and not return_attn and self.prior is not None:
            out = prior_attention(q, k, v, self.prior, flex)
        elif self.fused and not return_attn:
            late = self.causal and s > t    # queries after a cache: is_causal would align them to key 0
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~future_keys(s, x.device)[s - t:] if late else None,
                                                 is_causal=self.causal and not late)
        else:
            logits = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5
            if self.prior is not None:
                logits = logits + self.attn_bias(t, q.dtype, k_len=s)
            elif self.causal:
                logits = logits.masked_fill(future_keys(s, x.device)[s - t:], float("-inf"))
            attn = logits.softmax(dim=-1)
            out = attn @ v
        out = out.transpose(1, 2).reshape(b, t, -1)
        return self.proj(out), attn


# ----------------------------------------------------------------------------------------
# Initialising M, and optimiser groups that never decay it


def mask_priors(model: nn.Module) -> list[MaskPrior]:
    """Every MaskPrior `model` runs, in module order: of a layer whose prior PEFT's modules_to_save holds more than
    once (its frozen original and a copy per adapter), the one it runs (`_runs`)."""
    wrappers = [m for m in model.modules() if isinstance(getattr(m, "original_module", None), MaskPrior)]
    idle = {id(p) for w in wrappers for p in (w.original_module, *w.modules_to_save.values()) if p is not _runs(w)}
    return [m for m in model.modules() if isinstance(m, MaskPrior) and id(m) not in idle]


def _runs(wrapper: nn.Module) -> nn.Module:
    """The module PEFT's ModulesToSaveWrapper (duck-typed) runs: its active adapter's copy, else (adapters disabled
    or none active) the original it keeps beside the copies."""
    active = [] if wrapper.disable_adapters else wrapper.active_adapters
    copies = wrapper.modules_to_save
    return copies[active[0]] if active and active[0] in copies else wrapper.original_module


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


@torch.no_grad()
def init_mask_(model: nn.Module, pattern: torch.Tensor | None = None, m_on: float = M_ON,
               m_off: float = M_OFF, logits: torch.Tensor | None = None) -> dict:
    """Set the M of every MaskPrior in the model to +m_on on `pattern`, -m_off elsewhere (or to given `logits`).
    `pattern` (N, N) or (H, N, N) bool, or `logits` of those shapes, must be built for the model's own N positions (e.g.
    with or without a CLS token in front): every attention layer must already own an M (build the model with
    `learnable_mask=True`, `Attention(mask_size=N)`, or `add_mask_prior`) of that size, or this raises; it never creates
    or resizes M, since an optimiser made earlier would not see a new parameter. Give M to the optimiser without weight
    decay (`param_groups`), or the decay pulls it to 0 and erases the prior."""
    who = "init_mask_"
    pattern, logits = _source(who, pattern, logits)
    m_on, m_off = _real(who, "m_on", m_on), _real(who, "m_off", m_off)
    src = logits if logits is not None else mask_logits_from_pattern(pattern, m_on, m_off)
    if any(attn.prior is None for attn in attention_layers(model)) or not mask_priors(model):
        raise ValueError("init_mask_: an attention layer has no M; build the model with learnable_mask=True (or "
                         "Attention(..., mask_size=N)), or give your own attention a MaskPrior")
    if any(prior.causal for prior in mask_priors(model)):  # refused before any M changes, as a prior would
        _check_past_only(src if pattern is None else pattern, "init_mask_: the prior allows",
                         "build it for a causal model (pattern & mp.causal_pattern(n); logits at most 0 there)")
    for prior in mask_priors(model):
        prior.set_logits(src)
    if logits is not None:
        return {"m_min": float(logits.min()), "m_max": float(logits.max())}
    return {"m_on": m_on, "m_off": m_off, "allowed_fraction": float(pattern.float().mean())}


def prior_parameter_names(model: nn.Module) -> list[str]:
    """The names of every M in `model` (as in `model.named_parameters()`): what an optimiser builder must keep out of
    weight decay (timm's `no_weight_decay`, Hugging Face Trainer's decay list)."""
    return [f"{name}.bias" if name else "bias" for name, m in model.named_modules() if isinstance(m, MaskPrior)]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW/Adam groups: decay on every weight matrix (a parameter named `weight` of two or more dimensions:
    Linear, Conv, Hugging Face's Conv1D...); none on M (any MaskPrior), biases, norms, embedding tables (nn.Embedding)
    and other parameters (positional embeddings, class tokens). Decay would pull M to 0 and erase the prior. A head
    tied to the token embedding counts as the embedding (modules are visited in order)."""
    weight_decay = _real("param_groups", "weight_decay", weight_decay)
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            if name == "weight" and p.dim() >= 2 and not isinstance(module, (nn.Embedding, MaskPrior)):
                decay.append(p)
            else:
                no_decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# every MaskPrior built in this process (held weakly), and the handle of the one optimiser hook (`watch_decay`)
_PRIORS: "weakref.WeakSet[MaskPrior]" = weakref.WeakSet()
_WATCHING: list = []


def watch_decay(prior: MaskPrior) -> None:
    """Watch `prior` for weight decay on M; the process-wide check goes in once, with the process's first MaskPrior
    (never at import): torch's `register_optimizer_step_pre_hook` runs `_refuse_decayed_m` before each optimiser step. A
    plain `AdamW(model.parameters(), weight_decay=0.1)` would pull M to 0 and erase the prior in silence (param_groups,
    HF's Trainer and timm's factory leave M out); a decay set after the first step (a schedule, add_param_group,
    load_state_dict, an M unfrozen later) is refused on the step it would first apply."""
    if not _WATCHING:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _WATCHING.append(register_optimizer_step_pre_hook(_refuse_decayed_m))
    _PRIORS.add(prior)


def _refuse_decayed_m(optimizer, args, kwargs) -> None:
    """Optimiser step pre-hook: one ValueError line, before the step, if a group with weight_decay > 0 holds a
    trainable M."""
    ms = {id(p.bias): p.where for p in list(_PRIORS) if p.bias.requires_grad}
    for i, group in enumerate(optimizer.param_groups if ms else ()):
        held = [ms[id(p)] for p in group["params"] if id(p) in ms] if group.get("weight_decay", 0) else []
        if held:
            raise ValueError(
                f"{type(optimizer).__name__}: param group {i} decays M of {len(held)} prior(s) ({held[0]}, ...) "
                f"with weight_decay={group['weight_decay']}, which pulls M to 0 and erases the prior; give M "
                "weight_decay 0: maskprior.param_groups(model, weight_decay) does")


# ----------------------------------------------------------------------------------------
# The QK initialisers: the same pattern written into Wq, Wk (act in place, return a small report)


@dataclass
class QKSite:
    """One attention layer as the QK inits read and write it: its pre-norm (what the positions pass first; None
    where an init needs no positions), heads x head_dim, and views of its weights that writes go through to: q, k, v
    (heads x head_dim, dim), their biases (or None), o (dim, heads x head_dim), the output projection."""
    norm: nn.Module | None
    n_heads: int
    head_dim: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    biases: tuple = (None, None, None)


class QKView(NamedTuple):
    """What the QK inits read and write of a model: its attention layers in order (QKSite) and its
    learned positional embedding (1, N, dim), None where it has none. Ours: `qk_view`; timm's and
    Hugging Face's ViTs: maskprior_retrofit.qk_view; any model with a fused qkv, e.g. nanoGPT's:

        view = QKView([qk_site(b.attn.c_attn, b.attn.c_proj, b.attn.n_head, b.ln_1) for b in model.transformer.h],
                      model.transformer.wpe.weight[None])
        init_qk_svd_(view, pattern)
    """
    sites: list
    pos_emb: torch.Tensor | None


def qk_site(qkv: nn.Linear, proj: nn.Linear, n_heads: int, norm: nn.Module | None = None) -> QKSite:
    """The QKSite of an attention layer with one fused projection `qkv` (dim -> 3 x heads x head_dim, q then k then
    v: ours, timm's `qkv`, nanoGPT's `c_attn`) and its output projection `proj` (nanoGPT's `c_proj`); `norm`, the
    pre-norm of its block (nanoGPT's `ln_1`). The site's tensors are views: the inits write through them."""
    n_heads = _int("qk_site", "n_heads", n_heads, 1, MAX_HEADS)
    inner, w, b = qkv.out_features // 3, qkv.weight.detach(), qkv.bias
    parts = [slice(0, inner), slice(inner, 2 * inner), slice(2 * inner, 3 * inner)]
    return QKSite(norm, n_heads, inner // n_heads, *(w[s] for s in parts), proj.weight.detach(),
                  (None,) * 3 if b is None else tuple(b.detach()[s] for s in parts))


def qk_view(model) -> QKView:
    """The QKView of one of our models (its `blocks`, each an `ln1` and an `attn`, and `pos_emb`), or of
    any module holding our Attention layers (no norms, no positions); a QKView passes as it is."""
    if isinstance(model, QKView):
        return model
    blocks = getattr(model, "blocks", None)
    if blocks is not None and all(isinstance(getattr(b, "attn", None), Attention) for b in blocks):
        sites = [qk_site(b.attn.qkv, b.attn.proj, b.attn.n_heads, b.ln1) for b in blocks]
        return QKView(sites, getattr(model, "pos_emb", None))
    if not attention_layers(model):
        raise ValueError(f"the QK inits read maskprior Attention layers, and {type(model).__name__} has none: "
                         "for timm's or Hugging Face's ViT give maskprior_retrofit.qk_view(model)")
    return QKView([qk_site(a.qkv, a.proj, a.n_heads) for a in attention_layers(model)], None)


def pseudo_input(model, site: QKSite | None = None) -> torch.Tensor:
    """(N, dim) LayerNorm(positional embedding) through `site`'s norm (default: the first layer's):
    what the QK inits fit the pattern on. `model`: one of ours (`Transformer`, `ViT`) or a QKView."""
    view = qk_view(model)
    if view.pos_emb is None:
        raise ValueError("the QK inits fit the pattern on the positional embedding, which this "
                         "model has not (positions='none'); give it positions='learned'")
    with torch.no_grad():
        return (site or view.sites[0]).norm(view.pos_emb[0]).detach()


def _set_qk_(site: QKSite, wq: torch.Tensor, wk: torch.Tensor):
    """wq, wk: (H, dim, head_dim) so that head h computes q = x @ wq[h]; the query and key biases to 0."""
    inner = site.n_heads * site.head_dim
    site.q.copy_(wq.transpose(1, 2).reshape(inner, -1))
    site.k.copy_(wk.transpose(1, 2).reshape(inner, -1))
    for b in site.biases[:2]:
        if b is not None:
            b.zero_()


def qk_weights(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, dim, head_dim) query and key maps of one attention layer (our Attention, or a QKSite)."""
    s = layer if isinstance(layer, QKSite) else qk_site(layer.qkv, layer.proj, layer.n_heads)
    h, r = s.n_heads, s.head_dim
    return tuple(w.reshape(h, r, -1).transpose(1, 2) for w in (s.q, s.k))


@torch.no_grad()
def pseudo_attention(layer, pseudo: torch.Tensor) -> torch.Tensor:
    """(H, N, N) attention of the pseudo input (N, dim) through one layer's Wq, Wk (no mask)."""
    wq, wk = qk_weights(layer)
    q = torch.einsum("nd,hdr->hnr", pseudo, wq)
    k = torch.einsum("nd,hdr->hnr", pseudo, wk)
    return (q @ k.transpose(1, 2) * wq.shape[-1] ** -0.5).softmax(-1)


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


def pattern_mass(attn: torch.Tensor, pattern: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Mean attention probability mass on the pattern. attn: (B, H, N, N) probabilities; pattern: (N, N) or (H, N, N)
    bool; rows: optional (N,) or (H, N) bool, the query rows (per head) to average over (default all). Sums each row's
    mass on allowed keys, averages over batch, heads and rows -> scalar in [0, 1]."""
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


@torch.no_grad()
def init_qk_svd_(model: nn.Module, pattern: torch.Tensor, scale: float = 1000.0,
                 noise: float = 3.0, factor_norm: float = 7.0, pos_scale: float | None = None,
                 generator: torch.Generator | None = None) -> dict:
    """Closed-form QK init (Zheng, Li, Saratchandran, Lucey 2025), solved for every layer. Per layer and head: target
    logits L = scale * pattern + noise * trunc_normal(0.6) off the pattern; A = pinv(P) L pinv(P)^T with P =
    LayerNorm(pos_emb) (rank-truncated at head_dim); A ~ U S V^T; Wq = U_r S_r^1/2, Wk = V_r S_r^1/2, each scaled to
    Frobenius norm `factor_norm`. `pos_scale` (the source uses 18 with a 0.02-std embedding) multiplies the model's
    positional embedding first. Returns the pseudo input's attention mass on the pattern, per layer. `model`: one of
    ours (`Transformer`, `ViT`: see `qk_view`) or a QKView (maskprior_retrofit.qk_view: timm's, Hugging Face's ViTs)."""
    who = "init_qk_svd_"
    pattern = _pattern(who, pattern)
    scale, noise = _real(who, "scale", scale, above=True, most=MAX_GAIN), _real(who, "noise", noise, most=MAX_GAIN)
    factor_norm = _real(who, "factor_norm", factor_norm, above=True, most=MAX_GAIN)
    pos_scale = None if pos_scale is None else _real(who, "pos_scale", pos_scale, 1 / MAX_GAIN, MAX_GAIN)
    view = qk_view(model)
    pseudo_input(view)                   # refused before anything changes where there are no positions
    if pos_scale is not None:
        view.pos_emb.mul_(pos_scale)
    masses = []
    for attn in view.sites:
        p = pseudo_input(view, attn).float()
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


def _fit_qk(p: torch.Tensor, target: torch.Tensor, h: int, r: int, steps: int, lr: float, norm_every: int,
            tol: float, generator, log, log_seconds: float) -> tuple:
    """`init_qk_opt_`'s fit: Q, K (H, dim, r) from uniform draws, Adam on MSE(softmax(P Q K^T P^T / sqrt(r)), target)
    with the norms reset every `norm_every` steps. p (N, dim), target (H, N, N) -> (Q, K, last loss, steps taken)."""
    d = p.shape[1]
    bound = math.sqrt(1.0 / (r * h))
    q = ((torch.rand(h, d, r, generator=generator) * 2 - 1) * bound).to(p.device).requires_grad_()
    k = ((torch.rand(h, d, r, generator=generator) * 2 - 1) * bound).to(p.device).requires_grad_()
    nq = q.detach().norm(dim=1).mean()   # per head and column: norm over the input axis
    nk = k.detach().norm(dim=2).mean()   # per head and input feature: norm over the r axis
    opt = torch.optim.Adam([q, k], lr=lr)
    prev, loss_val, step = float("inf"), float("nan"), 0
    said = time.monotonic()
    with torch.enable_grad():
        for step in range(1, steps + 1):
            att = ((p @ q) @ (p @ k).transpose(1, 2) * r ** -0.5).softmax(-1)
            loss = F.mse_loss(att, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_val = float(loss.detach())
            if log is not None and time.monotonic() - said >= log_seconds:
                log(f"qk-opt: fitting Q K to the pattern (N = {p.shape[0]}, {h} heads): step "
                    f"{step:,} of at most {steps:,}, loss {loss_val:.3g}")
                said = time.monotonic()
            if step % norm_every == 0:
                with torch.no_grad():
                    q.mul_(nq / q.norm(dim=1, keepdim=True).clamp_min(1e-12))
                    k.mul_(nk / k.norm(dim=2, keepdim=True).clamp_min(1e-12))
                if prev - loss_val < tol:
                    break
                prev = loss_val
    return q, k, loss_val, step


def init_qk_opt_(model: nn.Module, pattern: torch.Tensor, steps: int = 10000, lr: float = 1e-4,
                 norm_every: int = 100, tol: float = 0.0, pos_scale: float | None = None,
                 generator: torch.Generator | None = None, log=None, log_seconds: float = 10.0) -> dict:
    """Optimised QK init (Zheng, Li, Lucey 2024): fit layer 0, copy it to every layer. Adam on per-head Q (H, dim, r), K
    (H, dim, r) minimising MSE(softmax(P Q K^T P^T / sqrt(r)), pattern) with P = LayerNorm(pos_emb); every `norm_every`
    steps the columns of Q and the rows of K (per input feature) are rescaled to their initial mean norm. Stops early
    when the loss improves by less than `tol` over `norm_every` steps. `pos_scale` multiplies the positional embedding
    first (as in `init_qk_svd_`: a prior fitted on positions reaches real inputs only if the positions are not drowned
    by the token embeddings). `log` (e.g. print), when given, hears what the fit does every `log_seconds` of it (a long
    fit is never silent). Returns the final loss, steps taken and pseudo-input masses. `model`: as `init_qk_svd_` takes
    it (its layers all of the same heads and head_dim)."""
    who = "init_qk_opt_"
    pattern = _pattern(who, pattern)
    steps, norm_every = _int(who, "steps", steps, 1, None), _int(who, "norm_every", norm_every, 1, None)
    lr, tol = _real(who, "lr", lr, above=True, most=MAX_GAIN), _real(who, "tol", tol)
    pos_scale = None if pos_scale is None else _real(who, "pos_scale", pos_scale, 1 / MAX_GAIN, MAX_GAIN)
    log_seconds = _real(who, "log_seconds", log_seconds)
    view = qk_view(model)
    pseudo_input(view)
    if pos_scale is not None:
        with torch.no_grad():
            view.pos_emb.mul_(pos_scale)
    h, r = view.sites[0].n_heads, view.sites[0].head_dim
    p = pseudo_input(view).float()
    pat = _per_head(pattern, h, p.shape[0]).to(p.device)
    q, k, loss_val, step = _fit_qk(p, pat.float(), h, r, steps, lr, norm_every, tol, generator, log, log_seconds)
    with torch.no_grad():
        masses = []
        for site in view.sites:
            _set_qk_(site, q.detach(), k.detach())
            masses.append(float(pattern_mass(pseudo_attention(site, p).unsqueeze(0), pat)))
    return {"loss": loss_val, "steps": step, "pseudo_mass": masses}


# ----------------------------------------------------------------------------------------
# Arguments: each public call above reads its arguments through these readers, which give the value back or
# refuse it in one ValueError line ("who: name must be ..., got ...").

# the sizes a call may ask for: positions, heads, the entries of one tensor it builds (2**30: 4 GiB of float32);
# the gains a QK init scales by (its float32 solve overflows past them); levels (m_on, a logit) within float32's
MAX_POSITIONS, MAX_HEADS, MAX_ENTRIES, MAX_GAIN = 2 ** 20, 2 ** 12, 2 ** 30, 1e6
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _shown(value) -> str:
    """A value as a refusal names it: a tensor by its dtype and shape (and what is off in it)."""
    if not isinstance(value, torch.Tensor):
        return f"{value!r} ({type(value).__name__})"[:240]
    if value.is_meta:
        return (f"{value.dtype} of shape {tuple(value.shape)} on the meta device, which holds no values (build "
                "it outside `with torch.device('meta')`)")
    finite = not value.is_floating_point() or bool(torch.isfinite(value).all())
    off = (" holding nan or inf" if not finite
           else " allowing no pair" if value.dtype == torch.bool and not bool(value.any()) else "")
    return f"{value.dtype} of shape {tuple(value.shape)}{off}"


def _refuse(who: str, name: str, what: str, value, hint: str = ""):
    """The refusal every reader ends in: one ValueError line."""
    raise ValueError(f"{who}: {name} must be {what}, got {_shown(value)}" + (f"; {hint}" if hint else ""))


def _bounds(least, most, above: bool = False, under: bool = False) -> str:
    """' >= 1 and <= 1,048,576': a range as a refusal writes it (counts with commas, levels as %g)."""
    def number(v):
        return f"{int(v):,}" if float(v).is_integer() and abs(v) < 1e15 else f"{v:g}"
    parts = [f"{sign} {number(v)}" for sign, v in ((">" if above else ">=", least), ("<" if under else "<=", most))
             if v is not None]
    return f" {' and '.join(parts)}" if parts else ""


def _int(who: str, name: str, value, least: int = 1, most: int | None = MAX_POSITIONS) -> int:
    """`value` if it is an integer (not a bool) in least .. most (no upper bound where `most` is None)."""
    if (not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= least
            and (most is None or value <= most)):
        return value
    _refuse(who, name, "an integer" + _bounds(least, most), value)


def _real(who: str, name: str, value, least: float | None = 0.0, most: float = FLOAT32_MAX,
          above: bool = False, under: bool = False) -> float:
    """`value` as a float if it is a finite number (an int passes) within the bounds (`above`, `under`: strictly)."""
    lo = -FLOAT32_MAX if least is None else least
    if (not isinstance(value, bool) and isinstance(value, numbers.Real) and -math.inf < value < math.inf
            and (value > lo if above else value >= lo) and (value < most if under else value <= most)):
        return float(value)
    _refuse(who, name, "a finite number" + _bounds(lo, most, above, under), value,
            "give a float (or an int) within those bounds")


def _flag(who: str, name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    _refuse(who, name, "True or False", value,
            "pass a bool (a string or number would be read as True or False by its truth value)")


def _choice(who: str, name: str, value, choices: tuple) -> str:
    if isinstance(value, str) and value in choices:
        return value
    _refuse(who, name, f"{', '.join(map(repr, choices[:-1]))} or {choices[-1]!r}", value)


def _pattern(who: str, value, name: str = "pattern"):
    """A bool tensor (..., N, N) that allows a pair: True = the query (row) may attend to the key (column)."""
    if (isinstance(value, torch.Tensor) and not value.is_meta and value.dim() >= 2 and value.dtype == torch.bool
            and bool(value.any())):
        return value
    _refuse(who, name, "a bool tensor (..., N, N) that allows a pair", value, "for real-valued M give logits= instead")


def _logits(who: str, value, name: str = "logits"):
    """A finite float tensor (..., N, N): M itself."""
    if (isinstance(value, torch.Tensor) and not value.is_meta and value.dim() >= 2 and value.is_floating_point()
            and bool(torch.isfinite(value).all())):
        return value
    _refuse(who, name, "a finite float tensor (..., N, N)", value)


def _grid(who: str, value) -> tuple:
    """An image's patch grid (grid_h, grid_w): two integers in 1 .. MAX_POSITIONS."""
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(g, numbers.Integral) and not isinstance(g, bool) and 1 <= g <= MAX_POSITIONS for g in value):
        return tuple(value)
    _refuse(who, "grid", f"a (grid_h, grid_w) pair of integers in 1 .. {MAX_POSITIONS:,}", value)


def check_size(who: str, builds: str, entries: int, way: str = "build it for fewer positions or heads", each=1):
    """Refuse, before it is made, a tensor past MAX_ENTRIES float32s (`each` of them an entry while it is made)."""
    if entries * each > MAX_ENTRIES:
        made = f" ({each} x that many float32s while it is made)" if each > 1 else ""
        raise ValueError(f"{who}: {builds} would hold {entries:,} entries{made}, more than the {MAX_ENTRIES:,} "
                         f"(MAX_ENTRIES) of one tensor here: {way}")


def _source(who: str, pattern, logits, needed: bool = True) -> tuple:
    """(pattern, logits) read (`_pattern`, `_logits`): at most one of them, since one would be dropped without a
    word, and one where `needed`."""
    both = pattern is not None and logits is not None
    if both or needed and pattern is None and logits is None:
        raise ValueError(f"{who}: got both a pattern and logits, and one would be dropped; a prior starts from one: "
                         "give pattern= (bool, M = +m_on / -m_off) or logits= (M itself), not both" if both else
                         f"{who}: no pattern: give a bool (N, N) or (heads, N, N) pattern, or logits")
    return (None if pattern is None else _pattern(who, pattern)), (None if logits is None else _logits(who, logits))


# ========================================================================================
# Beyond the comparison. More patterns (image grids, graded, the causal distance), the gradient bound, roles
# ========================================================================================


def embed_pattern(pattern: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    """Place a (..., K, K) pattern at rows/cols [offset, offset+K) of a (..., N, N) False pattern."""
    who = "embed_pattern"
    pattern, offset, n = _pattern(who, pattern), _int(who, "offset", offset, 0), _int(who, "n", n)
    k = pattern.shape[-1]
    if pattern.shape[-2] != k or offset + k > n:
        raise ValueError(f"{who}: a (..., K, K) pattern placed on the diagonal at `offset` must end by n = {n}, got "
                         f"one of shape {tuple(pattern.shape)} at offset {offset}: give n >= offset + K")
    check_size(who, "its (..., n, n) pattern", pattern.shape[:-2].numel() * n * n)
    out = torch.zeros(*pattern.shape[:-2], n, n, dtype=torch.bool)
    out[..., offset:offset + k, offset:offset + k] = pattern
    return out


def _offsets(who: str, offsets) -> list:
    """A non-empty list of (dr, dc) pairs of integers."""
    if isinstance(offsets, (list, tuple)) and len(offsets) > 0 and all(isinstance(p, (list, tuple)) and len(p) == 2
            and all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in p) for p in offsets):
        return offsets
    _refuse(who, "offsets", "a non-empty list of (dr, dc) pairs of integers", offsets)


def impulse_pattern(grid_h: int, grid_w: int, offsets, n_prefix: int = 0, prefix_all: bool = True) -> torch.Tensor:
    """(H, N, N) convolution-like patterns on a patch grid, one (dr, dc) offset per head: patch (r, c) attends to
    patch (r + dr, c + dc), or to itself where that leaves the grid. `n_prefix` tokens (e.g. CLS) come first; with
    `prefix_all` they attend to, and are attended by, every token."""
    who = "impulse_pattern"
    n, offsets = _grid_sizes(who, grid_h, grid_w, n_prefix), _offsets(who, offsets)
    prefix_all = _flag(who, "prefix_all", prefix_all)
    check_size(who, "its (len(offsets), N, N) tensor (N = n_prefix + grid_h x grid_w)", len(offsets) * n * n,
               "give a smaller grid or fewer offsets")
    for dr, dc in offsets:
        if abs(dr) >= grid_h or abs(dc) >= grid_w:
            raise ValueError(f"impulse_pattern: the offset ({dr}, {dc}) leaves a {grid_h} x {grid_w} grid from "
                             "every patch (each would fall back to itself): give offsets inside the grid")
    rc = torch.stack(torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij"), -1).reshape(-1, 2)
    pats = torch.zeros(len(offsets), n, n, dtype=torch.bool)
    for h, offset in enumerate(offsets):
        to = rc + torch.tensor(offset)
        to = torch.where(((to >= 0) & (to < torch.tensor([grid_h, grid_w]))).all(-1, keepdim=True), to, rc)
        pats[h, n_prefix + torch.arange(len(rc)), n_prefix + to[:, 0] * grid_w + to[:, 1]] = True
    if n_prefix:
        pats[:, :n_prefix, :] = prefix_all
        pats[:, :, :n_prefix] = prefix_all
        pats[:, :n_prefix, :n_prefix] |= torch.eye(n_prefix, dtype=torch.bool)
    return pats


def _grid_displacements(grid_h: int, grid_w: int) -> torch.Tensor:
    """(P, P, 2) float: (row, column) of key patch minus that of query patch, P = grid_h * grid_w."""
    rc = torch.stack(torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij"), -1).reshape(-1, 2)
    return (rc[None, :, :] - rc[:, None, :]).float()


def _with_prefix(grid: torch.Tensor, n_prefix: int, fill) -> torch.Tensor:
    """(H, P, P) -> (H, n_prefix + P, n_prefix + P): prefix rows and columns (e.g. CLS) set to `fill`."""
    if not n_prefix:
        return grid
    h, p, _ = grid.shape
    out = torch.full((h, n_prefix + p, n_prefix + p), fill, dtype=grid.dtype)
    out[:, n_prefix:, n_prefix:] = grid
    return out


def window_pattern(grid_h: int, grid_w: int, kernel: int, n_heads: int, n_prefix: int = 0) -> torch.Tensor:
    """(H, N, N) bool: every head may see the kernel x kernel window of patches around the query (a
    local attention shared by all heads); prefix tokens see and are seen by every token."""
    who = "window_pattern"
    n, kernel = _grid_sizes(who, grid_h, grid_w, n_prefix), _int(who, "kernel", kernel)
    n_heads = _int(who, "n_heads", n_heads, 1, MAX_HEADS)
    check_size(who, "its (n_heads, N, N) pattern (N = n_prefix + grid_h x grid_w)", n_heads * n * n)
    d = _grid_displacements(grid_h, grid_w).abs()
    local = (d <= kernel // 2).all(-1)
    return _with_prefix(local.expand(n_heads, -1, -1).clone(), n_prefix, True)


def soft_offset_logits(grid_h: int, grid_w: int, offsets, alpha: float, m_on: float, m_off: float,
                       n_prefix: int = 0) -> torch.Tensor:
    """(H, N, N) mask logits of a soft 2-D prior (ConViT's positional init, d'Ascoli et al. 2021), one bump per head
    around its (dr, dc) offset: log sigmoid(M) = -alpha * ||delta - offset_h||^2 for the key's displacement delta from
    the query, M in [-m_off, m_on] (the top: log sigmoid(m_on) ~ 0); prefix tokens get +m_on both ways."""
    who = "soft_offset_logits"
    n, offsets = _grid_sizes(who, grid_h, grid_w, n_prefix), _offsets(who, offsets)
    alpha, m_on, m_off = _real(who, "alpha", alpha), _real(who, "m_on", m_on), _real(who, "m_off", m_off)
    check_size(who, "its (len(offsets), N, N) tensor (N = n_prefix + grid_h x grid_w)", len(offsets) * n * n,
               "give a smaller grid or fewer offsets")
    d = _grid_displacements(grid_h, grid_w)
    # (H, 2); an offset past 10^18 patches (past any grid) is read as 10^18: the squared distance stays finite
    off = torch.tensor([[min(max(v, -10 ** 18), 10 ** 18) for v in p] for p in offsets], dtype=torch.float32)
    sq = ((d[None] - off[:, None, None, :]) ** 2).sum(-1)                 # (H, P, P)
    return _with_prefix(torch.logit(torch.exp(-alpha * sq)).clamp(-m_off, m_on), n_prefix, float(m_on))


# The 3x3 offsets in the order of the 2025 structured-initialization code: self, up, right, left, down, diagonals.
IMPULSE_OFFSETS = [(0, 0), (-1, 0), (0, 1), (0, -1), (1, 0), (-1, -1), (-1, 1), (1, -1), (1, 1)]


def random_impulse_offsets(n_heads: int, kernel: int = 3, generator: torch.Generator | None = None):
    """One random (dr, dc) offset per head inside a kernel x kernel window (heads may repeat)."""
    n_heads = _int("random_impulse_offsets", "n_heads", n_heads, 1, MAX_HEADS)
    kernel = _int("random_impulse_offsets", "kernel", kernel)
    idx = torch.randint(0, kernel * kernel, (n_heads,), generator=generator,
                        device="cpu" if generator is None else generator.device).tolist()
    return [(k // kernel - kernel // 2, k % kernel - kernel // 2) for k in idx]


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """(H,) ALiBi slopes 2^(-8 h / H), h = 1..H."""
    n_heads = _int("alibi_slopes", "n_heads", n_heads, 1, MAX_HEADS)
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / n_heads) for h in range(n_heads)])


def causal_distance_logits(n: int, n_heads: int, self_logit: float = 10.0) -> torch.Tensor:
    """(H, N, N) mask logits M with log sigmoid(M) = -slope_h * (i - j) on the past (ALiBi-like):
    M = logit(exp(-slope * d)) for distance d = i - j >= 1; at d = 0 the logit is infinite and is clamped to
    `self_logit` (log sigmoid(10) = -4.5e-5). Future entries get -self_logit (the causal mask hides them)."""
    who = "causal_distance_logits"
    n, n_heads = _int(who, "n", n), _int(who, "n_heads", n_heads, 1, MAX_HEADS)
    self_logit = _real(who, "self_logit", self_logit, None)
    check_size(who, "its (n_heads, n, n) logits", n_heads * n * n, each=10)      # four float64 steps
    i = torch.arange(n)
    d = (i[:, None] - i[None, :]).float()
    p = torch.exp(-alibi_slopes(n_heads)[:, None, None].double() * d.clamp(min=1).double())
    m = (torch.log(p) - torch.log1p(-p)).float()          # logit(p), finite for d >= 1
    m = m.masked_fill(d == 0, self_logit)
    return m.masked_fill(d < 0, -self_logit)


def mask_grad_bound(attn: torch.Tensor, attn_grad: torch.Tensor, mask_logits: torch.Tensor) -> torch.Tensor:
    """Theorem 1's bound on |dL/dM| (H, N, N), from the attention probabilities. attn, attn_grad: (B, H, N, N)
    probabilities p and upstream gradients g = dL/dp of one layer; mask_logits: (H, N, N). Through the softmax and
    d logsigmoid(m)/dm = sigma(-m),
        dL/dM_ij = sigma(-M_ij) * sum_b p_bij * (g_bij - sum_k p_bik g_bik),
    and the bracket lies within max_k g_bik - min_k g_bik, so
        |dL/dM_ij| <= sigma(-M_ij) * sum_b p_bij * (max_k g_bik - min_k g_bik).
    The mask's gradient is thus at most the attention probability (times sigma(-M) <= 1)
    times the gradient's spread; it does not grow with ||q|| or ||k|| as the QK gradients do."""
    attn = _maps("mask_grad_bound", attn)
    spread = attn_grad.amax(-1, keepdim=True) - attn_grad.amin(-1, keepdim=True)
    return torch.sigmoid(-mask_logits) * (attn * spread).sum(0)


@contextlib.contextmanager
def prior_roles(model: nn.Module, rows: torch.Tensor, cols: torch.Tensor):
    """Within this block every MaskPrior of `model` serves a batch whose layout moves from example to example (operands
    of varying length, say): M is indexed by role, not by position. rows, cols: (B, L) long, the role (a row, a column
    of M, in 0..n-1) of each example's positions as a query and as a key; the bias of query i and key j of example b is
    log sigmoid(M[rows[b, i], cols[b, j]]), a (B, heads, T, T) bias (causal: -inf on the future as always). Roles that
    rise with the position keep a causal prior causal. Outside the block M is read by position; a model without a
    prior is left alone. Served in maskprior's own models and in every self-attention layer add_mask_prior serves
    (torch, Hugging Face, timm, keyword), one row of roles per example of each call (another batch size and a
    cross-attention prior are refused)."""
    priors = mask_priors(model)
    for p in priors:
        if p.cross or any(x.dim() != 2 or x.dtype != torch.long or x.shape != rows.shape
                          or (x.numel() and not 0 <= int(x.min()) <= int(x.max()) < p.n) for x in (rows, cols)):
            raise ValueError(f"{p.where}: prior_roles needs rows and cols of one (B, L) shape, long, in "
                             f"0..{p.n - 1} (self-attention); got {tuple(rows.shape)} and {tuple(cols.shape)}")
    for p in priors:
        p.roles = (rows, cols)
    try:
        yield
    finally:
        for p in priors:
            p.roles = None


# ----------------------------------------------------------------------------------------
# Models: one trunk (blocks, final LayerNorm, readout, head), two front ends: `Transformer` (tokens), `ViT` (patches).


class MLP(nn.Sequential):
    def __init__(self, dim: int, hidden: int, dropout: float = 0.0):
        super().__init__(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout),
                         nn.Linear(hidden, dim), nn.Dropout(dropout))


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
    flex: bool = False              # a layer with M: torch's flex_attention, M read inside the kernel
    qkv_bias: bool = False
    dropout: float = 0.0
    pos_init_std: float = 1.0       # positional embedding ~ N(0, std^2)
    drop_path: float = 0.0          # stochastic depth: the last block skips its branches with this probability
    mask_param: str = "full"        # M per (query, key); "relative": per distance i - j; "grid": per patch offset
    mask_window: int | None = None  # a relative M's distances 0 .. W - 1, the last read past them (default: N)

    @property
    def mask_grid(self) -> tuple[int, int] | None:
        """The patch grid of a 2-D relative M (mask_param="grid"): an image model's."""
        return None

    def __post_init__(self):
        """Each field read (`_field`: one ValueError line naming the config and the field), then the fields together."""
        for f in fields(self):
            value = getattr(self, f.name)
            if not (value is None and f.default is None):
                setattr(self, f.name, _field(type(self).__name__, f.name, value))
        who, broken = type(self).__name__, ""
        if self.mask_param == "grid" and getattr(self, "image_size", None) is None:
            broken = "mask_param='grid' is a 2-D relative M over an image's patch grid: an image model's (ViTConfig)"
        elif not self.head_dim and self.dim < self.n_heads:
            broken = (f"dim {self.dim} over n_heads {self.n_heads} leaves each head no dimension: give dim >= "
                      "n_heads, or head_dim")
        elif getattr(self, "tie_embeddings", False) and self.n_outputs != self.vocab_size:
            broken = (f"tie_embeddings shares the token embedding with the head, so n_outputs ({self.n_outputs}) "
                      f"must be vocab_size ({self.vocab_size})")
        if broken:
            raise ValueError(f"{who}: {broken}")


def _field(who: str, name: str, value):
    """A model config's field `name` read as its kind: a switch, a count, a rate in [0, 1), a std, or a word."""
    words = {"mask_param": ("full", "relative", "grid"), "readout": ("cls", "mean", "tokens"),
             "positions": ("learned", "none"), "pool": ("mean", "cls")}
    if name in words:
        return _choice(who, name, value, words[name])
    if name in ("learnable_mask", "fused", "flex", "qkv_bias", "causal", "tie_embeddings"):
        return _flag(who, name, value)
    if name in ("dropout", "drop_path"):
        return _real(who, name, value, 0.0, 1.0, under=True)
    if name in ("pos_init_std", "emb_init_std"):
        return _real(who, name, value, 0.0, MAX_GAIN)
    most = MAX_HEADS if name == "n_heads" else MAX_POSITIONS if name in ("seq_len", "mask_window") else None
    return _int(who, name, value, 1, most)


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth: zero a residual branch for a random fraction p of the samples, scale the
    others by 1 / (1 - p). x: (B, ...) -> same; the identity when not training or p = 0."""
    if not training or p == 0.0:
        return x
    keep = x.new_empty(x.shape[0], *([1] * (x.dim() - 1))).bernoulli_(1.0 - p)
    return x * keep / (1.0 - p)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(LN(x)), then x + mlp(LN(x)). (B, T, dim) -> same. `mask_size`: the
    positions N of the layer's M (None: no M); `causal`: hide future keys; `drop_path`: this block's stochastic-depth
    probability."""

    def __init__(self, cfg: TrunkConfig, mask_size: int | None = None, causal: bool = False, drop_path: float = 0.0):
        super().__init__()
        self.drop_path = drop_path
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.n_heads, cfg.head_dim, mask_size, causal, cfg.qkv_bias,
                              cfg.fused, cfg.mask_param, cfg.flex, cfg.mask_window, cfg.mask_grid)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg.dim, cfg.mlp_dim, cfg.dropout)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, return_attn: bool = False, cache: dict | None = None):
        a, attn = self.attn(self.ln1(x), return_attn, cache)
        x = x + drop_path(self.drop(a), self.drop_path, self.training)
        x = x + drop_path(self.mlp(self.ln2(x)), self.drop_path, self.training)
        return x, attn


class Trunk(nn.Module):
    """The shared part of every model: embed -> blocks -> LayerNorm -> readout -> head. A subclass sets `blocks` (via
    `_build_trunk`), `head`, `readout` ('cls': the first token, 'mean': average over tokens, 'tokens': every token) and
    defines `embed(inputs) -> (B, N, dim)`; the QK inits and probes rely on `blocks` and `pos_emb` (1, N, dim)."""

    def _build_trunk(self, cfg: TrunkConfig, n_positions: int, causal: bool = False) -> None:
        mask_size = n_positions if cfg.learnable_mask else None
        rates = [cfg.drop_path * i / max(1, cfg.n_layers - 1) for i in range(cfg.n_layers)]  # timm's: 0 to drop_path
        self.blocks = nn.ModuleList([Block(cfg, mask_size, causal, rate) for rate in rates])
        self.ln_f = nn.LayerNorm(cfg.dim)

    def forward(self, inputs: torch.Tensor, return_attn: bool = False, cache: list[dict] | None = None):
        """-> outputs, or (outputs, [per-layer (B, heads, N, N) attention]) with `return_attn`. `cache`: one dict per
        block, a causal model's keys and values between calls (`generate`); the inputs then follow the cached tokens."""
        x = self.embed(inputs) if cache is None else self.embed(inputs, start=cache[0]["k"].shape[2] if cache[0] else 0)
        maps = []
        for i, block in enumerate(self.blocks):
            x, attn = block(x, return_attn, None if cache is None else cache[i])
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
    # 'learned' (a table of N positions) or 'none' (order from a causal mask and relative prior, as ALiBi: any length)
    positions: str = "learned"

    @property
    def n_positions(self) -> int:
        return self.seq_len + (1 if self.readout == "cls" else 0)


class Transformer(Trunk):
    """Token ids (B, T) with T <= seq_len -> (B, n_outputs) for 'cls'/'mean', (B, T, n_outputs) for 'tokens'. With the
    GOTU settings (vocab 2, CLS readout, one output) this is the Boolean model of Abbe et al. 2023; with
    `causal=True, readout='tokens'` it is a decoder / language model. With `positions='none'` it has no positional
    embedding and serves any T, as far as its priors do (a relative M serves any length, a full one its N)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg, self.readout = cfg, cfg.readout
        n = cfg.n_positions
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.dim)) if cfg.readout == "cls" else None
        self.pos_emb = nn.Parameter(torch.zeros(1, n, cfg.dim)) if cfg.positions == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self._build_trunk(cfg, n, cfg.causal)
        self.head = nn.Linear(cfg.dim, cfg.n_outputs, bias=not cfg.tie_embeddings)
        for emb in (self.tok_emb.weight, self.cls):
            if emb is not None:
                nn.init.normal_(emb, std=cfg.emb_init_std)
        if self.pos_emb is not None:
            nn.init.normal_(self.pos_emb, std=cfg.pos_init_std)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def embed(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        """(B, T) ids at positions start .. start + T - 1 -> (B, N, dim) input to the first block
        (CLS prepended at position 0, positions added)."""
        if self.pos_emb is not None and start + idx.shape[1] > self.cfg.seq_len:
            raise ValueError(f"an input of {start + idx.shape[1]} tokens is longer than the model's seq_len "
                             f"{self.cfg.seq_len} (its positional embedding; positions='none' has none)")
        x = self.tok_emb(idx)
        if self.cls is not None and start == 0:
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        return self.drop(x if self.pos_emb is None else x + self.pos_emb[:, start:start + x.shape[1]])

    def any_length(self) -> bool:
        """Whether the model serves sequences of any length: no positional table, and no M of a fixed size."""
        return self.pos_emb is None and all(p.param == "relative" for p in mask_priors(self))


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
    def mask_grid(self) -> tuple[int, int] | None:
        return (self.grid, self.grid) if self.mask_param == "grid" else None

    @property
    def n_positions(self) -> int:
        return self.n_prefix + self.grid ** 2


class ViT(Trunk):
    """Images (B, C, H, W) float -> logits (B, n_classes). Patches are numbered row-major after the prefix."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
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
        size = self.cfg.image_size
        if images.dim() != 4 or tuple(images.shape[-2:]) != (size, size):
            raise ValueError(f"images of shape {tuple(images.shape)} do not fit the model: it takes (B, C, {size}, "
                             f"{size}) (its patch grid and positional embedding)")
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        return self.drop(x + self.pos_emb)


MODELS = {TransformerConfig: Transformer, ViTConfig: ViT}  # a model family: its config class -> its model


def build_model(cfg: TrunkConfig) -> Trunk:
    """The model of a config (an instance of one of MODELS' config classes), its weights as drawn."""
    if type(cfg) not in MODELS:
        raise TypeError(f"no model family takes a {type(cfg).__name__}; MODELS holds "
                        f"{', '.join(c.__name__ for c in MODELS)}")
    return MODELS[type(cfg)](cfg)


def family_of(names) -> type:
    """The one config class of MODELS whose fields take every name in `names` (a task's arch(), a
    saved config's keys); ValueError where none or several do."""
    families = [c for c in MODELS if set(names) <= {f.name for f in fields(c)}]
    if len(families) != 1:
        raise ValueError(f"a config with keys {', '.join(sorted(names))} fits {len(families)} model families "
                         f"({', '.join(c.__name__ for c in families) or 'none'}), not one")
    return families[0]


def model_from_config(config: dict) -> Trunk:
    """The model a saved config (`asdict` of a MODELS config) describes: the one family whose config takes every
    saved key. Build it under `torch.device("meta")` to check a config against saved weights for free."""
    return build_model(family_of(config)(**config))


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
             generator: torch.Generator | None = None, cache: bool = True) -> torch.Tensor:
    """Sample `n_new` tokens after `idx` (B, T) from a causal Transformer with readout 'tokens'. temperature 0 =
    greedy. -> (B, T + n_new). A model that serves any length (`any_length`) reads the whole sequence; else the
    context is cropped to the last seq_len tokens. `cache`: keep each layer's keys and values (a KV cache) while the
    sequence fits, so each step runs the new token alone; the tokens are the same as without it."""
    n_new, temperature = _int("generate", "n_new", n_new, 0), _real("generate", "temperature", temperature)
    top_k = None if top_k is None else _int("generate", "top_k", top_k, 1, None)
    kv = [{} for _ in model.blocks] if cache else None
    limit = None if model.any_length() else model.cfg.seq_len
    for _ in range(n_new):
        if kv is not None and (limit is None or idx.shape[1] <= limit):
            done = kv[0]["k"].shape[2] if kv[0] else 0
            logits = model(idx[:, done:], cache=kv)[:, -1].float()
        else:                               # past the context: a window that slides, recomputed
            kv = None
            logits = model(idx if limit is None else idx[:, -limit:])[:, -1].float()
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            # from the largest, by at least float32's tiny: a small temperature sends the rest to -inf,
            # never the top to inf or 0 / 0
            logits = (logits - logits.amax(-1, keepdim=True)) / max(temperature, torch.finfo(logits.dtype).tiny)
            if top_k:
                kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


# ----------------------------------------------------------------------------------------
# The mimetic init (vision; Trockman and Kolter 2023): on our Attention layers or a QKView


def _ortho_like(dim: int, alpha: float, beta: float, sign: float, generator=None):
    """A = alpha * U(-sqrt(3/D), sqrt(3/D)) + sign * beta * I = L R, split by SVD."""
    z = (torch.rand(dim, dim, generator=generator) * 2 - 1) * math.sqrt(3.0 / dim)
    a = alpha * z + sign * beta * torch.eye(dim)
    u, s, vh = torch.linalg.svd(a)
    return u * s.sqrt(), s.sqrt()[:, None] * vh


@torch.no_grad()
def init_mimetic_(model: nn.Module, qk: tuple[float, float] | None = (0.7, 0.7),
                  vo: tuple[float, float] | None = (0.4, 0.4), generator: torch.Generator | None = None) -> dict:
    """Mimetic init (Trockman and Kolter 2023): per head Wq Wk^T ~ a Z + b I; per layer Wv Wproj ~ a Z - b I. Z has
    entries of variance 1/D; `qk` and `vo` are the (a, b) pairs, None to leave that product alone. Returns the relative
    error of the V-proj products to their targets (non-zero only when heads x head_dim < dim truncates them). Works on
    any model with maskprior `Attention` layers (no positional embedding needed) and on a QKView (`qk_view`)."""
    errs = []
    for attn in qk_view(model).sites:
        h, r = attn.n_heads, attn.head_dim
        dim, dev = attn.q.shape[1], attn.q.device
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
            attn.v.copy_(left[:, :inner].T.to(dev))          # v = x @ left[:, :inner]
            attn.o.copy_(right[:inner].T.to(dev))            # out = v @ right[:inner]
            if attn.biases[2] is not None:
                attn.biases[2].zero_()
            full = left @ right
            errs.append(float((left[:, :inner] @ right[:inner] - full).norm() / full.norm()))
    return {"vo_truncation_error": errs}


# ----------------------------------------------------------------------------------------
# Probes: how much of the prior survives.


def prior_rows(pattern: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """The query rows the pattern constrains: (N,) bool for an (N, N) pattern, (H, N) for an (H, N, N) one. A row is
    free when it allows every key it can see (`visible_keys`); free rows carry no prior and are left out of the mass."""
    pattern, causal = _pattern("prior_rows", pattern), _flag("prior_rows", "causal", causal)
    n = pattern.shape[-1]
    visible = causal_pattern(n) if causal else torch.ones(n, n, dtype=torch.bool)
    return ~(pattern.cpu() == visible).all(-1)


def layer_margin(a: torch.Tensor, pattern: torch.Tensor, rows: torch.Tensor,
                 bias: torch.Tensor | None = None, causal: bool = False) -> float:
    """One layer's content margin (see `content_margin`) from its (B, H, T, T) attention map `a`: the layer's (H, T,
    T) `bias` log sigmoid(M) (None without a prior) is taken out of log a, then log-sum-exp over the visible keys
    off `pattern` minus over those on it, averaged over the constrained `rows`, heads and batch."""
    pattern, causal = _pattern("layer_margin", pattern), _flag("layer_margin", "causal", causal)
    n = a.shape[-1]
    on = pattern.to(a.device)
    off = ~on & (causal_pattern(n) if causal else torch.ones(n, n, dtype=torch.bool)).to(a.device)
    c = a.float().clamp_min(1e-30).log()
    if bias is not None:
        c = c - bias.to(a.device).nan_to_num(neginf=0.0)  # future keys (causal) are left out below
    margin = c.masked_fill(~off, float("-inf")).logsumexp(-1) - c.masked_fill(~on, float("-inf")).logsumexp(-1)
    rows = rows.to(a.device)
    margin = margin[:, rows] if rows.dim() == 2 else margin[..., rows]
    return float(margin[margin.isfinite()].mean())


@torch.no_grad()
def attention_maps(model: nn.Module, inputs) -> list[torch.Tensor]:
    """Per layer, the (B, H, T, T) attention probabilities of one forward pass `model(inputs)`: maskprior's own models
    through their explicit path; any other model through its priors (each attention that serves a MaskPrior appends
    its probabilities to `prior.record` while it is a list, as maskprior_retrofit's layers do). Raises for a layer whose
    softmax the library cannot see (a `modules=` attention of your own: return its maps, use `pattern_mass`)."""
    if attention_layers(model):
        return list(model(inputs, return_attn=True)[1])
    priors = mask_priors(model)
    if not priors:
        raise ValueError(f"attention_maps: {type(model).__name__} has no maskprior Attention and "
                         "no MaskPrior (maskprior_retrofit.add_mask_prior) to read attention maps from")
    for p in priors:
        p.record = []
    try:
        model(inputs)
        maps = [p.record for p in priors]
    finally:
        for p in priors:
            p.record = None
    for p, got in zip(priors, maps):
        if len(got) != 1:
            raise ValueError(f"attention_maps: {p.where} gave {len(got)} attention maps in one forward pass (its "
                             f"softmax is not one the library can see, or the layer ran {len(got)} times); return "
                             "its maps yourself and use mp.pattern_mass")
    return [got[0] for got in maps]


@torch.no_grad()
def prior_probe(model: nn.Module, inputs, pattern: torch.Tensor) -> tuple[list[float], list[float]]:
    """(`prior_mass`, `content_margin`) per layer from one forward pass of `inputs` (`attention_maps`). The pattern
    must cover the model's positions exactly; only a causal model may read a prefix of it (shorter inputs). Raises
    ValueError when it constrains no row (e.g. a causal window wider than the context): the mass would be empty."""
    maps = attention_maps(model, inputs)
    n = maps[0].shape[-1]
    layers = attention_layers(model)
    if layers:
        causal, biases = layers[0].causal, [attn.attn_bias(n, torch.float32) for attn in layers]
    else:
        priors = mask_priors(model)
        causal, biases = priors[0].causal, [p(n, torch.float32) for p in priors]
    if causal and n < pattern.shape[-1]:
        pattern = pattern[..., :n, :n]
    rows = prior_rows(pattern, causal)
    if not rows.any():
        raise ValueError(f"the pattern of shape {tuple(pattern.shape)} constrains no query row (each row allows "
                         "every key it can see), so there is no prior mass to measure")
    mass = [float(pattern_mass(a, pattern, rows)) for a in maps]
    return mass, [layer_margin(a, pattern, rows, bias, causal) for a, bias in zip(maps, biases)]


def prior_mass(model: nn.Module, inputs: torch.Tensor, pattern: torch.Tensor) -> list[float]:
    """Per layer: the attention mass on `pattern` of a batch `inputs`, averaged over the constrained `prior_rows`."""
    return prior_probe(model, inputs, pattern)[0]


def content_margin(model: nn.Module, inputs: torch.Tensor, pattern: torch.Tensor) -> list[float]:
    """Per layer: by how many nats the content logits (q.k / sqrt(d), the layer's bias taken out) favour the visible
    keys off `pattern` over those on it, log sum_off exp(c) - log sum_on exp(c), averaged over `prior_rows`, heads and
    batch. Read from the attention map a = softmax(c + bias): c = log a - bias up to a per-row constant. With a bias of
    b_on on the pattern and b_off off it, a row's off/on mass ratio is exp(margin - (b_on - b_off)): the prior holds the
    majority while the margin stays below its gap (about m_off for a `mask` at m_on = 5)."""
    return prior_probe(model, inputs, pattern)[1]


@torch.no_grad()
def prior_snapshot(model: nn.Module) -> list[dict]:
    """Per layer: a copy of M (if any) and of the per-head Wq Wk^T products (H, dim, dim); for a
    model whose attention is not ours (`add_mask_prior`), per MaskPrior: M alone (qk None)."""
    snap = []
    for attn in attention_layers(model):
        wq, wk = qk_weights(attn)
        m = attn.prior.bias.detach().clone() if attn.prior is not None else None
        snap.append({"mask": m, "qk": (wq @ wk.transpose(1, 2)).detach().clone()})
    if not snap:
        snap = [{"mask": prior.bias.detach().clone(), "qk": None} for prior in mask_priors(model)]
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


# ----------------------------------------------------------------------------------------
# Priors without an oracle: a trained model's attention (`mean_attention`) read as a prior for another model, against
# each row's uniform share: a bool pattern (`pattern_from_attention`: query-key pairs, or keys made a clique), soft
# logits whose bias alone gives the mean attention back (`logits_from_attention`), or a translation-invariant form
# (`relative_from_attention` per distance i - j, `offsets_from_attention` per 2-D offset). All end in
# `init_mask_(model, pattern)` or `init_mask_(model, logits=...)` / `add_mask_prior(model, logits=...)`.


@torch.no_grad()
def mean_attention(model: nn.Module, inputs) -> torch.Tensor:
    """(L, H, N, N) float: the attention probabilities of `attention_maps(model, inputs)` (every model it reads)
    averaged over the batch, one (H, N, N) map per layer; refused where they hold a non-finite value."""
    attn = torch.stack([a.float().mean(0) for a in attention_maps(model, inputs)])
    _maps("mean_attention", attn, probabilities=False)
    return attn


def visible_keys(n: int, causal: bool = False) -> torch.Tensor:
    """(N, N) bool: the keys each query row can see (every key, or j <= i when causal)."""
    n, causal = _int("visible_keys", "n", n), _flag("visible_keys", "causal", causal)
    check_size("visible_keys", "its (n, n) pattern", n * n)
    return causal_pattern(n) if causal else torch.ones(n, n, dtype=torch.bool)


def attention_ratio(attn: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """attn (..., N, N) probabilities -> the same shape: each probability over its row's uniform share, 1 / (the
    keys the row sees), so 1.0 is uniform attention; 0 on keys a causal row cannot see."""
    attn, causal = _maps("attention_ratio", attn), _flag("attention_ratio", "causal", causal)
    vis = visible_keys(attn.shape[-1], causal).to(attn.device)
    return attn.float() * vis.sum(-1, keepdim=True) * vis


def _maps(who: str, attn, probabilities: bool = True) -> torch.Tensor:
    """Attention maps read: a float tensor, not empty, finite (one nan would make every logit nan, or read as no
    attention at all), and with `probabilities` rows that are >= 0 and attend somewhere; else one ValueError line."""
    if not isinstance(attn, torch.Tensor) or not attn.is_floating_point():
        what = attn.dtype if isinstance(attn, torch.Tensor) else type(attn).__name__
        wrong = (f"attention maps are a float tensor of probabilities, got {what}; pass mean_attention's (L, H, N, N) "
                 "or any (..., N, N) maps")
    elif attn.numel() == 0:
        wrong = (f"the attention maps of shape {tuple(attn.shape)} are empty; there is no attention to read a prior "
                 "from: pass maps of at least one layer, head and token")
    elif not bool(torch.isfinite(attn).all()):
        wrong = (f"the attention maps hold {int((~torch.isfinite(attn)).sum())} non-finite values (nan or inf) of "
                 f"{attn.numel()}; a prior read from them would be nan or arbitrary: read the maps from a model whose "
                 "outputs are finite")
    elif probabilities and (bool((attn < 0).any()) or not bool((attn.sum(-1) > 0).all())):
        wrong = f"attn must be attention probabilities, each row >= 0 and attending somewhere, got {_shown(attn)}"
    else:
        return attn
    raise ValueError(f"{who}: {wrong}")


def _over_layers(attn: torch.Tensor, per_head: bool, who: str) -> torch.Tensor:
    """(..., H, N, N) or (N, N) -> (H, N, N) averaged over the leading dimensions (per_head), else
    (N, N); the maps are its callers' `attn`, read by `_maps` already."""
    if attn.dim() < (3 if per_head else 2) or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"{who}: attention maps are (..., N, N) with N queries and N keys, and (..., H, N, N) with a "
                         f"head dimension for per_head, got shape {tuple(attn.shape)}")
    if per_head:
        return attn.float().cpu().reshape(-1, *attn.shape[-3:]).mean(0)
    return attn.float().cpu().reshape(-1, *attn.shape[-2:]).mean(0)


def pattern_from_attention(attn: torch.Tensor, ratio: float = 1.5, causal: bool = False, keys: bool = False,
                           readout=None, per_head: bool = False) -> torch.Tensor:
    """A bool pattern from mean attention `attn` (..., N, N), e.g. `mean_attention`'s (L, H, N, N), averaged over its
    leading dimensions (heads kept with `per_head`: (H, N, N); else (N, N)). Pairs (keys=False): query i may attend to
    key j when the attention is at least `ratio` times row i's uniform share; with `readout` (query rows, e.g. the
    answer rows of a decoder) only those rows are constrained, the others keep every key they see. Keys (keys=True): the
    keys whose share, averaged over the `readout` rows (every row when None), is at least `ratio` times uniform form a
    clique (each sees the others), the `readout` rows given attend to them, every other row to itself: the form of the
    Boolean tasks' oracle patterns (a CLS readout: readout=[0]; mean pooling: None). Self-loops are always allowed
    (no row is empty), future keys never (causal); `_names_pairs` refuses a pattern of nothing else."""
    who = "pattern_from_attention"
    attn, ratio, causal = _maps(who, attn), _real(who, "ratio", ratio, above=True), _flag(who, "causal", causal)
    keys, per_head = _flag(who, "keys", keys), _flag(who, "per_head", per_head)
    ints = (isinstance(readout, torch.Tensor) and readout.dim() == 1 and not readout.is_floating_point()
            and readout.dtype != torch.bool or isinstance(readout, (list, tuple, range))
            and all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in readout))
    n = attn.shape[-1]
    if readout is not None and not (ints and len(readout) > 0 and 0 <= min(map(int, readout)) <= max(map(int, readout))
                                    < n):
        _refuse(who, "readout", f"a non-empty list (or 1-D integer tensor) of positions 0 .. {n - 1}, the maps' rows",
                readout)
    r = attention_ratio(_over_layers(attn, per_head, "pattern_from_attention"), causal)
    vis, eye = visible_keys(n, causal).to(r.device), torch.eye(n, dtype=torch.bool, device=r.device)
    rows = torch.zeros(n, dtype=torch.bool, device=r.device)
    rows[list(range(n)) if readout is None else list(readout)] = True
    if not keys:
        found = (r >= ratio) & vis
        free = vis.expand_as(found) & ~rows[:, None]
        largest = float(r.masked_fill(~(vis & rows[:, None]) | eye, 0).max())  # a constrained row's other keys
        return _names_pairs(found | free | eye, free | eye, ratio, largest, largest)
    seen = vis & rows[:, None]              # the readout rows, over the keys each sees
    relevance = (r * seen).sum(-2) / seen.sum(-2).clamp_min(1)  # (..., N): a key's mean share over those rows
    key = relevance >= ratio
    clique = key[..., :, None] & key[..., None, :]
    reads = (rows[:, None] & key[..., None, :]) if readout is not None else torch.zeros_like(clique)
    reach = relevance.topk(2, -1).values[..., 1] if n > 1 else torch.zeros(())  # a clique needs two keys
    if readout is not None:                 # or one key that a readout row other than itself sees
        read = (vis & rows[:, None] & ~eye).any(-2)
        reach = torch.maximum(reach, relevance.masked_fill(~read, 0).amax(-1))
    return _names_pairs((clique | reads | eye) & vis, eye, ratio, float(relevance.max()), float(reach.max()))


def _names_pairs(pattern: torch.Tensor, given: torch.Tensor, ratio: float, largest: float,
                 reach: float) -> torch.Tensor:
    """`pattern`, unless it names no pair beyond what it holds anyway (`given`: self-loops, free rows): then no
    share reached `ratio`, and a self-loops-only prior would pass for a found one. One line naming the largest ratio
    present and the ratio at or below which a pair appears (`reach`)."""
    if bool((pattern & ~given).any()):
        return pattern
    raise ValueError(f"pattern_from_attention: no query-key pair beyond the self-loops reaches ratio {ratio:g} "
                     f"(the largest share present is {largest:.4g} times uniform), so the pattern would name "
                     f"nothing: give a ratio of at most {reach:.4g}, or maps with structure")


def pattern_agreement(found: torch.Tensor, oracle: torch.Tensor, causal: bool) -> dict:
    """Precision and recall of the pairs (query i, key j != i) a found pattern allows against an oracle's, over the
    rows the oracle constrains (per head where both are per head, else over the union of heads)."""
    causal = _flag("pattern_agreement", "causal", causal)
    if found.dim() != oracle.dim():
        found, oracle = (p.any(0) if p.dim() == 3 else p for p in (found, oracle))
    rows = prior_rows(oracle, causal)
    n = oracle.shape[-1]
    off_diagonal = ~torch.eye(n, dtype=torch.bool)
    keep = off_diagonal & (rows[..., :, None] if rows.dim() == oracle.dim() - 1 else rows)
    f, o = found.cpu() & keep, oracle.cpu() & keep
    hit = int((f & o).sum())
    return {"precision": hit / max(1, int(f.sum())), "recall": hit / max(1, int(o.sum())),
            "found_pairs": int(f.sum()), "oracle_pairs": int(o.sum())}


def logits_from_attention(attn: torch.Tensor, m_on: float = M_ON, m_off: float = M_OFF,
                          causal: bool = False, per_head: bool = True) -> torch.Tensor:
    """Soft initial M (H, N, N) from mean attention `attn` (..., H, N, N) averaged over the leading dimensions ((N, N)
    from (..., N, N) with per_head=False): M = logit(a_ij / max_j a_ij), clamped to [-m_off, m_on], so that the bias
    alone (content logits equal) gives the mean attention back, each row's favourite key at about 0 and the others
    suppressed by their log ratio to it; keys a causal row cannot see get -m_off (the causal mask hides them)."""
    who = "logits_from_attention"
    attn, m_on, m_off = _maps(who, attn), _real(who, "m_on", m_on), _real(who, "m_off", m_off)
    causal, per_head = _flag(who, "causal", causal), _flag(who, "per_head", per_head)
    a = _over_layers(attn, per_head, "logits_from_attention").clamp_min(0)
    vis = visible_keys(a.shape[-1], causal).to(a.device)
    return _logit_of_share(a / a.amax(-1, keepdim=True).clamp_min(1e-30), m_on, m_off).masked_fill(~vis, -float(m_off))


def _logit_of_share(q: torch.Tensor, m_on: float, m_off: float) -> torch.Tensor:
    """M with log sigmoid(M) = log q for shares q in [0, 1] (1: no suppression), clamped to [-m_off, m_on]."""
    q = q.clamp(1e-12, 1 - 1e-12)
    return (q.log() - (-q).log1p()).clamp(-m_off, m_on)


def relative_from_attention(attn: torch.Tensor, m_on: float = M_ON, m_off: float = M_OFF,
                            causal: bool = False) -> torch.Tensor:
    """The translation-invariant form in 1-D: per head, the mean attention averaged along each diagonal (each distance
    d = i - j the rows see), over its largest value, as M (log sigmoid(M) = log of that share, clamped to [-m_off,
    m_on]) spread back over the diagonals. attn (..., H, N, N) -> (H, N, N) logits that depend on i - j alone, as a
    relative MaskPrior (`param="relative"`) holds them; a causal prior's future entries get -m_off (masked anyway)."""
    who = "relative_from_attention"
    attn, m_on, m_off = _maps(who, attn), _real(who, "m_on", m_on), _real(who, "m_off", m_off)
    causal = _flag(who, "causal", causal)
    a = _over_layers(attn, True, "relative_from_attention")
    h, n = a.shape[0], a.shape[-1]
    i = torch.arange(n, device=a.device)
    d = i[:, None] - i[None, :] + n - 1                          # 0 .. 2n - 2
    vis = visible_keys(n, causal).to(a.device)
    total = torch.zeros(h, 2 * n - 1, device=a.device).index_add_(1, d[vis], a[:, vis])
    count = torch.zeros(2 * n - 1, device=a.device).index_add_(0, d[vis], torch.ones(int(vis.sum()), device=a.device))
    table = total / count.clamp_min(1)      # (H, 2N - 1): the mean share per distance
    m = _logit_of_share(table / table.amax(-1, keepdim=True).clamp_min(1e-30), m_on, m_off)[:, d]
    return m.masked_fill(~vis, -float(m_off))


def offsets_from_attention(attn: torch.Tensor, grid_h: int, grid_w: int, n_prefix: int = 0,
                           m_on: float = M_ON, m_off: float = M_OFF) -> torch.Tensor:
    """The translation-invariant form on an image grid: per head, the mean attention of patch (r, c) to patch
    (r + dr, c + dc) averaged over every patch pair at offset (dr, dc), as `relative_from_attention` reads a distance,
    spread back over the grid; prefix tokens (CLS) attend and are attended at m_on. attn (..., H, N, N) with N =
    n_prefix + grid_h * grid_w -> (H, N, N) logits (a soft per-offset prior, as `soft_offset_logits` sets by hand)."""
    who = "offsets_from_attention"
    attn, m_on, m_off = _maps(who, attn), _real(who, "m_on", m_on), _real(who, "m_off", m_off)
    _grid_sizes(who, grid_h, grid_w, n_prefix)
    a = _over_layers(attn, True, "offsets_from_attention")
    h, n, g = a.shape[0], a.shape[-1], grid_h * grid_w
    if n != n_prefix + g:
        raise ValueError(f"maps over {n} tokens, but a {grid_h} x {grid_w} grid with {n_prefix} "
                         f"prefix tokens has {n_prefix + g}")
    disp = _grid_displacements(grid_h, grid_w).long()  # (G, G, 2): key position - query position
    idx = (disp[..., 0] + grid_h - 1) * (2 * grid_w - 1) + disp[..., 1] + grid_w - 1
    idx = idx.reshape(-1).to(a.device)
    grid = a[:, n_prefix:, n_prefix:].reshape(h, -1)
    slots = (2 * grid_h - 1) * (2 * grid_w - 1)
    total = torch.zeros(h, slots, device=a.device).index_add_(1, idx, grid)
    count = torch.zeros(slots, device=a.device).index_add_(0, idx, torch.ones(idx.numel(), device=a.device))
    table = total / count.clamp_min(1)      # (H, (2 gh - 1)(2 gw - 1)): share per offset
    m = _logit_of_share(table / table.amax(-1, keepdim=True).clamp_min(1e-30), m_on, m_off)[:, idx].reshape(h, g, g)
    return _with_prefix(m, n_prefix, float(m_on))


# the public names (`from maskprior import *`)
__all__ = [
    "M_ON", "M_OFF", "IMPULSE_OFFSETS", "MODELS", "MAX_POSITIONS", "MAX_HEADS", "MAX_ENTRIES", "MAX_GAIN", "Attention",
    "Block", "MLP", "MaskPrior", "Transformer", "TransformerConfig", "Trunk", "TrunkConfig", "ViT", "ViTConfig",
    "alibi_slopes", "attention_layers", "attention_maps", "attention_ratio", "banded_pattern", "build_model",
    "causal_distance_logits", "causal_pattern", "content_margin", "depends_on_distance", "embed_pattern", "family_of",
    "future_keys", "generate", "impulse_pattern", "init_mask_", "init_mimetic_", "init_qk_opt_", "init_qk_svd_",
    "layer_margin", "logits_from_attention", "mask_bias", "mask_grad_bound", "mask_logits_from_pattern", "mask_priors",
    "mean_attention", "model_from_config", "offsets_from_attention", "param_groups", "pattern_agreement",
    "pattern_from_attention", "pattern_from_pairs", "pattern_mass", "prior_attention", "prior_drift", "prior_mass",
    "prior_parameter_names", "prior_probe", "prior_roles", "prior_rows", "prior_snapshot", "pseudo_attention",
    "pseudo_input", "qk_weights", "random_impulse_offsets", "QKSite", "QKView", "qk_site", "qk_view", "grid_index",
    "grid_slots", "relative_from_attention", "soft_offset_logits", "visible_keys", "window_pattern",
]
