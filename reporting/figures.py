"""The figure layer every report and `show` draws with: matplotlib without a display (`pyplot`), panels in a grid
(`panel_grid`), one line style per init or series (`line_style`), the legend and the caption outside the panels, M's
token ticks, atomic saving (`save_figure`) and what makes a saved figure hard to read (`figure_problems`)."""
from __future__ import annotations

import math
import textwrap

import numpy as np

import runfiles


def pyplot():
    """matplotlib.pyplot with the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


MAX_ASPECT = 4.0          # no figure wider than 4:1 or taller than 1:4
INIT_STYLES = {"default": ("tab:gray", "-"), "mask": ("tab:red", "-"), "qk-svd": ("tab:blue", "--"),
               "qk-opt": ("tab:green", "-."), "mimetic": ("tab:purple", ":"), "impulse": ("tab:orange", "--"),
               "mask-impulse": ("tab:brown", "-")}
SERIES_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
                  "tab:gray", "tab:olive", "tab:cyan")
LINESTYLES = ("-", "--", "-.", ":")


def line_style(i: int, init: str | None = None) -> tuple:
    """(colour, line style): the init's own where it has one (the same in every figure), else
    series i's, distinct for the first 40 series (ten colours, then the same ten dashed, ...)."""
    if init in INIT_STYLES:
        return INIT_STYLES[init]
    return SERIES_COLOURS[i % len(SERIES_COLOURS)], LINESTYLES[(i // len(SERIES_COLOURS)) % len(LINESTYLES)]


def panel_grid(blocks: int, rows: int = 1, cols: int = 1, width: float = 4.0, height: float = 3.0):
    """(plt, fig, at) of `blocks` blocks of rows x cols panels (`width` x `height` inches each), the blocks wrapped
    into columns: of the counts that keep the figure within 3:1 either way, the one that leaves fewest blocks of its
    last row empty, then the nearest square; so no figure is a strip. Constrained layout. at(block, row=0, col=0) ->
    its axes. Panels never asked for are dropped when the figure is saved. None when matplotlib is not installed."""
    plt = pyplot()
    if plt is None or blocks < 1:
        return None
    aspect = lambda c: c * cols * width / (-(-blocks // c) * rows * height)           # noqa: E731
    fits = [c for c in range(1, blocks + 1) if 1 / 3 <= aspect(c) <= 3] or range(1, blocks + 1)
    # no empty blocks, then nearest square
    c = min(fits, key=lambda c: (-blocks % c, abs(math.log(aspect(c)))))
    r = -(-blocks // c) * rows
    fig, axes = plt.subplots(r, c * cols, figsize=(c * cols * width, r * height), squeeze=False, layout="constrained")
    for ax in axes.flat:
        ax.set_visible(False)

    def at(block: int, row: int = 0, col: int = 0):
        ax = axes[(block // c) * rows + row, (block % c) * cols + col]
        ax.set_visible(True)
        return ax
    return plt, fig, at


def wrapped(text: str, inches: float, size: float, lines: int | None = None) -> str:
    """text broken into lines (at its own line breaks too) that fit `inches` at font size `size`; at most `lines` of
    them where given (a label read from a file), the last saying how many characters are left out."""
    chars = max(20, int(inches * 72 / (0.6 * size)))
    out = [part for line in text.split("\n") for part in textwrap.wrap(line, chars) or [""]]
    if lines is None or len(out) <= lines:
        return "\n".join(out)
    kept = out[:lines - 1]
    return "\n".join(kept + [f"... ({len(text) - sum(map(len, kept)):,} characters more, cut here)"])


LABEL_LINES = 8         # lines of a title or legend label drawn from a file's names (`wrapped`)


def caption(fig, text: str, size: float = 9) -> None:
    """The figure's title, wrapped to its width."""
    fig.suptitle(wrapped(text, fig.get_figwidth(), size), fontsize=size)


def legend_below(fig, size: float = 8) -> None:
    """One legend for the whole figure, under its panels (each label once, in the order first drawn)."""
    seen = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    if seen:
        # a long label (a study's flags) broken into lines that fit the figure
        labels = [wrapped(label, fig.get_figwidth() - 0.6, size, LABEL_LINES) for label in seen]
        longest = max(len(line) for label in labels for line in label.split("\n"))
        ncols = max(1, min(len(seen), int(fig.get_figwidth() * 72 / (size * 0.6 * longest + 40))))
        fig.legend(list(seen.values()), labels, loc="outside lower center", ncols=ncols, fontsize=size)


def token_ticks(ax, names: list | None, n: int, size: float = 5.5) -> None:
    """Name the rows (queries) and columns (keys) of an n x n map by their tokens (every k-th where
    n is over 24), or leave it without ticks where `names` does not name n tokens."""
    if not names or len(names) != n:
        ax.set_xticks([])
        ax.set_yticks([])
        return
    at = list(range(0, n, -(-n // 24)))
    # a name with '$' is text, not math (tick labels keep math parsing for the axes' numbers)
    shown = [names[i].replace("$", r"\$") for i in at]
    ax.set_xticks(at, shown, fontsize=size, rotation=90)
    ax.set_yticks(at, shown, fontsize=size)
    ax.tick_params(length=1, pad=1)


def figure_problems(fig, drawn: bool = False) -> list[str]:
    """What makes a drawn figure hard to read, as lines (none: readable): wider than 4:1 or taller than 1:4, a panel
    with nothing drawn in it, two panels (colour bars too) over each other, or two pieces of text (titles, labels,
    tick labels, legend entries) whose boxes overlap (the renderer's extents, one pixel of slack). `drawn`: the
    figure was just drawn at its current dpi (a save), so its layout is the one checked and it is not drawn again."""
    from matplotlib.text import Text
    w, h = fig.get_size_inches()
    strip = max(w / h, h / w) > MAX_ASPECT
    problems = [f"{w:.1f} x {h:.1f} inches: a strip (more than {MAX_ASPECT:g}:1)"] if strip else []
    if not drawn:
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    hidden = set()
    for ax in fig.axes:
        if ax.get_visible() and not (ax.lines or ax.images or ax.collections or ax.patches or ax.texts):
            problems.append(f"panel {ax.get_title()!r}: nothing drawn")
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not lo - 1e-9 * (hi - lo) <= tick.get_loc() <= hi + 1e-9 * (hi - lo):  # located, not drawn
                    hidden.update((id(tick.label1), id(tick.label2)))
    panels = [ax for ax in fig.axes if ax.get_visible()]
    for i, a in enumerate(panels):
        for b in panels[i + 1:]:
            one, two = a.get_window_extent(renderer), b.get_window_extent(renderer)
            if min(one.x1, two.x1) - max(one.x0, two.x0) > 1 and min(one.y1, two.y1) - max(one.y0, two.y0) > 1:
                problems.append(f"panels {a.get_title() or a.get_label()!r} and "
                                f"{b.get_title() or b.get_label()!r} overlap")
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip() and id(t) not in hidden
             and all(a.get_visible() for a in [t.axes] if a is not None)]
    boxes = np.array([t.get_window_extent(renderer).extents for t in texts]).reshape(-1, 4)
    x = np.minimum(boxes[:, None, 2], boxes[None, :, 2]) - np.maximum(boxes[:, None, 0], boxes[None, :, 0])
    y = np.minimum(boxes[:, None, 3], boxes[None, :, 3]) - np.maximum(boxes[:, None, 1], boxes[None, :, 1])
    for i, j in zip(*np.nonzero(np.triu((x > 1) & (y > 1), 1))):
        problems.append(f"text {texts[i].get_text()!r} overlaps {texts[j].get_text()!r}")
    return problems


def as_text(fig) -> None:
    """Every text of `fig` drawn as the characters it holds: no math ($...$) and no LaTeX, since titles, labels and
    legends hold names read from files ('$\\frac{$' is a task's name, not a formula). The axes' tick labels, which
    matplotlib's formatters write (10^2 on a log scale), keep theirs; `token_ticks` escapes the names it puts there."""
    from matplotlib.text import Text
    ticks = {id(t) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
             for t in [axis.offsetText] + [label for tick in axis.get_major_ticks() + axis.get_minor_ticks()
                                           for label in (tick.label1, tick.label2)]}
    for text in fig.findobj(Text):
        if id(text) not in ticks:
            text.set_parse_math(False)
            text.set_usetex(False)


def save_figure(fig, path: str, dpi: int = 110) -> str:
    """Drop the panels never drawn in, save the figure as a PNG atomically (texts as text: `as_text`), close it."""
    for ax in [ax for ax in fig.axes if not ax.get_visible()]:
        fig.delaxes(ax)
    as_text(fig)
    with runfiles.atomic_output(path) as f:
        fig.savefig(f, format="png", dpi=dpi)
    pyplot().close(fig)
    return path


def plot_band(ax, by_step: dict, label: str, style: tuple, scale: float = 1.0) -> None:
    """Draw {step: [values over seeds]} as the mean line and a min-to-max band in `style` (`line_style`), as `label`."""
    steps = sorted(by_step)
    vals = [by_step[st] for st in steps]
    colour, dashes = style
    ax.plot(steps, [scale * sum(v) / len(v) for v in vals], color=colour, ls=dashes, lw=1.6, label=label)
    ax.fill_between(steps, [scale * min(v) for v in vals], [scale * max(v) for v in vals],
                    color=colour, alpha=0.15, lw=0)
