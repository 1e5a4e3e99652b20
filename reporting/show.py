"""M itself, drawn: `python train.py show RUN` reads a run's checkpoint (train.py checks it) and draws with these.

    m.png          M at the start and at the end of the run, per layer (a block: its start row, its end row) and head
                   (columns), on one colour scale; a full M as its N x N (query x key) matrix with the pairs M
                   started above 0 on (the pattern's allowed pairs) outlined, a relative M as a profile per head
                   over the distance i - j, start dashed, end solid, an image's M as a 2-D map of patch offsets
    attention.png  the mean attention on the task's probe inputs at the end, per layer and head,
                   its colour capped at the 99th percentile (said in the title: a causal first row's 1 would
                   wash out the rest)

The layers' blocks wrap into columns so that no figure is a strip. Pure drawing: tensors in, a PNG out (matplotlib, Agg, written atomically); nothing here reads a run folder.
"""
from __future__ import annotations

import math

import torch

from reporting.report import figure, pyplot, save_figure  # noqa: F401 (pyplot: train.py show asks it first)

PANEL = 2.2          # inches a panel


def _grid(layers: int, rows: int, heads: int):
    """(plt, fig, at): a figure of one block of `rows` x `heads` panels a layer, the blocks wrapped into as many
    columns as keep the figure nearest square (never a strip); at(layer, row, head) -> its axes. Unused panels
    are hidden."""
    c = min(range(1, layers + 1), key=lambda c: abs(math.log(-(-layers // c) * rows / (c * heads))))
    got = figure(-(-layers // c) * rows, c * heads, PANEL, PANEL, layout="constrained")
    if got is None:
        raise ImportError("drawing needs matplotlib: pip install matplotlib")
    plt, fig, axes = got
    for ax in axes.flat[:]:
        ax.set_visible(False)

    def at(layer, row, head):
        ax = axes[(layer // c) * rows + row, (layer % c) * heads + head]
        ax.set_visible(True)
        return ax
    return plt, fig, at


def offset_map(m: torch.Tensor, grid: int, prefix: int = 0) -> torch.Tensor:
    """(H, N, N) M of an image's patches (row-major after `prefix` tokens, N = prefix + grid^2) -> (H, 2g-1, 2g-1):
    the mean of M over the patch pairs of each offset (dy, dx) = key - query, index (dy + g - 1, dx + g - 1)."""
    heads, g = m.shape[0], grid
    patches = m[:, prefix:, prefix:].reshape(heads, -1)
    idx = torch.arange(g * g)
    dy = (idx[None, :] // g - idx[:, None] // g) + g - 1
    dx = (idx[None, :] % g - idx[:, None] % g) + g - 1
    cell = (dy * (2 * g - 1) + dx).flatten()
    total = torch.zeros(heads, (2 * g - 1) ** 2).index_add_(1, cell, patches.float())
    count = torch.zeros((2 * g - 1) ** 2).index_add_(0, cell, torch.ones(cell.numel()))
    return (total / count).reshape(heads, 2 * g - 1, 2 * g - 1)


def draw_m(start: list, end: list, path: str, title: str, causal: bool = False, grid: tuple | None = None) -> str:
    """`start`, `end`: per layer M, (H, N, K) full or (H, D) relative (float tensors; start None where the run
    kept no snapshot of M): a causal relative table holds distances 0..D-1, another -(n-1)..n-1 (D = 2n - 1).
    `grid` (g, prefix): an image's M, drawn as its 2-D offset map per head (`offset_map`). Writes `path` (m.png)
    and returns it."""
    if all(s is None for s in start):                    # M at the end alone (a saved model): one row a layer
        start, title = None, f"{title}; M at the end (its start was not saved)"
    if grid is not None:
        start = None if start is None else [None if s is None else offset_map(s, *grid) for s in start]
        end = [offset_map(e, *grid) for e in end]
        title += f"; M averaged over the patch pairs of each offset (dx, dy from -{grid[0] - 1} to {grid[0] - 1})"
        if grid[1]:
            title += ", the CLS token's row and column left out"
    heads, full = end[0].shape[0], end[0].dim() == 3
    values = torch.cat([m.flatten() for m in end + [s for s in start or [] if s is not None]])
    lim = float(values.abs().max().clamp_min(1e-6))
    if not full:                                         # a profile per head: one row a layer, start and end in it
        plt, fig, at = _grid(len(end), 1, heads)
        for layer, (s, e) in enumerate(zip(start or [None] * len(end), end)):
            d = e.shape[1]
            dist = torch.arange(d) if causal else torch.arange(d) - (d - 1) // 2
            for h in range(heads):
                ax = at(layer, 0, h)
                if s is not None:
                    ax.plot(dist.numpy(), s[h].numpy(), "--", color="tab:gray", lw=1, label="start")
                ax.plot(dist.numpy(), e[h].numpy(), color="tab:red", lw=1.4, label="end")
                ax.set_ylim(-1.05 * lim, 1.05 * lim)
                ax.set_title(f"layer {layer} head {h}", fontsize=8)
                ax.tick_params(labelsize=6)
                ax.set_xlabel("distance i - j", fontsize=7)
        fig.legend(*at(0, 0, 0).get_legend_handles_labels(), loc="outside lower center", ncols=2, fontsize=7)
        fig.suptitle(title, fontsize=9)
        return save_figure(fig, path, dpi=110)
    plt, fig, at = _grid(len(end), 1 if start is None else 2, heads)
    image, shown = None, []
    for layer, e in enumerate(end):
        s = None if start is None else start[layer]
        for row, (m, when) in enumerate(((e, "end"),) if start is None else ((s, "start"), (e, "end"))):
            for h in range(heads):
                ax = at(layer, row, h)
                shown.append(ax)
                ax.set_xticks([])
                ax.set_yticks([])
                ax.set_title(f"layer {layer} head {h}, {when}", fontsize=7)
                if m is None:
                    ax.text(0.5, 0.5, "no M kept", ha="center", va="center", fontsize=7, transform=ax.transAxes)
                    continue
                image = ax.imshow(m[h].numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
                if s is not None and bool((s[h] > 0).any()) and bool((s[h] <= 0).any()):
                    ax.contour((s[h] > 0).float().numpy(), levels=[0.5], colors="k", linewidths=0.4)
    fig.colorbar(image, ax=shown, shrink=0.8, label="M")
    axes_of = "x: key - query column, y: row" if grid is not None else "rows: query, columns: key"
    outline = "" if start is None else "; outlined: where M started above 0"
    fig.suptitle(f"{title}; M (the bias is log sigmoid M), {axes_of}{outline}", fontsize=9, wrap=True)
    return save_figure(fig, path, dpi=110)


def draw_model(model, path: str, title: str, start: list | None = None) -> str:
    """Any model with priors (`mp.add_mask_prior`, a saved one loaded with `mp.from_pretrained`) -> m.png: its M per
    prior, beside `start` (`mp.prior_snapshot(model)` taken before training) when given. The call for a retrofit:

        snap = mp.prior_snapshot(model)            # after add_mask_prior, before training
        ...                                        # train
        draw_model(model, "m.png", "GPT-2 + relative prior", snap)
    """
    import maskprior as mp
    priors = mp.mask_priors(model)
    if not priors:
        raise ValueError(f"draw_model: {type(model).__name__} has no mask prior (mp.add_mask_prior gives it one)")
    end = [p.bias.detach().float().cpu() for p in priors]
    if start is not None and len(start) != len(end):
        raise ValueError(f"draw_model: start holds {len(start)} snapshots, the model {len(end)} priors: take it "
                         f"with mp.prior_snapshot(model) after add_mask_prior")
    first = [None if start is None or s["mask"] is None else s["mask"].float().cpu() for s in start or [{}] * len(end)]
    return draw_m(first, end, path, title, causal=priors[0].causal)


def draw_attention(maps: torch.Tensor, path: str, title: str) -> str:
    """`maps`: (L, H, N, N) mean attention probabilities. Writes `path` (attention.png) and returns it."""
    layers, heads = maps.shape[:2]
    flat = maps.flatten().float()
    top = float(flat.kthvalue(max(1, int(0.99 * flat.numel()))).values) or float(flat.max())   # not a causal row 0's 1
    plt, fig, at = _grid(layers, 1, heads)
    image, shown = None, []
    for layer in range(layers):
        for h in range(heads):
            ax = at(layer, 0, h)
            shown.append(ax)
            image = ax.imshow(maps[layer, h].numpy(), cmap="viridis", vmin=0, vmax=top, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"layer {layer} head {h}", fontsize=7)
    fig.colorbar(image, ax=shown, shrink=0.8, extend="max", label="mean attention")
    fig.suptitle(f"{title}; rows: query, columns: key; colour capped at the 99th percentile ({top:.2f})", fontsize=9,
                 wrap=True)
    return save_figure(fig, path, dpi=110)
