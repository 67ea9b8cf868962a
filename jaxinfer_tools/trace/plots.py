"""Plots of a `Trace`: attention heatmaps per call (masked cells hatched)
and the KV cache filling up, with matplotlib's object API (no pyplot)."""

from __future__ import annotations

import os
import pathlib
from typing import Callable, Optional, Sequence

import numpy as np

from jaxinfer_tools.trace.tracer import LayerTrace, Phase, Trace


def _pick_font(texts: Sequence[str]) -> Optional[str]:
    """A font family covering every character of `texts`, or None. Looks at
    matplotlib's font list, then at system fonts it has not cached yet."""
    from matplotlib import font_manager, ft2font

    needed = {ord(ch) for s in texts for ch in s if not ch.isascii()}
    if not needed:
        return None

    def covers(path: str) -> bool:
        try:
            return needed <= set(ft2font.FT2Font(path).get_charmap())
        except (OSError, RuntimeError, ValueError):
            return False

    for entry in font_manager.fontManager.ttflist:
        # "Last Resort" has a placeholder glyph for every code point: skip it.
        if "last resort" not in entry.name.lower() and covers(entry.fname):
            return entry.name
    known = {entry.fname for entry in font_manager.fontManager.ttflist}
    for path in font_manager.findSystemFonts():
        if path not in known and covers(path):
            font_manager.fontManager.addfont(path)
            return font_manager.FontProperties(fname=path).get_name()
    return None


def plot_trace(trace: Trace, out_dir: str | os.PathLike,
               token_text: Callable[[int], str]) -> list[pathlib.Path]:
    """Write PNGs: per phase, each layer's attention weights (masked cells grey
    and hatched); and the cache filling up (layer x position, colored by the
    step that wrote each slot). Returns the written paths.

    Tick labels use the token text when an installed font covers it, else "#id".
    """
    import matplotlib

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seqs = [trace.tokens_at(ph) for ph in trace.phases]
    texts = [token_text(i) for i in set(t for seq in seqs for t in seq)]
    family = _pick_font(texts)
    covered = family is not None or all(s.isascii() for s in texts)
    label = lambda i: repr(token_text(i)) if covered else f"#{i}"  # no font for the text: ids
    style = {"font.family": ["DejaVu Sans"] + ([family] if family else [])}
    paths = []
    with matplotlib.rc_context(style):   # Figure + Agg canvas: no pyplot, no global backend
        for ph, seq in zip(trace.phases, seqs):
            paths.append(_plot_phase(trace, ph, seq, label, out))
        paths.append(_plot_cache(trace, seqs[-1], label, out))
    return paths


def _heatmap(ax, weights: np.ndarray, mask: np.ndarray, annotate: bool,
             faded_rows: int = 0) -> object:
    """weights [R, C] with masked cells drawn grey and hatched; the first
    `faded_rows` rows get dark annotations (they are drawn faded)."""
    shown = np.ma.masked_array(weights, ~mask)
    cmap = _weights_cmap()
    im = ax.imshow(shown, cmap=cmap, vmin=0.0, vmax=1.0, aspect="equal")
    for r, c in zip(*np.nonzero(~mask)):
        ax.add_patch(_hatched_cell(c, r))
    if annotate:
        for r in range(weights.shape[0]):
            for c in range(weights.shape[1]):
                txt = f"{weights[r, c]:.2f}" if mask[r, c] else "-inf"
                dark_cell = mask[r, c] and weights[r, c] < 0.6 and r >= faded_rows
                color = "white" if dark_cell else "black"
                ax.text(c, r, txt, ha="center", va="center", fontsize=8, color=color)
    return im


def _weights_cmap():
    """viridis with masked cells grey."""
    import matplotlib

    return matplotlib.colormaps["viridis"].with_extremes(bad="#d0d0d0")


def _hatched_cell(c: int, r: int):
    from matplotlib.patches import Rectangle

    return Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, hatch="///", edgecolor="#808080",
                     linewidth=0)


def _phase_grid(ph: Phase, lt: LayerTrace):
    """What one heatmap shows: (weights [R, C] head mean, mask [R, C], row
    positions, column positions, index of the call's first row or None). A
    chunk or a decode step shows its rows as the last rows of the full
    [t, t] recompute."""
    if ph.kind == "prefill":
        return lt.weights.mean(axis=0), lt.mask, list(ph.positions), list(lt.key_pos), None
    full = lt.recompute
    t, n = full.weights.shape[-1], len(ph.positions)
    weights, mask = full.weights.mean(axis=0).copy(), full.mask.copy()
    weights[t - n:] = 0.0
    weights[t - n:, lt.key_pos] = lt.weights.mean(axis=0)
    mask[t - n:] = False
    mask[t - n:, lt.key_pos] = lt.mask
    return weights, mask, list(range(t)), list(range(t)), t - n


def _figure(rows: int, cols: int, figsize):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, cols, squeeze=False)


def _plot_phase(trace: Trace, ph: Phase, seq, label, out: pathlib.Path) -> pathlib.Path:
    from matplotlib.patches import Rectangle

    n = len(ph.layers)
    cols = min(n, 6)
    rows = -(-n // cols)
    grids = [_phase_grid(ph, lt) for lt in ph.layers]
    size = max(len(g[3]) for g in grids)
    cell = 0.6 if size <= 8 else max(0.12, 4.8 / size)
    fig, axes = _figure(rows, cols, (cols * (cell * size + 1.4) + 1.2,
                                     rows * (cell * len(grids[0][2]) + 1.3) + 0.9))
    annotate, small = size <= 10 and n <= 12, size <= 16
    im = None
    new_rows = len(ph.positions)
    for ax, lt, (weights, mask, row_pos, col_pos, first_row) in zip(axes.flat, ph.layers, grids):
        im = _heatmap(ax, weights, mask, annotate, first_row or 0)
        if first_row is not None:
            ax.add_patch(Rectangle((-0.5, -0.5), len(col_pos), first_row, color="white",
                                   alpha=0.6, linewidth=0))
            ax.add_patch(Rectangle((-0.5, first_row - 0.5), len(col_pos), new_rows, fill=False,
                                   edgecolor="red", linewidth=2))
        heads = "" if lt.weights.shape[0] == 1 else f", mean of {lt.weights.shape[0]} heads"
        ax.set_title(f"layer {lt.layer}{heads}", fontsize=9)
        ax.set_xticks(range(len(col_pos)))
        ax.set_yticks(range(len(row_pos)))
        ax.set_xticklabels([f"{p}\n{label(seq[p])}" if small else str(p) for p in col_pos],
                           fontsize=7)
        ax.set_yticklabels([f"{label(seq[p])} {p}" if small else str(p) for p in row_pos],
                           fontsize=7)
        ax.set_xlabel("key position", fontsize=8)
        ax.set_ylabel("query position", fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if ph.kind == "prefill":
        title = (f"prefill: attention weights [{len(ph.positions)}, {size}] per layer, all rows "
                 "computed in parallel\n(grey hatched = masked future: -inf added, "
                 "weight exactly 0)")
    else:
        title = (f"{ph.name}: the new queries' rows [{new_rows}, {len(ph.layers[0].key_pos)}] "
                 f"(red), computed against the cached keys\nfaded rows: the full [{size}, {size}] "
                 f"recompute, for reference (the {ph.name} does not compute them)")
    fig.suptitle(title, fontsize=9)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="weight")
    path = out / f"attention_{ph.kind if ph.kind == 'prefill' else f'{ph.kind}_{ph.index}'}.png"
    fig.savefig(path, dpi=120)
    return path


def _plot_cache(trace: Trace, seq, label, out: pathlib.Path) -> pathlib.Path:
    """One panel per phase: layers x cache positions, colored by writing step."""
    from matplotlib.colors import ListedColormap

    n_layers, size = trace.config.num_layers, trace.max_seq_len
    phases = trace.phases
    colors = ListedColormap(_weights_cmap()(np.linspace(0.15, 0.9, max(len(phases), 2))))
    colors = colors.with_extremes(bad="#f0f0f0")
    writer = np.full((n_layers, size), -1)
    fig, axes = _figure(len(phases), 1, (max(4.0, min(0.7 * size, 14.0) + 2.5),
                                         (min(0.35 * n_layers, 6.0) + 1.0) * len(phases) + 0.6))
    annotate = size <= 16 and n_layers <= 8
    tags = [{"prefill": "prefill", "chunk": f"chunk {ph.index}", "verify": "verify",
             "decode": f"step {ph.index}"}[ph.kind] for ph in phases]
    for i, (ax, ph) in enumerate(zip(axes[:, 0], phases)):
        for lt in ph.layers:
            for p in ph.positions:
                writer[lt.layer, p] = i
        shown = np.ma.masked_array(writer, writer < 0)
        ax.imshow(shown, cmap=colors, vmin=-0.5, vmax=len(phases) - 0.5, aspect="auto")
        for r, c in zip(*np.nonzero(writer < 0)):
            ax.add_patch(_hatched_cell(c, r))
        if annotate:
            for r, c in zip(*np.nonzero(writer >= 0)):
                tag = tags[writer[r, c]]
                ax.text(c, r, f"{label(seq[c])}\n{tag}", ha="center", va="center", fontsize=7,
                        color="white" if writer[r, c] == 0 else "black")
        ax.set_yticks(range(n_layers))
        ax.set_yticklabels([f"layer {i}" for i in range(n_layers)], fontsize=7)
        ax.set_xticks(range(size))
        ax.set_xticklabels([f"{i}\n{label(seq[i])}" if i < ph.length_after and size <= 16
                            else str(i) for i in range(size)], fontsize=7)
        ax.set_title(f"after {ph.name}: cache.lengths = {ph.length_after} of {size}", fontsize=9)
    axes[-1, 0].set_xlabel("cache position (hatched = empty, zeros)", fontsize=8)
    fig.suptitle("KV cache filling up (color = the call that wrote the slot)", fontsize=10)
    path = out / "cache.png"
    fig.savefig(path, dpi=120)
    return path


