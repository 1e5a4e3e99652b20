"""The mask prior in other libraries' models: `add_mask_prior` gives every attention layer of a model that is not ours
its own `maskprior.MaskPrior` (nn.MultiheadAttention, timm's and Hugging Face's attention, any module with an
additive-mask keyword), serves it the lengths, padding, caches and saving those libraries use, and takes it out again
(`remove_mask_prior`); `from_pretrained` loads a Hugging Face model saved with priors.

maskprior.py is the method and trains our own models alone; this file imports it and torch alone (copy both to retrofit
another codebase's models): frameworks are recognised by duck typing, transformers and peft imported only in the calls
that need them. Importing it changes nothing; once a process attaches its first prior, PEFT's and transformers' adapter
loaders (now or when imported) refuse an adapter that carries M onto a model without priors (`ADAPTER_LOADERS`)."""
from __future__ import annotations

import copy
import functools
import importlib.abc
import importlib.util
import inspect
import json
import math
import sys
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Tuple

import torch
import torch.nn as nn

import maskprior as mp

# ----------------------------------------------------------------------------------------
# Four kinds of layer, four small adapters (`add_mask_prior` checks every layer before it changes any):
#   torch    nn.MultiheadAttention: a forward pre-hook passes the bias as its attn_mask
#   hf       Hugging Face attention modules: the layer's config is swapped for a view of it that names an attention
#            function registered with transformers (HF_ATTENTION); it adds the bias, then calls the model's own
#            'sdpa' or 'eager'. Layers that share the config and have no prior keep theirs.
#   timm     timm's attention modules (ViT / DeiT family): a pre-hook passes the attn_mask keyword
#   keyword  any module you name (class or predicate) whose forward names an additive mask keyword

HF_ATTENTION = "maskprior_attention"        # the attn_implementation a prior's layer runs under (registered with HF)
# what a saved config.json names as its weights file (`transformers_weights`) and attention implementation: neither
# a file nor registered, so transformers' from_pretrained refuses the folder under any attn_implementation, with or
# without this module imported, naming the loader that keeps M ("...neither a safetensors file ...: <this>";
# from_config: `attn_implementation="<this>" is not supported`)
HF_SAVED = "maskprior: load it with maskprior_retrofit.from_pretrained"
# what an adapter saved with M names after its peft_type ("LORA, <this>"): a type PEFT does not know, so a plain load
# refuses it anywhere (KeyError: 'LORA, <this>'); a process that attached a prior knows it (`_guard_loaders`)
ADAPTER_SAVED = "with M: give the model its priors with maskprior_retrofit (add_mask_prior), then load it"
GRID = "the patch grid and any class/prefix tokens"


@dataclass
class Site:
    """One attention layer `add_mask_prior` can reach, and what its model says about it."""
    name: str
    module: nn.Module
    kind: str                          # "torch", "hf", "timm" or "keyword"
    heads: int
    cross: bool = False                # keys from another sequence
    causal: bool | None = None         # what the layer is, where it says so (HF); None: the caller says
    tokens: int | None = None          # exactly this many tokens (an image model's grid, a window), where known
    max_tokens: int | None = None      # at most this many positions (a text model's table), where known
    prefix: bool = False               # a shorter input is positions 0..t-1 (text models)
    layout: str = GRID                 # what `tokens` counts, for error messages


def _takes_keyword(module: nn.Module, keyword: str) -> bool:
    """Whether module.forward names `keyword` (a `**kwargs` catch-all is not trusted: it may pass it nowhere)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return keyword in params and params[keyword].kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                              inspect.Parameter.VAR_KEYWORD)


def _heads_of(module: nn.Module) -> int | None:
    for attr in ("num_heads", "num_attention_heads", "n_head", "n_heads", "nhead"):
        if isinstance(getattr(module, attr, None), int):
            return getattr(module, attr)
    return getattr(getattr(module, "config", None), "num_attention_heads", None)


def _hf_config(module: nn.Module):
    """A transformers module's config (the model's own, under a prior's view of it), or None."""
    cfg = getattr(module, "config", None)
    cfg = cfg.model_config if isinstance(cfg, _PriorConfig) else cfg
    return cfg if hasattr(cfg, "_attn_implementation") and hasattr(cfg, "to_dict") else None


def _is_hf_attention(module: nn.Module) -> bool:
    """A module of a transformers model that calls the attention-function interface (GPT-2, BERT, ViT, Llama, BART,
    T5, CLIP...): a config, is_causal, a logit scale (`scaling`, or CLIP's `scale`), from a file that imports it."""
    return (_hf_config(module) is not None and hasattr(module, "is_causal")
            and (hasattr(module, "scaling") or hasattr(module, "scale"))
            and hasattr(sys.modules.get(type(module).__module__), "ALL_ATTENTION_FUNCTIONS"))


def _window_tokens(module: nn.Module) -> int | None:
    """The tokens of the window a windowed attention (Swin) attends within: `window_size` on it or a child."""
    for m in (module, *module.children()):
        w = getattr(m, "window_size", None)
        if type(w) is int or isinstance(w, (tuple, list)) and w and all(isinstance(v, int) for v in w):
            return math.prod(_pair(w))
    return None


def _named_cross(name: str, module: nn.Module, parent: nn.Module | None) -> bool:
    leaf = name.rpartition(".")[2].lower()
    return (bool(getattr(module, "is_cross_attention", False))
            or "cross" in type(module).__name__.lower()
            or "cross" in leaf or leaf == "encoder_attn"                            # BART, Whisper
            or (parent is not None and "cross" in type(parent).__name__.lower())    # T5's EncDecAttention
            or (isinstance(parent, nn.TransformerDecoderLayer) and leaf == "multihead_attn"))


def _pair(v) -> tuple[int, int]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def _grid_of(model: nn.Module) -> tuple[int, int] | None:
    """The patch grid (grid_h, grid_w) of an image model (timm's patch_embed, an HF vision config), or None."""
    embed = getattr(model, "patch_embed", None)
    if embed is not None and getattr(embed, "grid_size", None) is not None:
        return _pair(embed.grid_size)
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "vision_config", cfg)
    if cfg is not None and getattr(cfg, "image_size", None) and getattr(cfg, "patch_size", None):
        return tuple(i // p for i, p in zip(_pair(cfg.image_size), _pair(cfg.patch_size)))
    return None


def _positions(model: nn.Module) -> tuple[int | None, int | None]:
    """(tokens, max_tokens) the model fixes: an image model's token count (timm's patch grid plus prefix tokens,
    CLIP-style num_positions, or a (1, N, D) position table), else a text model's most positions (its config)."""
    embed = getattr(model, "patch_embed", None)
    if embed is not None and isinstance(getattr(embed, "num_patches", None), int):
        return embed.num_patches + int(getattr(model, "num_prefix_tokens", 0)), None
    for m in model.modules():
        if isinstance(getattr(m, "num_patches", None), int) and isinstance(getattr(m, "num_positions", None), int):
            return m.num_positions, None
    for name, p in model.named_parameters():
        if name.endswith("position_embeddings") and p.dim() == 3:
            return p.shape[1], None
    cfg = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "n_positions"):
        if isinstance(getattr(cfg, attr, None), int):
            return None, getattr(cfg, attr)
    return None, None


def _tower_positions(named: dict, name: str, found: dict) -> tuple[int | None, int | None]:
    """(tokens, max_tokens) of the tower holding layer `name` (CLIP's text, vision): its nearest fixing them."""
    parts = name.split(".") if name else []
    for i in range(len(parts), -1, -1):
        above = ".".join(parts[:i])
        if above not in found:
            found[above] = _positions(named[above])
        if found[above] != (None, None):
            return found[above]
    return None, None


def find_attention(model: nn.Module, modules=None) -> list[Site]:
    """Every attention layer of `model` that `add_mask_prior` can reach: nn.MultiheadAttention, Hugging Face and
    timm attention modules; or, with `modules` (a class, a tuple of classes, or a predicate `(name, module) ->
    bool`), exactly the modules it names (served as what they are, else by their mask keyword)."""
    named, found = dict(model.named_modules()), {}
    picked = (modules if callable(modules) and not isinstance(modules, (type, tuple))
              else lambda name, m: isinstance(m, modules))
    sites = []
    for name, m in named.items():
        if modules is not None and not picked(name, m):
            continue
        tokens, max_tokens = _tower_positions(named, name, found)
        parent = named.get(name.rpartition(".")[0]) if name else None
        where = name or type(model).__name__
        if isinstance(m, nn.MultiheadAttention):
            sites.append(Site(where, m, "torch", m.num_heads, cross=_named_cross(name, m, parent)))
        elif _is_hf_attention(m):
            window = _window_tokens(m)
            seen = window or tokens
            sites.append(Site(where, m, "hf", _heads_of(m) or 0, cross=_named_cross(name, m, parent),
                              causal=bool(m.is_causal), tokens=seen, max_tokens=max_tokens, prefix=seen is None,
                              layout="its attention window" if window else GRID))
        elif (type(m).__module__.startswith("timm.") and isinstance(getattr(m, "num_heads", None), int)
              and _takes_keyword(m, "attn_mask")):
            sites.append(Site(where, m, "timm", m.num_heads, tokens=tokens))
        elif modules is not None:
            sites.append(Site(where, m, "keyword", _heads_of(m) or 0))
    return sites


def _fail(site: Site, what: str, who: str = "add_mask_prior") -> ValueError:
    done = "no layer was changed" if who == "add_mask_prior" else "nothing was loaded"
    return ValueError(f"{who}: {site.name} ({type(site.module).__name__}, {site.heads or '?'} heads) {what}; {done}")


def _unreachable(model: nn.Module, modules, mask_kwarg: str) -> ValueError:
    """One line for a model where add_mask_prior finds no layer: what it could not reach, and how to attach."""
    if modules is not None:
        return ValueError(f"add_mask_prior: {type(model).__name__} holds no module that `modules` names")
    hand = (f"give its forward an `{mask_kwarg}=None` keyword that is added to its logits (or "
            "passed to scaled_dot_product_attention) and name it with modules=")
    own = [(n, m) for n, m in model.named_modules() if "attention" in type(m).__name__.lower()
           and not any("attention" in type(c).__name__.lower() for c in m.children())]
    if own:
        name, m = own[0]
        more = f" and {len(own) - 1} more" if len(own) > 1 else ""
        return ValueError(f"add_mask_prior: {type(model).__name__} holds no attention layer it can reach: {name} "
                          f"({type(m).__name__}){more} computes its own softmax (it calls no transformers "
                          f"attention function and names no `{mask_kwarg}`); to attach by hand, "
                          f"{hand}{type(m).__name__}; no layer was changed")
    return ValueError(f"add_mask_prior: {type(model).__name__} holds no nn.MultiheadAttention, Hugging Face or "
                      f"timm attention; for an attention of your own, {hand}YourAttention")


def _check_site(model: nn.Module, s: Site, found: bool, mask_kwarg: str, who: str = "add_mask_prior") -> None:
    """Refuse, in one line, a layer the prior could not reach or change (`found`: by add_mask_prior's search)."""
    if s.kind == "keyword" and not _takes_keyword(s.module, mask_kwarg):
        raise _fail(s, f"names no `{mask_kwarg}` parameter in its forward (a **kwargs catch-all "
                       "is not trusted: a mask it passes nowhere would change nothing): add "
                       f"`{mask_kwarg}=None` and pass it to scaled_dot_product_attention", who)
    if s.cross and s.kind in ("timm", "keyword"):
        raise _fail(s, "is cross-attention, which only nn.MultiheadAttention and HF layers serve", who)
    if s.kind == "timm" and s.tokens is None and found:
        raise _fail(s, f"is in a timm model ({type(model).__name__}) without one patch grid "
                       "(patch_embed.num_patches): its pooled stages or branches see other token counts, which "
                       "one prior cannot serve; give a stage its own prior with modules=lambda name, m: "
                       "name.startswith('<stage>.') and name.endswith('.attn')", who)
    if s.kind == "hf":
        impl = _hf_config(s.module)._attn_implementation
        if impl == HF_ATTENTION and not hasattr(s.module, "mask_prior"):
            raise _fail(s, f"runs attn_implementation {HF_ATTENTION!r} without a prior (a model saved with priors "
                           "and loaded plainly): load it with mp.from_pretrained(ModelClass, path)", who)
        if impl not in ("sdpa", "eager"):
            raise _fail(s, f"runs attn_implementation {impl!r}, which cannot add a bias; load the "
                           "model with attn_implementation='sdpa' (or 'eager')", who)
        if impl == "eager" and not hasattr(sys.modules[type(s.module).__module__], "eager_attention_forward"):
            raise _fail(s, "runs 'eager', but its file defines no eager_attention_forward to wrap: use 'sdpa'", who)


def _prior_for(site: Site, src: torch.Tensor, pattern, m_on, m_off, causal, logits, param, prefix,
               who: str = "add_mask_prior", grid: tuple[int, int] | None = None) -> mp.MaskPrior:
    """The MaskPrior of one site, or one line saying why the pattern does not fit it (nothing changed yet)."""
    shape = tuple(src.shape)
    n, n_keys = shape[-2], shape[-1]
    heads = site.heads or (shape[0] if src.dim() == 3 else 1)
    is_causal = bool(site.causal) if causal is None else causal           # a layer that does not say: not causal
    for misfit, what in (  # in this order, the first that holds
            (hasattr(site.module, "mask_prior"), "already has a MaskPrior (add_mask_prior ran on this model before)"),
            (src.dim() == 3 and shape[0] != heads,
             f"does not fit a pattern of shape {shape}: give (N, N) or ({heads}, N, N)"),
            (site.causal is not None and is_causal != site.causal,
             f"is {'' if site.causal else 'not '}causal, but causal={causal} was asked"),
            (not site.cross and n != n_keys,
             f"is self-attention, but the pattern has shape {shape} (queries x keys must be square)"),
            (site.tokens is not None and not site.cross and n != site.tokens, f"sees {site.tokens} tokens, but the "
             f"pattern has shape {shape}: build it for {site.tokens} positions ({site.layout})"),
            (site.max_tokens is not None and n > site.max_tokens,
             f"has at most {site.max_tokens} positions, but the pattern has shape {shape}")):
        if misfit:
            raise _fail(site, what, who)
    try:
        prior = mp.MaskPrior(n, heads, pattern, m_on, m_off, is_causal, logits, param, n_keys=n_keys if site.cross
                             else None, prefix=site.prefix if prefix is None else prefix, grid=grid)
    except ValueError as e:
        raise _fail(site, str(e), who) from None
    prior.where = site.name
    return prior.to(next(site.module.parameters(), prior.bias).device)


FULL_SHARE = 0.1        # a full M (param=None) adding more than this share of a model's parameters is refused


def _check_size(model: nn.Module, priors: dict[str, mp.MaskPrior], src: torch.Tensor) -> None:
    """Refuse, in one line, full M's (asked for by default, not by param='full') that would add more than FULL_SHARE
    of the model's parameters: a full M grows as layers x heads x N^2 (151M for GPT-2 small at N = 1,024)."""
    full = [p for p in priors.values() if p.param == "full"]
    size, own = sum(p.bias.numel() for p in full), sum(p.numel() for p in model.parameters())
    if full and own and size > FULL_SHARE * own:          # (a module with no weights of its own: nothing to weigh)
        relative = not full[0].cross and mp.depends_on_distance(src)
        way = ("it depends on i - j alone: param='relative' holds it at heads x (2N - 1) a layer"
               if relative else "param='grid' holds an image's at one logit per head and patch offset; param='full' "
                                "takes it anyway" if _grid_of(model) else "param='full' takes it anyway")
        raise ValueError(f"add_mask_prior: a full M on {len(full)} layers would add {size:,} "
                         f"parameters to the model's {own:,} ({size / own:.0%}); {way} (or build "
                         "the prior for fewer positions); no layer was changed")


def _under_peft(model: nn.Module) -> bool:
    """Whether PEFT wrapped `model` or a model holding it (its peft_config, or PEFT's layers in its modules)."""
    return (getattr(model, "peft_config", None) is not None
            or any(type(m).__module__.partition(".")[0] == "peft" for m in model.modules()))


def add_mask_prior(model: nn.Module, pattern: torch.Tensor | None = None, m_on: float = mp.M_ON,
                   m_off: float = mp.M_OFF, causal: bool | None = None, logits: torch.Tensor | None = None, *,
                   param: str | None = None, prefix: bool | None = None, cross_attention: bool = False,
                   modules=None, mask_kwarg: str = "attn_mask", flex: bool = False,
                   grid: tuple[int, int] | None = None) -> dict[str, mp.MaskPrior]:
    """Give every attention layer of `model` its own learnable prior, started from `pattern` (bool (N, N) or
    (heads, N, N)) or `logits` (not both); returns {layer name: MaskPrior}, the layers that got one.

    Reaches nn.MultiheadAttention, Hugging Face attention modules (GPT-2, BERT, ViT, Llama, Mistral, BART, T5, Whisper,
    CLIP, Swin...: through transformers' attention-function interface, wrapping the model's 'sdpa' or 'eager'; the
    config records the priors for `from_pretrained`), timm's attention (ViT / DeiT), and, with `modules` (a class, tuple
    of classes or predicate `(name, module) -> bool`: exactly those modules, e.g. only an encoder's), any module whose
    forward names an additive mask keyword `mask_kwarg` (nanoGPT-style). Self-attention gets the prior; with
    `cross_attention=True` the cross-attention layers instead (nn.Transformer's decoder, BART's encoder_attn, T5's
    EncDecAttention), from an (N_query, N_key) pattern. `causal`: by default what the layer says it is (HF), else False.
    `prefix` (default: True for HF text models) lets a non-causal prior read shorter inputs as positions 0..t-1. Every
    layer is checked before any is changed: one the prior cannot serve raises ValueError naming it, its class, heads and
    what to do, and the model is left as it was. `param`: by default relative for a causal prior that depends on i - j
    alone (heads x N a layer, any length), else full, refused where the full M's would add more than 10% of the model's
    parameters (param='full' takes them, 'relative' gives a non-causal band); 'grid': an image's 2-D relative M, one
    logit per head and patch displacement plus each class token's row and column (0.7% of ViT-Tiny's parameters at
    224px, where a full M adds 25%), on `grid` (grid_h, grid_w), by default the model's own patch grid. `flex`: on CUDA
    a Hugging Face layer's prior runs inside torch's flex_attention (compiled on its first call) wherever the call is
    plain self-attention (`_prior_alone`; `layer.mask_prior_flex` changes it later). Make the optimiser after this call;
    M is named `bias`, so Hugging Face's Trainer, timm's create_optimizer_v2 and `param_groups` leave it undecayed. An
    nn.TransformerEncoder runs without its nested-tensor fast path while it holds a prior (its padded batches would skip
    the mask), with a warning where the path was on; `remove_mask_prior` turns it back on."""
    who = "add_mask_prior"
    pattern, logits = mp._source(who, pattern, logits)
    m_on, m_off = mp._real(who, "m_on", m_on), mp._real(who, "m_off", m_off)
    causal = None if causal is None else mp._flag(who, "causal", causal)
    prefix = None if prefix is None else mp._flag(who, "prefix", prefix)
    param = None if param is None else mp._choice(who, "param", param, ("full", "relative", "grid"))
    cross_attention, flex = mp._flag(who, "cross_attention", cross_attention), mp._flag(who, "flex", flex)
    grid = None if grid is None else mp._grid(who, grid)
    src = logits if logits is not None else pattern
    if not isinstance(src, torch.Tensor) or src.dim() not in (2, 3):
        raise ValueError("add_mask_prior needs a pattern or logits of shape (N, N) or (heads, N, N)")
    sites = _sites_for(model, cross_attention, modules, mask_kwarg)
    if param == "grid" and grid is None and (grid := _grid_of(model)) is None:        # by default the model's own
        raise ValueError(f"add_mask_prior: param='grid' is a 2-D relative M over an image's patch grid, and "
                         f"{type(model).__name__} names none (timm's patch_embed.grid_size, a Hugging Face config's "
                         "image_size and patch_size): give grid=(grid_h, grid_w); no layer was changed")
    priors = {s.name: _prior_for(s, src, pattern, m_on, m_off, causal, logits, param, prefix, grid=grid)
              for s in sites}
    if param is None:
        _check_size(model, priors, src)
    _after_attach(model, sites, priors, mask_kwarg, flex)
    return priors


def _sites_for(model: nn.Module, cross_attention: bool, modules, mask_kwarg: str) -> list[Site]:
    """The layers add_mask_prior gives a prior (self- or cross-attention, as asked), each checked
    (`_check_site`); one line for a TorchScript model, a model PEFT wrapped first, or one with no such layer."""
    if isinstance(model, torch.jit.ScriptModule):
        raise ValueError(f"add_mask_prior: {type(model).__name__} is a TorchScript model, whose "
                         "layers take no hooks and no new parameters: add the prior to the "
                         "nn.Module, then trace it (torch.jit.trace), compile it or export it")
    if _under_peft(model):
        raise ValueError(f"add_mask_prior: {type(model).__name__} is already wrapped by PEFT, whose adapter would not "
                         "save M: add the priors first, then get_peft_model with modules_to_save=['mask_prior'] in "
                         "its config (M then trains and is saved with the adapter); no layer was changed")
    sites = find_attention(model, modules)
    if not sites:
        raise _unreachable(model, modules, mask_kwarg)
    other = [s.name for s in sites if s.cross != cross_attention]
    sites = [s for s in sites if s.cross == cross_attention]
    if not sites:
        way = ("leave out cross_attention=True" if cross_attention else
               "pass cross_attention=True and an (N_query, N_key) pattern")
        raise ValueError(f"add_mask_prior: {type(model).__name__} holds only {'self' if cross_attention else 'cross'}"
                         f"-attention ({', '.join(other)}); {way} to give it a prior")
    for s in sites:
        _check_site(model, s, modules is None, mask_kwarg)
    return sites


def _check_roles_batch(prior: mp.MaskPrior, batch: int) -> None:
    """Refuse a batch of another size than the roles `mp.prior_roles` gave (one row of roles per example): a
    bias of one example broadcast over the batch would read every example by the first one's layout."""
    if prior.roles is not None and prior.roles[0].shape[0] != batch:
        raise ValueError(f"{prior.where}: prior_roles gave roles for {prior.roles[0].shape[0]} examples, but this "
                         f"call's batch holds {batch}: give rows and cols of shape (batch, L), one row per example")


# torch: nn.MultiheadAttention

def _mha_prior_hook(mha: nn.MultiheadAttention, args: tuple, kwargs: dict):
    """Forward pre-hook of a retrofitted nn.MultiheadAttention: its MaskPrior's bias becomes the attn_mask (added to
    one the caller gave; a causal call's -inf folded in, since MHA drops a mask it takes for the causal one)."""
    names = "query key value key_padding_mask need_weights attn_mask average_attn_weights is_causal".split()
    kwargs = {**dict(zip(names, args)), **kwargs}
    query, key, prior = kwargs["query"], kwargs["key"], mha.mask_prior
    batched = query.dim() == 3
    seq = int(batched and mha.batch_first)                               # the dimension of the positions
    t, s = query.shape[seq], key.shape[seq]
    if not prior.cross and key is not query:
        raise ValueError(f"{prior.where}: a self-attention prior, but this call's keys are not its queries ({t} "
                         f"queries, {s} keys): give cross-attention its own prior with add_mask_prior(..., "
                         "cross_attention=True) and an (N_query, N_key) pattern")
    bias = prior(t, query.dtype, k_len=s)
    batch = query.shape[1 - seq] if batched else 1
    _check_roles_batch(prior, batch)
    if bias.dim() == 4:                             # per example (prior_roles): (B, heads) batch-major for MHA
        bias = bias.flatten(0, 1) if batched else bias[0]
    elif batched:
        bias = bias.repeat(batch, 1, 1)
    given = kwargs.get("attn_mask")
    given = ~given if given is not None and given.dtype == torch.bool else given    # True = not allowed, for MHA
    bias = _with_callers_mask(bias, given, bool(kwargs.pop("is_causal", False)), t)   # MHA would drop the mask
    padding = kwargs.get("key_padding_mask")
    if padding is not None and padding.dtype == torch.bool:  # one mask type for both, as MHA wants
        kwargs["key_padding_mask"] = torch.zeros(padding.shape, dtype=bias.dtype, device=bias.device).masked_fill(
            padding, float("-inf"))
    if prior.record is not None:
        kwargs["need_weights"], kwargs["average_attn_weights"] = True, False
    kwargs["attn_mask"] = bias
    return (), kwargs


def _mha_record_hook(mha: nn.MultiheadAttention, args, kwargs, output):
    if mha.mask_prior.record is not None:
        mha.mask_prior.record.append(output[1])


# timm and keyword: a module whose forward names an additive mask keyword

def _amp_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in for input x: autocast's where it is on for x's device, else x's own."""
    try:
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
    except (TypeError, AttributeError):             # torch < 2.4: device-type autocast queries missing
        pass
    return x.dtype


def _keyword_hook(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: the prior's (heads, T, T) bias goes into the module's mask keyword, a mask the caller gave
    and an is_causal call's future folded in (`_with_callers_mask`: SDPA takes a mask or is_causal, not both)."""
    prior, key = module.mask_prior, module.mask_prior_kwarg
    if prior.record is not None and getattr(module, "fused_attn", False):
        module.mask_prior_fused, module.fused_attn = True, False   # timm's explicit path: attn_drop sees p
    x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, (torch.Tensor, torch.fx.Proxy)))
    symbolic = isinstance(x, torch.fx.Proxy)             # traced by fx: a fixed grid's length, x's own dtype
    t = prior.n if symbolic else x.shape[-2]
    if prior.roles is not None:                          # (B, heads, T, T) per example: B must be x's batch
        _check_roles_batch(prior, x.shape[0] if x.dim() >= 3 else 1)
    bias = _served(module, prior, t).to(x.dtype if symbolic else _amp_dtype(x))
    given, causal = kwargs.get(key), kwargs.get("is_causal", False)
    if "is_causal" in kwargs:
        kwargs["is_causal"] = False
    # traced: the caller's mask is known only when the graph runs
    kwargs[key] = (x.tracer.create_proxy("call_function", _with_callers_mask, (bias, given, causal, t), {})
                   if symbolic else _with_callers_mask(bias, given, causal, t))
    return args, kwargs


def _with_callers_mask(bias: torch.Tensor, given: torch.Tensor | None, causal: bool, t: int) -> torch.Tensor:
    """The prior's bias plus a mask the caller gave (bool: True = take part, else additive) and is_causal's -inf."""
    if given is not None:
        bias = torch.where(given, bias, float("-inf")) if given.dtype == torch.bool else bias + given
    return bias.masked_fill(mp.future_keys(t, bias.device), float("-inf")) if causal else bias


def _timm_record_hook(drop: nn.Module, args: tuple, output):
    prior = drop.mask_prior_owner.mask_prior
    if prior.record is not None:
        prior.record.append(args[0])


def _grid_hook(conv: nn.Module, args: Tuple[torch.Tensor], output: torch.Tensor) -> None:
    """Forward hook of an image model's patch projection: the patch grid of this image, for `_served` (typed, and a
    no-op under TorchScript, which compiles a module's hooks with it: an fx-traced ViT scripts)."""
    if not torch.jit.is_scripting():
        conv.mask_prior_grid = tuple(output.shape[-2:])


def _served(module: nn.Module, prior: mp.MaskPrior, t: int, **kwargs) -> torch.Tensor:
    """The prior's bias for t tokens: where they are an image of another size than its own (a timm ViT's
    dynamic_img_size, a Hugging Face ViT's interpolate_pos_encoding), at that image's patch grid (`_grid_bias`)."""
    grid = getattr(module.__dict__.get("mask_prior_embed"), "mask_prior_grid", None)
    if grid and t != prior.n and prior.roles is None:
        return _grid_bias(prior, grid, t)
    return prior(t, **kwargs)


def _grid_bias(prior: mp.MaskPrior, grid: tuple[int, int], t: int) -> torch.Tensor:
    """(heads, t, t) bias of a grid prior on another patch grid (h, w): each pair of patches reads the logit of its
    displacement (one past the prior's grid its last, as a relative prior's far distances do), a class token's row
    and column the nearest patch's. Another prior refuses such an image in one line that says what serves it."""
    (gh, gw), (h, w) = prior.grid or (0, 0), grid
    first = prior.n - gh * gw
    if prior.param != "grid" or first + h * w != t:
        raise ValueError(f"{prior.where}: this image gives {t} tokens ({h} x {w} patches), but the prior serves "
                         f"{prior.n} ({GRID}): param='grid' serves an image of any size by patch displacement, e.g. "
                         "add_mask_prior(model, pattern, param='grid')")
    prior.check_set()
    rc = torch.cartesian_prod(torch.arange(h), torch.arange(w))
    near = ((rc + 0.5) * torch.tensor([gh / h, gw / w])).long()
    near = torch.cat([torch.arange(first), first + near[:, 0] * gw + near[:, 1]])
    idx, lim = mp.grid_index(gh, gw, first)[near[:, None], near], torch.tensor([gh - 1, gw - 1])
    d = (rc[None] - rc[:, None]).clamp(-lim, lim) + lim
    idx[first:, first:] = d[..., 0] * (2 * gw - 1) + d[..., 1]
    return mp.mask_bias(prior._logits(prior.bias))[:, idx.to(prior.bias.device)]


def _timm_restore_hook(module: nn.Module, args: tuple, output):
    """Forward hook: a timm layer that recorded its probabilities goes back to its fused path."""
    if module.__dict__.pop("mask_prior_fused", False):
        module.fused_attn = True


class _NoWeightDecay:
    """A model's no_weight_decay() (timm's convention) with the priors' M added; a plain picklable callable."""
    def __init__(self, names: set[str]):
        self.names = frozenset(names)

    def __call__(self) -> set[str]:
        return set(self.names)


class _InitPriors:
    """A transformers model's `_init_weights` (which init_weights() calls on each module it initialises) that re-sets a
    MaskPrior's M where it started, other modules left to the model's own; a plain picklable callable."""
    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, module: nn.Module) -> None:
        if isinstance(module, mp.MaskPrior):
            if not getattr(module.bias, "_is_hf_initialized", False):     # transformers' mark of a loaded weight
                module.reset_parameters()
        else:
            type(self.model)._init_weights(self.model, module)


# Hugging Face: an attention function registered with transformers, reached through a view of the layer's config

class _PriorConfig:
    """An HF layer's `config` while it holds a prior: its model's config (`model_config`), read through, but naming
    HF_ATTENTION, so this layer alone runs `hf_attention` (others sharing the config keep theirs)."""
    _attn_implementation = HF_ATTENTION

    def __init__(self, model_config):
        self.model_config = model_config

    def __getattr__(self, name: str):
        config = self.__dict__.get("model_config")
        if config is None or name.startswith("__"):     # while being copied or unpickled: no read-through
            raise AttributeError(name)
        return getattr(config, name)


def _register_hf() -> None:
    """Register HF_ATTENTION with transformers' attention and attention-mask interfaces and wrap its save_pretrained
    (`_save_pretrained_with_priors`): once, at the first prior given to a transformers model."""
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(HF_ATTENTION, hf_attention)
    AttentionMaskInterface.register(HF_ATTENTION, sdpa_mask)
    if not getattr(PreTrainedModel.save_pretrained, "mask_prior_records", False):
        PreTrainedModel.save_pretrained = _save_pretrained_with_priors(PreTrainedModel.save_pretrained)


def _at_positions(prior: mp.MaskPrior, rows: torch.Tensor, dist: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """(B, heads, q, k) bias at the queries' rows (B or 1, q) and distances `dist` (B or 1, q, k) = query position -
    key position: a relative M reads the distance, a full one (or one read by role) `_full_at` row and row - dist."""
    if prior.param == "relative" and prior.roles is None:
        return prior.at_distance(dist).movedim(0, 1)
    return _full_at(prior, rows, rows[..., None] - dist, seen)


def _full_at(prior: mp.MaskPrior, rows: torch.Tensor, cols: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """(B, heads, q, k) bias of a full M (or one read by role) at rows (B or 1, q) and cols (B or 1, q, k), with
    `seen` (B or 1, q, k) the kept pairs, which must fit M (checked unless compiling or tracing; clamped)."""
    n = prior.n if prior.roles is None else min(prior.n, prior.roles[0].shape[1])
    full = prior(n, torch.float32)                                  # (heads, n, n), or (B, heads, n, n) by role
    full = full if full.dim() == 4 else full.unsqueeze(0)
    if not mp.tracing():
        rows_seen = torch.where(seen.any(-1), rows, -1)
        if bool((rows_seen >= n).any()):
            fit = f"the mask size {prior.n}" if n == prior.n else f"the {n} positions prior_roles gave roles for"
            raise ValueError(f"{prior.where}: a query at position {int(rows_seen.max())} does not fit {fit}: a "
                             f"{'causal ' if prior.causal else ''}full prior serves positions 0 .. {n - 1} (a "
                             "relative one serves any)")
        if bool(((cols < 0) & seen).any()):
            raise ValueError(f"{prior.where}: a query sees more keys than there are positions up to its own, so "
                             "its position ids do not count the keys it sees (packed sequences: pass their "
                             "position_ids without an attention_mask, as DataCollatorWithFlattening does, and the "
                             "model keeps each sequence to itself)")
    b = max(full.shape[0], rows.shape[0], cols.shape[0])
    flat = rows[..., None].clamp(0, n - 1) * n + cols.clamp(0, n - 1)                     # (B or 1, q, k)
    q, k = flat.shape[-2:]
    index = flat.expand(b, q, k).reshape(b, 1, q * k).expand(b, full.shape[1], q * k)
    return full.flatten(-2).expand(b, -1, -1).gather(-1, index).view(b, -1, q, k)


def _causal_bias(prior: mp.MaskPrior, allowed: torch.Tensor | None, positions: torch.Tensor | None, q_len: int,
                 k_len: int) -> torch.Tensor:
    """(1 or B, heads, q_len, k_len) float32 bias of a causal prior in a Hugging Face call.

    allowed: (B or 1, q_len, k_len) bool, what the model's mask lets each query see (padding, the causal future, a
    sliding window, a static cache's empty slots); None where the model left the mask out (no padding: SDPA's is_causal,
    upper-left for several queries, every key for one), whose future the bias then holds as -inf.
    positions: the queries' position ids (B or 1, q_len), or None.

    A key's distance from a query is the number of keys the query sees after it: padding and holes are skipped as the
    model's own positions skip them (generate's position_ids are attention_mask.cumsum(-1) - 1), the keys of a KV cache
    count as the same keys without one, and packed sequences within their own block; so cache = no cache and padded =
    unpadded hold by construction, with no state and no value read back. A relative M reads the distance; a full M the
    row of the query's position (its position id, else the keys it sees, less one) and the column of that row less the
    distance. A key the query does not see gets a finite value, which the model's mask removes."""
    if allowed is None and prior.param == "relative" and prior.roles is None:
        return prior(q_len, torch.float32, k_len=k_len, start=0 if q_len > 1 else None).unsqueeze(0)
    left_out = allowed is None
    if left_out:
        own = torch.arange(q_len, device=prior.bias.device) + (k_len - 1 if q_len == 1 else 0)
        allowed = (torch.arange(k_len, device=own.device) <= own[:, None])[None]
    after = allowed.flip(-1).cumsum(-1).flip(-1)                  # (B, q, k): the keys seen at or after each key
    dist = (after - 1).clamp(min=0)
    bias = _at_positions(prior, after[..., 0] - 1 if positions is None else positions.to(dist.device), dist, allowed)
    return bias.masked_fill(~allowed[:, None], float("-inf")) if left_out else bias


def _query_positions(kwargs: dict, q_len: int) -> torch.Tensor | None:
    """The queries' position ids the model passed (B or 1, q_len), or None (none, or another layout: M-RoPE's)."""
    positions = kwargs.get("position_ids")
    ok = isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[-1] == q_len
    return positions if ok else None


def _hf_bias(module: nn.Module, prior: mp.MaskPrior, query: torch.Tensor, key: torch.Tensor,
             mask: torch.Tensor | None, kwargs: dict) -> torch.Tensor:
    """(1 or B, heads, q_len, k_len) bias of one call: the prior at the call's positions, HF's mask folded in."""
    q_len, k_len = query.shape[-2], key.shape[-2]
    if not mp.tracing():
        _check_roles_batch(prior, query.shape[0])
    allowed = (None if mask is None else mask[..., :k_len] if mask.dtype == torch.bool
               else mask[..., :k_len] > torch.finfo(mask.dtype).min / 2)
    positions = _query_positions(kwargs, q_len)
    if prior.cross:
        start = getattr(module, "mask_prior_start", 0)          # rows from the decoder's position (its KV cache)
        bias = prior(start + q_len, query.dtype, k_len=k_len)[:, start:].unsqueeze(0)
    elif prior.causal:
        bias = _causal_bias(prior, None if allowed is None else allowed[:, 0], positions, q_len, k_len)
    elif positions is not None and q_len == k_len:             # the keys are the queries, at their position ids
        seen = torch.ones(1, q_len, k_len, dtype=torch.bool, device=query.device) if allowed is None else allowed[:, 0]
        bias = _at_positions(prior, positions, positions[:, :, None] - positions[:, None, :], seen)
    else:
        bias = _served(module, prior, q_len, dtype=query.dtype, k_len=k_len)
        bias = bias if bias.dim() == 4 else bias.unsqueeze(0)           # (B, ...) per example under prior_roles
    if kwargs.get("is_causal") and not prior.causal and mask is None and q_len > 1:          # CLIP's text tower
        bias = bias.masked_fill(mp.future_keys(q_len, bias.device), float("-inf"))
    bias = bias.to(query.dtype)
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return torch.where(mask[..., :k_len], bias, torch.finfo(bias.dtype).min)
    return bias + mask[..., :k_len]


def hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, **kwargs):
    """transformers attention function (query (B, H, q, D), key/value (B, H_kv, k, D)): adds the module's prior to
    the logits and runs the model's own implementation (`sdpa` or its `eager`)."""
    prior = getattr(module, "mask_prior", None)
    if prior is None:
        raise RuntimeError(f"{type(module).__name__} runs attn_implementation {HF_ATTENTION!r} but holds no MaskPrior: "
                           "a model saved with mask priors loads with mp.from_pretrained(ModelClass, path)")
    if not mp.tracing():
        module.mask_prior_pending = False
    if (prior.record is None and not torch.jit.is_tracing()
            and _prior_alone(module, prior, query, key, attention_mask, kwargs)
            and (query.device.type == "cpu" or getattr(module, "mask_prior_flex", False))):
        k, v = (x.repeat_interleave(query.shape[1] // x.shape[1], dim=1) for x in (key, value))   # grouped keys
        out = mp.prior_attention(query, k, v, prior, use_flex=query.device.type != "cpu")
        return out.transpose(1, 2).contiguous(), None
    bias = _hf_bias(module, prior, query, key, attention_mask, kwargs)
    if prior.record is not None:
        k = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
        prior.record.append(((query @ k.transpose(-2, -1)).float() * scale + bias.float()).softmax(-1))
    return _hf_base(module)(module, query, key, value, bias, **kwargs)


def _prior_alone(module: nn.Module, prior: mp.MaskPrior, query: torch.Tensor, key: torch.Tensor, mask,
                 kwargs) -> bool:
    """Whether an HF call is plain SDPA with the prior's bias alone (self-attention, no cache or padding mask, no
    dropout, soft-capping, sliding window or sinks, the usual scale; a full M's rows not given by position ids; an
    image of the prior's size), which maskprior's kernels serve: `prior_attention` on the CPU, flex_attention on CUDA
    where asked."""
    return (mask is None and prior.roles is None and not prior.cross
            and _hf_config(module)._attn_implementation == "sdpa" and query.shape[-2] == key.shape[-2]
            and (prior.causal or not kwargs.get("is_causal"))
            and (prior.param == "relative" or _query_positions(kwargs, query.shape[-2]) is None)
            and (query.shape[-2] == prior.n or "mask_prior_embed" not in module.__dict__)
            and not float(kwargs.get("dropout") or 0.0) and kwargs.get("scaling") in (None, query.shape[-1] ** -0.5)
            and all(kwargs.get(name) is None for name in ("softcap", "sliding_window", "s_aux", "sinks")))


def _hf_base(module: nn.Module):
    """The model's own attention function that a layer's prior wraps, read at every call (so set_attn_implementation
    between 'sdpa' and 'eager' is followed); one line for an implementation that cannot add a bias."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    impl = _hf_config(module)._attn_implementation
    if impl == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    if impl == "sdpa":
        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    raise RuntimeError(f"{module.mask_prior.where}: attn_implementation is now {impl!r}, which cannot add the "
                       "prior's bias; use model.set_attn_implementation('sdpa') (or 'eager')")


def _hf_guard(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Pre-hook of an HF layer with a prior: refuse a call it cannot serve (no bias; the other kind of keys than its
    prior's); note a cross-attention call's first query row (from the KV cache)."""
    _hf_base(module)
    call = {**dict(zip(module.mask_prior_args, args)), **kwargs}
    prior = module.mask_prior
    crossed = any(call.get(k) is not None for k in ("key_value_states", "encoder_hidden_states"))
    if crossed != prior.cross:
        what = ("a self-attention prior, but this call's keys come from another sequence" if crossed else
                "a cross-attention prior, but this call attends to its own sequence")
        raise ValueError(f"{prior.where}: {what}: give cross-attention its own prior with add_mask_prior(..., "
                         "cross_attention=True) and an (N_query, N_key) pattern")
    module.mask_prior_start = 0
    cache = next((call[k] for k in ("cache", "past_key_values", "past_key_value") if call.get(k) is not None), None)
    hidden = call.get("hidden_states", args[0] if args else None)
    if prior.cross and hasattr(cache, "get_seq_length") and isinstance(hidden, torch.Tensor):
        module.mask_prior_start = int(cache.get_seq_length(getattr(module, "layer_idx", None) or 0)) - hidden.shape[-2]
    module.mask_prior_pending = not mp.tracing()


def _hf_reached(module: nn.Module, args: tuple, output) -> None:
    """Forward hook: a layer that ran without calling the attention function would leave its prior unused; refuse."""
    if getattr(module, "mask_prior_pending", False):
        module.mask_prior_pending = False
        raise RuntimeError(f"{module.mask_prior.where}: the layer ran without calling transformers' attention "
                           "function, so its prior changed nothing; give it an attn_mask keyword and attach it with "
                           "modules=")


def prior_record(model: nn.Module) -> dict | None:
    """What a save of `model` writes into config.json for its Hugging Face layers that hold a prior:
    {'layers': {name in `model`: {n, n_keys, heads, causal, param, prefix, grid}}, 'base': the dispatch the priors
    wrapped, 'sdpa' or 'eager' (a reload takes transformers' default, or the attn_implementation asked)}, or None
    where none does. Read from the model itself at each save (a part given priors and the whole saved included):
    the record is the model's state, never written into its config, which other models built from it share."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m.__dict__.get("config"), _PriorConfig)}
    if not layers:
        return None
    geometry = {name: {"n": p.n, "n_keys": p.n_keys if p.cross else None, "heads": p.heads, "causal": p.causal,
                       "param": p.param, "prefix": p.prefix, "grid": p.grid and list(p.grid)}
                for name, p in ((name, m.mask_prior) for name, m in layers.items())}
    return {"layers": geometry, "base": _hf_config(next(iter(layers.values())))._attn_implementation}


class _SavedWithPriors:
    """Mixed into a save's config copy: config.json also names HF_SAVED as its `transformers_weights`."""
    def to_dict(self) -> dict:
        return {**super().to_dict(), "transformers_weights": HF_SAVED}


@functools.cache
def _saved_with_priors(config_class: type) -> type:
    return type(config_class.__name__, (_SavedWithPriors, config_class), {"__module__": config_class.__module__})


def _save_pretrained_with_priors(save: Callable) -> Callable:
    """transformers' save_pretrained, writing the saved model's `prior_record` into config.json through a copy of its
    config for the save alone (the shared one never holds it), naming HF_SAVED: a plain from_pretrained fails loudly."""
    @functools.wraps(save)
    def save_pretrained(self, save_directory, *args, **kwargs):
        record = prior_record(self)
        if record is None:
            return save(self, save_directory, *args, **kwargs)
        shared = self.config
        self.config = copy.copy(shared)
        self.config.__class__ = _saved_with_priors(type(shared))
        self.config.mask_prior, self.config.attn_implementation = record, HF_SAVED
        try:
            return save(self, save_directory, *args, **kwargs)
        finally:
            written, self.config = self.config, shared
            for name in ("architectures", "dtype"):            # what save_pretrained itself sets on the config
                if name in written.__dict__:
                    setattr(shared, name, written.__dict__[name])
    save_pretrained.mask_prior_records = True
    return save_pretrained


def _frozen_prior_guard(model: nn.Module, args: tuple) -> None:
    """Pre-hook on the model add_mask_prior was given (the whole or a part): a forward that records gradients after PEFT
    froze M (get_peft_model freezes every parameter outside its adapter, which would not save M) is refused in one line,
    in train or eval mode (a hand-written loop may never call .train()). Inference (no_grad) runs."""
    if not torch.is_grad_enabled():
        return
    frozen = next((p for m in model.modules()
                   if isinstance(p := m._modules.get("mask_prior"), mp.MaskPrior) and not p.bias.requires_grad), None)
    if frozen is not None and _under_peft(model):
        raise RuntimeError(f"{frozen.where}: M is frozen: PEFT's get_peft_model froze it (and its "
                           "adapter would not save it); pass modules_to_save=['mask_prior'] to "
                           "the PEFT config, so that M trains and is saved with the adapter")


def _attach(site: Site, prior: mp.MaskPrior, mask_kwarg: str, flex: bool) -> None:
    """Give one checked layer its prior and the hooks of its kind (torch, Hugging Face and its config view, keyword)."""
    m = site.module
    m.mask_prior, m.mask_prior_flex = prior, flex
    if site.kind == "torch":
        m.mask_prior_hooks = [m.register_forward_pre_hook(_mha_prior_hook, with_kwargs=True),
                              m.register_forward_hook(_mha_record_hook, with_kwargs=True)]
    elif site.kind == "hf":
        m.config = _PriorConfig(m.config)
        m.mask_prior_args = list(inspect.signature(m.forward).parameters)
        m.mask_prior_hooks = [m.register_forward_pre_hook(_hf_guard, with_kwargs=True),
                              m.register_forward_hook(_hf_reached)]
    else:
        m.mask_prior_kwarg = mask_kwarg
        m.mask_prior_hooks = [m.register_forward_pre_hook(_keyword_hook, with_kwargs=True)]
        drop = getattr(m, "attn_drop", None)
        if site.kind == "timm" and isinstance(drop, nn.Module) and hasattr(m, "fused_attn"):
            object.__setattr__(drop, "mask_prior_owner", m)      # a plain reference, not a submodule (no cycle)
            m.mask_prior_hooks += [drop.register_forward_hook(_timm_record_hook),
                                   m.register_forward_hook(_timm_restore_hook)]


def _after_attach(model: nn.Module, sites: list[Site], priors: dict[str, mp.MaskPrior], mask_kwarg: str = "attn_mask",
                  flex: bool = False) -> None:
    """Attach the checked priors (`_attach`), then what a model with priors needs (watchers, HF, timm, PEFT guard)."""
    for s in sites:                                   # every layer fits: now change them
        _attach(s, priors[s.name], mask_kwarg, flex)
        _LAYERS[priors[s.name]] = [weakref.ref(p) for p in s.module.parameters() if p is not priors[s.name].bias]
    _watch()
    if any(s.kind == "torch" for s in sites):
        for name, m in model.named_modules():
            if isinstance(m, nn.TransformerEncoder):
                m.__dict__.setdefault("mask_prior_nested", m.use_nested_tensor)
                if m.use_nested_tensor:                   # said once, where the fast path was on
                    warnings.warn(f"add_mask_prior: TransformerEncoder{f' {name}' if name else ''} now runs "
                                  "without its nested-tensor fast path, whose padded batches would skip the "
                                  "prior's attn_mask; remove_mask_prior turns it back on", stacklevel=3)
                m.use_nested_tensor = False
    if any(s.kind == "hf" for s in sites):
        _register_hf()
        for m in model.modules():            # each transformers model in it: its init_weights re-sets M
            if _hf_config(m) is not None and callable(getattr(type(m), "_init_weights", None)):
                m.__dict__.setdefault("_init_weights", _InitPriors(m))
    images = [s.module for s in sites if s.tokens is not None and s.layout == GRID and not s.cross]
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d) and m.stride == m.kernel_size != (1, 1)), None)
    if images and conv is not None:                   # the patch projection: each image's grid (`_served`)
        for m in images:
            object.__setattr__(m, "mask_prior_embed", conv)
        images[0].mask_prior_hooks.append(conv.register_forward_hook(_grid_hook))       # removed with its layer's
    base = getattr(model, "no_weight_decay", None)      # what timm's optimiser factory leaves undecayed: add every M
    if callable(base):
        model.no_weight_decay = _NoWeightDecay(set(base()) | set(mp.prior_parameter_names(model)))
    if "mask_prior_guard" not in model.__dict__:
        model.mask_prior_guard = model.register_forward_pre_hook(_frozen_prior_guard)


def remove_mask_prior(model: nn.Module) -> list[str]:
    """Take out every prior that add_mask_prior (or from_pretrained) gave `model`: the MaskPriors, hooks and layer
    config views, the names added to timm's no_weight_decay. The model is the plain one again (the same outputs,
    state_dict keys and config). Returns the names of the layers that had one."""
    layers = [(n, m) for n, m in model.named_modules() if "mask_prior_hooks" in m.__dict__]
    if not layers:
        raise ValueError(f"remove_mask_prior: {type(model).__name__} holds no prior from add_mask_prior")
    for _, m in layers:
        for hook in m.mask_prior_hooks:
            hook.remove()
        if isinstance(m.__dict__.get("config"), _PriorConfig):
            m.config = m.config.model_config
        if isinstance(drop := getattr(m, "attn_drop", None), nn.Module):
            drop.__dict__.pop("mask_prior_owner", None)
        for attr in ("mask_prior_hooks", "mask_prior_kwarg", "mask_prior_args", "mask_prior_start",
                     "mask_prior_pending", "mask_prior_flex", "mask_prior_fused", "mask_prior_embed"):
            m.__dict__.pop(attr, None)
        del m.mask_prior
    for m in model.modules():                   # add_mask_prior was given the model, or parts of it
        if "mask_prior_nested" in m.__dict__:
            m.use_nested_tensor = m.__dict__.pop("mask_prior_nested")
        if isinstance(m.__dict__.get("no_weight_decay"), _NoWeightDecay):
            del m.__dict__["no_weight_decay"]
        if isinstance(m.__dict__.get("_init_weights"), _InitPriors):
            del m.__dict__["_init_weights"]
        if "mask_prior_guard" in m.__dict__:
            m.__dict__.pop("mask_prior_guard").remove()
        m.__dict__.pop("mask_prior_grid", None)
    return [n or type(model).__name__ for n, _ in layers]


# Saved and loaded: Hugging Face's save_pretrained / from_pretrained

_RECORD_FIELDS = {                     # field of a layer's record: (check, what is expected)
    "heads": (lambda v: type(v) is int and v > 0, "a positive int"),
    "n": (lambda v: type(v) is int and v > 0, "a positive int"),
    "n_keys": (lambda v: v is None or (type(v) is int and v > 0), "null or a positive int"),
    "causal": (lambda v: type(v) is bool, "true or false"),
    "param": (lambda v: v in ("full", "relative", "grid"), "'full', 'relative' or 'grid'"),
    "prefix": (lambda v: type(v) is bool, "true or false"),
    "grid": (lambda v: v is None or (type(v) is list and len(v) == 2 and all(type(i) is int and i > 0 for i in v)),
             "null or [grid_h, grid_w]"),
}


def _check_record(record, path: str) -> None:
    """One ValueError naming the layer and field of a malformed `mask_prior` record (before any model is built)."""
    where = f"from_pretrained: {path}'s config.json"
    if not isinstance(record, dict):
        raise ValueError(f"{where} holds a mask_prior record that is a {type(record).__name__}, "
                         "not {'layers': {name: {...}}, 'base': 'sdpa'}; nothing was loaded")
    if record.get("base") not in ("sdpa", "eager"):
        has = f"base {record['base']!r}" if "base" in record else "no base"
        raise ValueError(f"{where}: the mask_prior record has {has}: expected 'sdpa' or 'eager' "
                         "(the implementation the priors wrap); nothing was loaded")
    layers = record.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"{where}: the mask_prior record's layers are {layers!r}: expected a non-empty "
                         "{layer name: {n, heads, ...}}, one entry per prior; nothing was loaded")
    for name, geo in layers.items():
        if not isinstance(geo, dict):
            raise ValueError(f"{where}: the mask_prior record of layer {name} is {geo!r}, not a dict; "
                             "nothing was loaded")
        for field, (ok, want) in _RECORD_FIELDS.items():
            # a 2-D relative M's patch grid: records saved before it have none
            if not ok(geo.get(field)) or (field not in geo and field != "grid"):
                has = f"{field} {geo[field]!r}" if field in geo else f"no {field}"
                raise ValueError(f"{where}: the mask_prior record of layer {name} has {has}: expected {want}; "
                                 "nothing was loaded")


def _unmarked(config, kwargs: dict) -> dict:
    """`kwargs` for transformers' from_pretrained naming the default weights file again, not HF_SAVED: a keyword where
    it reads config.json, else a copy of the config given (the caller's keeps its mark)."""
    given = kwargs.get("config")
    if getattr(given, "transformers_weights", None) == HF_SAVED:
        given = copy.deepcopy(given)
        del given.__dict__["transformers_weights"]
        return {**kwargs, "config": given}
    if given is None and getattr(config, "transformers_weights", None) == HF_SAVED:
        return {"transformers_weights": None, **kwargs}
    return kwargs


def from_pretrained(model_class, path: str, **kwargs) -> nn.Module:
    """Load a Hugging Face model saved with `save_pretrained` after `add_mask_prior`, priors included.

    The priors its config.json records are checked, then attached while the model is built, so transformers' own
    loader reads every M from the checkpoint (sharded or not, keys renamed or not). An M the checkpoint lacks, holds
    in another shape (also with ignore_mismatched_sizes=True), holds without a record, or holds non-finite, is an
    error, never a prior left at 0 or uninitialised. `model_class` is a model class (GPT2LMHeadModel, ...) or an
    Auto class (AutoModelForCausalLM); `kwargs` go to its from_pretrained (`output_loading_info=True`: returns
    (model, info) as it does). A path whose config records no prior is refused. The record is read, not kept: the
    loaded model's config holds none (its priors are its own, recorded again at its next save)."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path)
    record = getattr(config, "mask_prior", None)
    if not record:
        raise ValueError(f"from_pretrained: {path} records no mask prior in its config.json; load "
                         f"it with {getattr(model_class, '__name__', model_class)}.from_pretrained")
    _check_record(record, path)
    if not (isinstance(model_class, type) and issubclass(model_class, nn.Module)):
        try:                                           # an Auto class (AutoModelForCausalLM...): its model for config
            model_class = model_class._model_mapping[type(config)]
        except (AttributeError, KeyError, TypeError):
            raise ValueError(f"from_pretrained: {getattr(model_class, '__name__', model_class)} is neither a model "
                             f"class nor an Auto class with a model for {type(config).__name__}") from None
    _register_hf()

    class WithPriors(model_class):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            _reattach(self, record)

    for attr in ("__name__", "__qualname__", "__module__"):          # transformers finds key renamings by these
        setattr(WithPriors, attr, getattr(model_class, attr))
    with_info = kwargs.pop("output_loading_info", False)
    # the dispatch transformers' own reload gives (its default), or the caller's attn_implementation: never pinned to
    # the one that ran when it was saved (`record["base"]`), which transformers does not keep either
    model, info = WithPriors.from_pretrained(path, **_unmarked(config, {"attn_implementation": None, **kwargs}),
                                             output_loading_info=True)
    model.__class__ = model_class                                     # the plain class again: save_pretrained names it
    for name in ("mask_prior", "transformers_weights"):
        model.config.__dict__.pop(name, None)
    for key, what in (("missing_keys", "holds no {} ({} in all): it was not saved from the model with its priors"),
                      ("mismatched_keys", "holds {} ({} in all) in another shape than its config records (M is "
                                          "never re-initialised, ignore_mismatched_sizes or not)"),
                      ("unexpected_keys", "holds {} ({} in all) on a layer its config records no prior for")):
        ours = sorted(k for k in (x[0] if isinstance(x, (tuple, list)) else x for x in info.get(key, ()))
                      if k.endswith("mask_prior.bias"))
        if ours:
            raise ValueError(f"from_pretrained: {path} " + what.format(ours[0], len(ours)))
    bad = [p.where for p in mp.mask_priors(model) if not bool(torch.isfinite(p.bias).all())]
    if bad:
        raise ValueError(f"from_pretrained: {path} gave {bad[0]} a non-finite M ({len(bad)} in all)")
    return (model, info) if with_info else model


def _reattach(model: nn.Module, record: dict) -> None:
    """Give `model` the priors (M = 0) of a checked record, every layer found and checked before any is changed."""
    named, base = dict(model.named_modules()), getattr(model, "base_model_prefix", "") + "."
    found = {s.name: s for s in find_attention(model)}
    sites, priors = [], {}
    for recorded, geo in record["layers"].items():
        # as saved, or with the base model's prefix added or taken off (saved with a head and loaded without, or back)
        name = next((n for n in (recorded, base + recorded, recorded.removeprefix(base)) if n in named), None)
        if name is None:
            raise ValueError(f"from_pretrained: the config records a prior on {recorded}, which "
                             f"{type(model).__name__} does not have")
        if name not in found:
            raise ValueError(f"from_pretrained: the config records a prior on {recorded}, a "
                             f"{type(named[name]).__name__}, which is not an attention layer add_mask_prior reaches; "
                             "nothing was loaded")
        site = found[name]
        _check_site(model, site, False, "attn_mask", "from_pretrained")
        shape = torch.empty(geo["heads"], geo["n"], geo["n_keys"] or geo["n"], device="meta")
        priors[name] = _prior_for(site, shape, None, mp.M_ON, mp.M_OFF, geo["causal"], None, geo["param"],
                                  geo["prefix"], "from_pretrained", tuple(geo["grid"]) if geo.get("grid") else None)
        sites.append(site)
    _after_attach(model, sites, priors)


# PEFT: an adapter that carries M, loaded onto a model without priors, is refused (PEFT would drop every M in silence).
# Saved, it names ADAPTER_SAVED in its peft_type, which plain PEFT refuses; a process that attached a prior knows the
# mark, and this file wraps each loader of adapters (ADAPTER_LOADERS) as soon as its module is imported.

def _hub(*kwargs: dict | None) -> dict:
    """The keywords of a loader's call that say where an adapter's config is (a revision, a subfolder, ...)."""
    return {k: v for kw in kwargs for k, v in (kw or {}).items()
            if k in ("subfolder", "revision", "cache_dir", "token", "local_files_only")}


def _carried(model_id, config, hub: dict, state: dict | None = None) -> list:
    """The modules_to_save names of an adapter that end in 'mask_prior' (it carries M), read from `config` (a
    PeftConfig or a dict), else from the adapter's own config file; 'mask_prior' where its `state` holds an M."""
    if config is None and state is None:
        import peft
        config = peft.PeftConfig.from_pretrained(model_id, **hub)
    saved = config.get("modules_to_save") if isinstance(config, dict) else getattr(config, "modules_to_save", None)
    return ([m for m in saved or () if m.rpartition(".")[2] == "mask_prior"]
            or ["mask_prior"] * any(k.endswith("mask_prior.bias") for k in state or {}))


def _check_adapter_base(where: str, model: nn.Module, model_id, saved: list) -> None:
    """Refuse, in one line and before PEFT changes anything, an adapter that carries M (`saved`: its modules_to_save
    names for M) for a model that holds no MaskPrior, where PEFT would drop every M in silence."""
    if saved and not mp.mask_priors(model):
        base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model   # PEFT's
        raise ValueError(f"{where}: the adapter {model_id} carries M (modules_to_save names {saved[0]!r}), but "
                         f"{type(base).__name__} holds no MaskPrior to take it (PEFT would drop every M): give the "
                         "model its priors first (add_mask_prior of the adapter's shapes, or from_pretrained of a "
                         "model saved with them); nothing was loaded")


# module -> (the class, its loader, what the call reads: the model, the adapter, the names it saves for M)
ADAPTER_LOADERS = {
    "peft": [("PeftModel", "from_pretrained", lambda a: (
        a["model"], a["model_id"], _carried(a["model_id"], a.get("config"), _hub(a.get("kwargs"))))),
             ("PeftModel", "load_adapter", lambda a: (
                 a["self"], a["model_id"], _carried(a["model_id"], None, _hub(a.get("kwargs")))))],
    "transformers.integrations.peft": [("PeftAdapterMixin", "load_adapter", lambda a: (
        a["self"], a.get("peft_model_id"), _carried(a.get("peft_model_id"), a.get("peft_config"),
                                                    _hub(a, a.get("adapter_kwargs"), a.get("kwargs")),
                                                    a.get("adapter_state_dict"))))],
}


def _guard_loaders(module) -> None:
    """Wrap `module`'s adapter loaders (ADAPTER_LOADERS) with `_check_adapter_base`, once; subclasses inherit it.
    PEFT also learns the types ADAPTER_SAVED marks, and its save_pretrained marks an adapter saved with M."""
    for owner, name, read in ADAPTER_LOADERS[module.__name__]:
        cls = getattr(module, owner)
        found = cls.__dict__[name]
        load = found.__func__ if isinstance(found, classmethod) else found
        if getattr(load, "mask_prior_checked", False):
            continue
        signature, where = inspect.signature(load), f"{owner}.{name}"

        def guarded(*args, _load=load, _signature=signature, _where=where, _read=read, **kwargs):
            _check_adapter_base(_where, *_read(_signature.bind(*args, **kwargs).arguments))
            return _load(*args, **kwargs)
        guarded = functools.wraps(load)(guarded)
        guarded.mask_prior_checked = True
        setattr(cls, name, classmethod(guarded) if isinstance(found, classmethod) else guarded)
    if module.__name__ == "peft" and not getattr(module.PeftModel.save_pretrained, "mask_prior_marks", False):
        types = module.PEFT_TYPE_TO_CONFIG_MAPPING
        types.update({f"{getattr(t, 'value', t)}, {ADAPTER_SAVED}": c for t, c in list(types.items())})
        module.PeftModel.save_pretrained = _save_adapter_marked(module.PeftModel.save_pretrained)


def _save_adapter_marked(save: Callable) -> Callable:
    """PEFT's save_pretrained, then each adapter it saved whose weights carry M (a modules_to_save copy of a MaskPrior,
    or of a module holding one) names ADAPTER_SAVED after its peft_type: a plain load fails loudly."""
    @functools.wraps(save)
    def save_pretrained(self, save_directory, *args, **kwargs):
        out = save(self, save_directory, *args, **kwargs)
        for name in self.peft_config:
            path = Path(save_directory, "" if name == "default" else name, "adapter_config.json")
            if path.is_file() and any(f"modules_to_save.{name}." in key and "mask_prior" in key
                                      for key, _ in self.named_parameters()):
                config = json.loads(path.read_text())
                config["peft_type"] = f"{config['peft_type'].partition(',')[0]}, {ADAPTER_SAVED}"
                path.write_text(json.dumps(config, indent=2, sort_keys=True))
        return out
    save_pretrained.mask_prior_marks = True
    return save_pretrained


class _AfterImport(importlib.abc.MetaPathFinder):
    """A finder ahead of Python's own, for one module: it lets them find the module and, once it is loaded (not
    merely looked up, as transformers' is_peft_available does), leaves and hands it to `then`."""
    def __init__(self, name: str, then: Callable):
        self.name, self.then, self.finding = name, then, False

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self.finding:
            return None
        self.finding = True
        try:
            spec = importlib.util.find_spec(fullname)          # Python's own finders (this one is finding)
        finally:
            self.finding = False
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                    self.then(module)
            spec.loader.exec_module = exec_module
        return spec


def _when_imported(name: str, then: Callable) -> None:
    """Hand module `name` to `then`: now, where it is imported, else as soon as it is (without importing it)."""
    if name in sys.modules:
        then(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


# each prior add_mask_prior gave, and the other weights of its layer; the optimisers that have stepped (held weakly)
_LAYERS: "weakref.WeakKeyDictionary[mp.MaskPrior, list]" = weakref.WeakKeyDictionary()
_STEPPED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def _watch() -> None:
    """Once, when this process first attaches a prior, never at import: register the optimiser step pre-hook
    `_warn_unheld_m`, and wrap PEFT's and transformers' adapter loaders (ADAPTER_LOADERS), now or when imported."""
    if not _WATCHING:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _WATCHING.append(register_optimizer_step_pre_hook(_warn_unheld_m))
        for name in ADAPTER_LOADERS:
            _when_imported(name, _guard_loaders)


_WATCHING: list = []


def _warn_unheld_m(optimizer, args, kwargs) -> None:
    """On an optimiser's first step, warn where it holds a retrofitted layer's weights but not its trainable M."""
    if optimizer in _STEPPED:
        return
    _STEPPED.add(optimizer)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    left = [p.where for p, layer in list(_LAYERS.items()) if p.bias.requires_grad and id(p.bias) not in held
            and any(id(r()) in held for r in layer)]
    if left:
        warnings.warn(f"{type(optimizer).__name__} holds the weights of {len(left)} layer(s) but not their trainable "
                      f"M ({left[0]}, ...), which will not train: make the optimiser after add_mask_prior, or give it "
                      "M (maskprior.param_groups)", stacklevel=3)


# ----------------------------------------------------------------------------------------
# The QK inits (maskprior's init_qk_svd_, init_qk_opt_, init_mimetic_: `impulse` is the first with pos_scale=18 and
# the last with qk=None, vo=(0.4, 0.4)) on timm's and Hugging Face's ViTs, through a QKView of their weights.

def _projections(module: nn.Module) -> tuple | None:
    """(q, k, v, o, (q, k, v biases)): views of an attention layer's weights, q/k/v (inner, dim) and o (dim, inner),
    for timm's fused qkv and proj, or Hugging Face's q_proj, k_proj, v_proj and o_proj; None for another layout."""
    qkv, proj = getattr(module, "qkv", None), getattr(module, "proj", None)
    if isinstance(qkv, nn.Linear) and isinstance(proj, nn.Linear):
        parts = [slice(i * qkv.out_features // 3, (i + 1) * qkv.out_features // 3) for i in range(3)]
        return (*(qkv.weight.detach()[p] for p in parts), proj.weight.detach(),
                tuple(None if qkv.bias is None else qkv.bias.detach()[p] for p in parts))
    linears = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if all(isinstance(x, nn.Linear) for x in linears):
        return (*(x.weight.detach() for x in linears), tuple(None if x.bias is None else x.bias.detach()
                                                          for x in linears[:3]))
    return None


def qk_view(model: nn.Module) -> mp.QKView:
    """The QKView of a timm or Hugging Face ViT (any model whose attention layers `find_attention` reaches, each
    with timm's qkv/proj or Hugging Face's q/k/v/o_proj, in pre-LN blocks): each layer's weights and its block's
    first LayerNorm, and the model's (1, N, dim) positional embedding (timm's pos_embed, Hugging Face's
    position_embeddings). Then, e.g. the `impulse` init:

        view = retrofit.qk_view(vit)
        mp.init_qk_svd_(view, mp.impulse_pattern(14, 14, mp.IMPULSE_OFFSETS[:3], n_prefix=1), pos_scale=18.0)
        mp.init_mimetic_(view, qk=None, vo=(0.4, 0.4))
    """
    named, sites = dict(model.named_modules()), []
    for site in find_attention(model):
        weights = _projections(site.module)
        parent = named[site.name.rpartition(".")[0]]
        norm = next((m for m in parent.children() if isinstance(m, nn.LayerNorm)), None)
        if weights is None or norm is None or not site.heads:
            raise ValueError(f"qk_view: {site.name} ({type(site.module).__name__}) is not a pre-LN block's attention "
                             "with timm's qkv/proj or Hugging Face's q/k/v/o_proj, which the QK inits write")
        *w, biases = weights
        sites.append(mp.QKSite(norm, site.heads, w[0].shape[0] // site.heads, *w, biases))
    pos = [p for n, p in model.named_parameters() if n.rpartition(".")[2] in ("pos_embed", "position_embeddings")
           and p.dim() == 3]
    if not sites or len(pos) != 1:
        raise ValueError(f"qk_view: {type(model).__name__} has {len(sites)} attention layers the QK inits can write "
                         f"and {len(pos)} positional embeddings (1, N, dim): they need a ViT's layers and its one "
                         "learned positional table")
    return mp.QKView(sites, pos[0])


def __getattr__(name: str):
    """`MaskPriorCallback`, made on first use: transformers is imported then, never at this module's import."""
    if name != "MaskPriorCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from transformers import TrainerCallback

    class MaskPriorCallback(TrainerCallback):
        """A Hugging Face TrainerCallback that adds the prior to the Trainer's logs at each logging step (and a record
        of its own at the step training starts from), averaged over the layers as train.py's metrics.jsonl holds them
        per layer: `prior_mass` and `content_margin` of a fixed batch `inputs` (the model's first input, e.g. input_ids
        or pixel_values) on `pattern` (`mp.prior_probe`), and `mask_drift`, M's relative distance from where training
        started (`mp.prior_drift`). Trainer(..., callbacks=[MaskPriorCallback(batch, pattern)])."""
        def __init__(self, inputs: torch.Tensor, pattern: torch.Tensor):
            self.inputs, self.pattern, self.start = inputs, pattern, None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.start = mp.prior_snapshot(model)
            state.log_history.append({**self.measure(model), "step": state.global_step})

        def on_log(self, args, state, control, logs=None, model=None, **kwargs):
            measured = self.measure(model)
            logs.update(measured)
            state.log_history[-1].update(measured)        # the Trainer's copy of `logs`, made before callbacks ran

        def measure(self, model: nn.Module) -> dict:
            training, device = model.training, next(model.parameters()).device
            mass, margin = mp.prior_probe(model.eval(), self.inputs.to(device), self.pattern)
            values = {"prior_mass": mass, "content_margin": margin, **mp.prior_drift(model.train(training), self.start)}
            return {key: sum(v) / len(v) for key, v in values.items() if v}

    globals()[name] = MaskPriorCallback
    return MaskPriorCallback


__all__ = ["add_mask_prior", "remove_mask_prior", "from_pretrained", "find_attention", "hf_attention", "prior_record",
           "Site", "qk_view", "MaskPriorCallback"]
