"""M itself, drawn: `python train.py show RUN` reads a run's checkpoint (train.py checks it) and draws with these
m.png (M at the start and the end per layer and head: `draw_m`) and attention.png (the mean attention on the task's
probe inputs at the end: `draw_attention`), the layers' blocks wrapped into columns so that no figure is a strip.
Pure drawing: tensors in, a PNG out (matplotlib, Agg, written atomically); nothing here reads a run folder.
"""
from __future__ import annotations

import torch

import maskprior as mp
from reporting.figures import caption, legend_below, panel_grid, pyplot, save_figure, token_ticks  # noqa: F401

PANEL = 2.2          # inches a panel


def _grid(layers: int, rows: int, heads: int):
    """(plt, fig, at) of a block of `rows` x `heads` panels a layer (`panel_grid`); at(layer, row, head) -> its axes."""
    got = panel_grid(layers, rows, heads, PANEL, PANEL)
    if got is None:
        raise ImportError("drawing needs matplotlib: pip install matplotlib")
    return got


def m_of_checkpoint(ckpt: dict) -> tuple[list, list]:
    """(start, end) of a checkpoint's M, per layer: its probe snapshot's M (None where it kept none) and its
    weights' `attn.prior.bias` in layer order (a grid's table as its (H, N, N) M); ([], []) for a run without M."""
    keys = sorted((k for k in ckpt["model"] if k.endswith("attn.prior.bias")), key=lambda k: int(k.split(".")[1]))
    if not keys:
        return [], []
    start = [s["mask"].float() if s.get("mask") is not None else None for s in ckpt["snapshot"]]
    end = [ckpt["model"][k].float() for k in keys]
    mc = ckpt.get("model_config", {})
    if mc.get("mask_param") == "grid":             # a 2-D relative M's table, laid out as its (H, N, N) M
        g = mc["image_size"] // mc["patch_size"]
        slots = mp.grid_index(g, g, int(mc.get("pool") == "cls"))
        start, end = ([None if m is None else m[:, slots] for m in ms] for ms in (start, end))
    return start, end


def offset_map(m: torch.Tensor, grid: int, prefix: int = 0) -> torch.Tensor:
    """(H, N, N) M of an image's patches (row-major after `prefix` tokens, N = prefix + grid^2) -> (H, 2g-1, 2g-1):
    the mean of M over the patch pairs of each offset (dy, dx) = key - query, index (dy + g - 1, dx + g - 1)."""
    heads, g = m.shape[0], grid
    patches = m[:, prefix:, prefix:].reshape(heads, -1)
    cell = mp.grid_index(g, g).flatten()             # a 2-D relative M's slots: one per offset, numbered as here
    total = torch.zeros(heads, (2 * g - 1) ** 2).index_add_(1, cell, patches.float())
    count = torch.zeros((2 * g - 1) ** 2).index_add_(0, cell, torch.ones(cell.numel()))
    return (total / count).reshape(heads, 2 * g - 1, 2 * g - 1)


def draw_m(start: list, end: list, path: str, title: str, causal: bool = False,
           grid: tuple | None = None, names: list | None = None) -> str:
    """`start`, `end`: per layer M, (H, N, K) full or (H, D) relative (float tensors; start None where the run kept no
    snapshot of M): a causal relative table holds distances 0..D-1, another -(n-1)..n-1 (D = 2n - 1). `grid` (g,
    prefix): an image's M, drawn as its 2-D offset map per head (`offset_map`). `names`: the N tokens' names for the
    ticks (`Task.token_labels`). Writes `path` (m.png) and returns it."""
    # M at the end alone (a saved model): one row a layer
    if all(s is None for s in start):
        start, title = None, f"{title}; M at the end (its start was not saved)"
    if grid is not None:
        start = None if start is None else [None if s is None else offset_map(s, *grid) for s in start]
        end = [offset_map(e, *grid) for e in end]
        names = [str(o) for o in range(1 - grid[0], grid[0])]
        title += f"; M averaged over the patch pairs of each offset (dx, dy from -{grid[0] - 1} to {grid[0] - 1})"
        if grid[1]:
            title += ", the CLS token's row and column left out"
    values = torch.cat([m.flatten() for m in end + [s for s in start or [] if s is not None]])
    lim = float(values.abs().max().clamp_min(1e-6))
    change = [None if s is None else e - s for s, e in zip(start or [None] * len(end), end)]
    dlim = max((float(c.abs().max()) for c in change if c is not None), default=0.0) or 1e-6
    moved = f"; the last row of each layer: end - start, on its own scale (largest change {dlim:.3g})"
    if end[0].dim() != 3:                           # relative tables, not full M
        return _draw_profiles(start, end, path, title + "; M over the distance (the bias is log sigmoid M)"
                              + ("" if start is None else moved), causal, lim, dlim)
    axes = ("column offset dx (key - query)", "row offset dy") if grid is not None else ("key", "query")
    outline = "" if start is None else "; outlined: where M started above 0" + moved
    return _draw_maps(start, end, change, path, f"{title}; M (the bias is log sigmoid M){outline}", names, lim, dlim,
                      axes)


def _draw_profiles(start, end, path: str, title: str, causal: bool, lim: float, dlim: float) -> str:
    """draw_m for relative tables: per head M over the distance (start dashed, end solid), then a row of end - start."""
    heads = end[0].shape[0]
    plt, fig, at = _grid(len(end), 1 if start is None else 2, heads)
    for layer, (s, e) in enumerate(zip(start or [None] * len(end), end)):
        d = e.shape[1]
        dist = (torch.arange(d) if causal else torch.arange(d) - (d - 1) // 2).numpy()
        for h in range(heads):
            ax = at(layer, 0, h)
            if s is not None:
                ax.plot(dist, s[h].numpy(), "--", color="tab:gray", lw=1, label="start")
            ax.plot(dist, e[h].numpy(), color="tab:red", lw=1.4, label="end")
            ax.set_ylim(-1.05 * lim, 1.05 * lim)
            ax.set_title(f"layer {layer} head {h}", fontsize=7)
            if start is not None:
                ax = at(layer, 1, h)
                if s is None:
                    ax.text(0.5, 0.5, "no start kept", ha="center", va="center", fontsize=7, transform=ax.transAxes)
                else:
                    ax.plot(dist, (e[h] - s[h]).numpy(), color="tab:purple", lw=1.2, label="end - start")
                    ax.set_ylim(-1.05 * dlim, 1.05 * dlim)
                ax.set_title(f"layer {layer} head {h}, end - start", fontsize=7)
            for row, what in enumerate(("M", "end - start")[:1 if start is None else 2]):
                ax = at(layer, row, h)
                ax.tick_params(labelsize=6)
                ax.set_xlabel("distance i - j", fontsize=7)
                ax.set_ylabel(what, fontsize=7)
    legend_below(fig, size=7)
    caption(fig, title)
    return save_figure(fig, path)


def _draw_maps(start, end, change, path: str, title: str, names, lim: float, dlim: float, axes: tuple) -> str:
    """draw_m for full M: per layer a row of maps per head at the start, at the end and of end - start (outlined
    where M started above 0), with their colour bars; `axes`: the labels of the columns and rows."""
    heads = end[0].shape[0]
    plt, fig, at = _grid(len(end), 1 if start is None else 3, heads)
    image, shown, moved_image, moved_axes = None, [], None, []
    for layer, (e, c) in enumerate(zip(end, change)):
        s = None if start is None else start[layer]
        maps = ((e, "end", None),) if start is None else ((s, "start", None), (e, "end", None),
                                                          (c, "end - start", 1))
        for row, (m, when, delta) in enumerate(maps):
            for h in range(heads):
                ax = at(layer, row, h)
                (moved_axes if delta else shown).append(ax)
                token_ticks(ax, names, e.shape[-1], axes=axes)
                ax.set_title(f"layer {layer} head {h}, {when}", fontsize=7)
                if m is None:
                    ax.text(0.5, 0.5, "no M kept", ha="center", va="center", fontsize=7, transform=ax.transAxes)
                    continue
                shown_now = ax.imshow(m[h].numpy(), cmap="PuOr_r" if delta else "RdBu_r",
                                      vmin=-(dlim if delta else lim), vmax=dlim if delta else lim,
                                      interpolation="nearest")
                moved_image, image = (shown_now, image) if delta else (moved_image, shown_now)
                if s is not None and bool((s[h] > 0).any()) and bool((s[h] <= 0).any()):
                    ax.contour((s[h] > 0).float().numpy(), levels=[0.5], colors="k", linewidths=0.4)
    fig.colorbar(image, ax=shown, shrink=0.6, label="M")
    if moved_image is not None:
        fig.colorbar(moved_image, ax=moved_axes, shrink=0.6, location="bottom",
                     label="end - start", ticks=[-dlim, -dlim / 2, 0, dlim / 2, dlim],
                     format="%.2g")
    caption(fig, title)
    return save_figure(fig, path)


def draw_model(model, path: str, title: str, start: list | None = None) -> str:
    """Any model with priors (`retrofit.add_mask_prior`, or one loaded by `retrofit.from_pretrained`) -> m.png: its M
    per prior, beside `start` (`mp.prior_snapshot(model)` before training) when given. The call for a retrofit:

        snap = mp.prior_snapshot(model)            # after add_mask_prior, before training
        ...                                        # train
        draw_model(model, "m.png", "GPT-2 + relative prior", snap)
    """
    priors = mp.mask_priors(model)
    if not priors:
        raise ValueError(f"draw_model: {type(model).__name__} has no mask prior (retrofit.add_mask_prior gives it one)")
    end = [(p.bias if p.param != "grid" else p.full_logits()).detach().float().cpu() for p in priors]
    if start is not None and len(start) != len(end):
        raise ValueError(f"draw_model: start holds {len(start)} snapshots, the model {len(end)} "
                         "priors: take it with mp.prior_snapshot(model) after add_mask_prior")
    first = [None if start is None or s["mask"] is None else s["mask"].float().cpu() for s in start or [{}] * len(end)]
    first = [m if m is None or p.param != "grid" else m[:, mp.grid_index(*p.grid, p.n - p.grid[0] * p.grid[1])]
             for m, p in zip(first, priors)]
    return draw_m(first, end, path, title, causal=priors[0].causal)


def draw_attention(maps: torch.Tensor, path: str, title: str, names: list | None = None,
                   grid: tuple | None = None) -> str:
    """(L, H, N, N) mean attention `maps` -> `path` (attention.png), returned; `names`: the N tokens' tick names, or
    `grid` (g, prefix): an image's, its CLS token then its patches by row and column."""
    layers, heads = maps.shape[:2]
    flat = maps.flatten().float()
    # not a causal row 0's 1
    top = float(flat.kthvalue(max(1, int(0.99 * flat.numel()))).values) or float(flat.max())
    plt, fig, at = _grid(layers, 1, heads)
    rows = None                                     # an image: its class tokens and each row's first patch
    if names is None and grid is not None:
        names = ["CLS"] * grid[1] + [f"{r},{c}" for r in range(grid[0]) for c in range(grid[0])]
        rows = [*range(grid[1]), *range(grid[1], maps.shape[-1], grid[0])]
    axes = ("key patch (row,column)", "query patch") if grid is not None else ("key", "query")
    image, shown = None, []
    for layer in range(layers):
        for h in range(heads):
            ax = at(layer, 0, h)
            shown.append(ax)
            image = ax.imshow(maps[layer, h].numpy(), cmap="viridis", vmin=0, vmax=top, interpolation="nearest")
            token_ticks(ax, names, maps.shape[-1], axes=axes, at=rows)
            ax.set_title(f"layer {layer} head {h}", fontsize=7)
    fig.colorbar(image, ax=shown, shrink=0.8, extend="max", label="mean attention")
    caption(fig, f"{title}; colour capped at the 99th percentile ({top:.2f})")
    return save_figure(fig, path)
