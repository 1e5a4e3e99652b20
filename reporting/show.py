"""M itself, drawn: `python train.py show RUN` reads a run's checkpoint (train.py checks it) and draws with these.

    m.png          M at the start and at the end of the run, per layer (rows: layer l start, layer l end) and head
                   (columns), on one colour scale; a full M as its N x N (query x key) matrix with the pairs M
                   started above 0 on (the pattern's allowed pairs) outlined, a relative M as a profile per head
                   over the distance i - j, start dashed, end solid
    attention.png  the mean attention on the task's probe inputs at the end, per layer (rows) and head (columns),
                   its colour capped at the 99th percentile (said on the colour bar: a causal first row's 1 would
                   wash out the rest)

Pure drawing: tensors in, a PNG out (matplotlib, Agg, written atomically); nothing here reads a run folder.
"""
from __future__ import annotations

import torch

from reporting.report import figure, pyplot, save_figure  # noqa: F401 (pyplot: train.py show asks it first)

PANEL = 2.2          # inches a panel


def _grid(rows: int, cols: int):
    got = figure(rows, cols, PANEL, PANEL, layout="constrained")
    if got is None:
        raise ImportError("drawing needs matplotlib: pip install matplotlib")
    return got


def draw_m(start: list, end: list, path: str, title: str, causal: bool = False) -> str:
    """`start`, `end`: per layer M, (H, N, K) full or (H, D) relative (float tensors; start None where the run
    kept no snapshot of M): a causal relative table holds distances 0..D-1, another -(n-1)..n-1 (D = 2n - 1).
    Writes `path` (m.png) and returns it."""
    heads, full = end[0].shape[0], end[0].dim() == 3
    values = torch.cat([m.flatten() for m in end + [s for s in start if s is not None]])
    lim = float(values.abs().max().clamp_min(1e-6))
    if not full:                                         # a profile per head: one row a layer, start and end in it
        plt, fig, axes = _grid(len(end), heads)
        for layer, (s, e) in enumerate(zip(start, end)):
            d = e.shape[1]
            dist = torch.arange(d) if causal else torch.arange(d) - (d - 1) // 2
            for h in range(heads):
                ax = axes[layer, h]
                if s is not None:
                    ax.plot(dist.numpy(), s[h].numpy(), "--", color="tab:gray", lw=1, label="start")
                ax.plot(dist.numpy(), e[h].numpy(), color="tab:red", lw=1.4, label="end")
                ax.set_ylim(-1.05 * lim, 1.05 * lim)
                ax.set_title(f"layer {layer} head {h}", fontsize=8)
                ax.tick_params(labelsize=6)
                if layer == len(end) - 1:
                    ax.set_xlabel("distance i - j", fontsize=7)
        fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside lower center", ncols=2, fontsize=7)
        fig.suptitle(title, fontsize=9)
        return save_figure(fig, path, dpi=110)
    plt, fig, axes = _grid(2 * len(end), heads)
    image = None
    for layer, (s, e) in enumerate(zip(start, end)):
        for row, (m, when) in enumerate(((s, "start"), (e, "end"))):
            for h in range(heads):
                ax = axes[2 * layer + row, h]
                ax.set_xticks([])
                ax.set_yticks([])
                ax.set_title(f"layer {layer} head {h}, {when}", fontsize=7)
                if m is None:
                    ax.text(0.5, 0.5, "no M kept", ha="center", va="center", fontsize=7, transform=ax.transAxes)
                    continue
                image = ax.imshow(m[h].numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
                if s is not None and bool((s[h] > 0).any()) and bool((s[h] <= 0).any()):
                    ax.contour((s[h] > 0).float().numpy(), levels=[0.5], colors="k", linewidths=0.4)
    fig.colorbar(image, ax=axes, shrink=0.6, label="M (the bias is log sigmoid M)")
    fig.suptitle(f"{title}; rows: query, columns: key; outlined: where M started above 0", fontsize=9)
    return save_figure(fig, path, dpi=110)


def draw_attention(maps: torch.Tensor, path: str, title: str) -> str:
    """`maps`: (L, H, N, N) mean attention probabilities. Writes `path` (attention.png) and returns it."""
    layers, heads = maps.shape[:2]
    flat = maps.flatten().float()
    top = float(flat.kthvalue(max(1, int(0.99 * flat.numel()))).values) or float(flat.max())   # not a causal row 0's 1
    plt, fig, axes = _grid(layers, heads)
    image = None
    for layer in range(layers):
        for h in range(heads):
            ax = axes[layer, h]
            image = ax.imshow(maps[layer, h].numpy(), cmap="viridis", vmin=0, vmax=top, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"layer {layer} head {h}", fontsize=7)
    fig.colorbar(image, ax=axes, shrink=0.6, extend="max", label=f"mean attention (colour capped at its 99th "
                 f"percentile, {top:.2f})")
    fig.suptitle(f"{title}; rows: query, columns: key", fontsize=9)
    return save_figure(fig, path, dpi=110)
