"""The figure layer every report and `show` draws with: matplotlib without a display (`pyplot`), panels in a grid
(`panel_grid`), one line style per init or series (`line_style`), the legend and the caption outside the panels, M's
token ticks and atomic saving (`save_figure`)."""
from __future__ import annotations

import math
import textwrap

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
LEGEND_MOST = 8         # entries of a legend at most: a figure of more series draws them in groups (`in_groups`)


def caption(fig, text: str, size: float = 9) -> None:
    """The figure's title, wrapped to its width."""
    fig.suptitle(wrapped(text, fig.get_figwidth(), size), fontsize=size)


def in_groups(items: list, key, most: int = LEGEND_MOST) -> list[list]:
    """`items` in columns of at most `most`: those of one key(item) together, in the order first met (a key of more
    split as evenly as can be: 12 into 6 and 6), a key's items packed into the column before where they fit."""
    by, columns = {}, []
    for item in items:
        by.setdefault(key(item), []).append(item)
    for same in by.values():
        size = -(-len(same) // -(-len(same) // most))
        for part in (same[i:i + size] for i in range(0, len(same), size)):
            if columns and len(columns[-1]) + len(part) <= most:
                columns[-1] += part
            else:
                columns.append(part)
    return columns or [[]]


def legend_below(fig, size: float = 8, axes: list | None = None) -> None:
    """One legend (each label once, in the order first drawn) of the whole figure under its panels, or of `axes`
    alone (a group of panels in a column) under the last of them."""
    seen = {}
    for ax in axes or fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    if seen:
        width = fig.get_figwidth() / (1 if axes is None else axes[-1].get_gridspec().ncols)
        # a long label (a study's flags) broken into lines that fit the figure
        labels = [wrapped(label, width - 0.6, size, LABEL_LINES) for label in seen]
        longest = max(len(line) for label in labels for line in label.split("\n"))
        ncols = max(1, min(len(seen), int(width * 72 / (size * 0.6 * longest + 40))))
        where = (dict(loc="outside lower center") if axes is None
                 else dict(loc="upper center", bbox_to_anchor=(0.5, -0.16)))
        (fig if axes is None else axes[-1]).legend(list(seen.values()), labels, ncols=ncols, fontsize=size, **where)


def token_ticks(ax, names: list | None, n: int, size: float = 5.5, axes: tuple = ("key", "query"),
                at: list | None = None) -> None:
    """Name the columns and rows of an n x n map (those `at`, else every k-th where n is over 24) by their tokens
    where `names` names n of them, else by position, and label its axes (`axes`: the columns', the rows')."""
    at, named = at or list(range(0, n, -(-n // 24))), bool(names) and len(names) == n
    # a name with '$' is text, not math (tick labels keep math parsing for the axes' numbers)
    shown = [names[i].replace("$", r"\$") if named else str(i) for i in at]
    ax.set_xticks(at, shown, fontsize=size, rotation=90)
    ax.set_yticks(at, shown, fontsize=size)
    ax.tick_params(length=1, pad=1)
    ax.set_xlabel(axes[0] if named else f"{axes[0]} position", fontsize=size + 1)
    ax.set_ylabel(axes[1] if named else f"{axes[1]} position", fontsize=size + 1)


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
