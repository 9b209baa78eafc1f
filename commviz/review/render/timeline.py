"""``commviz preview MERGED.pftrace -o timeline.png``: the merged trace as one picture.

What the Perfetto UI shows of a multi-rank run, drawn without it, for a README, a report or a
glance over ssh: the ranks one under another, in each a comm lane per process group holding its
collectives as boxes coloured and labelled by op, a lighter lane of the rank's compute (GPU
kernels other than NCCL's; on a CPU-only rank, the main thread's top-level ops), and a line
joining the same collective instance on consecutive ranks (the merged trace's cross-rank flows),
so a late rank shows as a slanted line. Time is in ms since the trace's first collective, the
origin ``commviz merge --window`` counts from.

The trace is read with the project's one reader (``commviz.write.read``), streamed without args:
the drawing needs each slice's track, times, name and flow ids only, and of the tracks drawn only
(a rank's other threads, the cross-rank summaries and counters are passed over unread). By
default the picture shows the first profiler step holding a collective (``ProfilerStep#N`` on
the ranks' main threads), else the first ``DEFAULT_INSTANCES`` collective instances, and at
most ``MAX_RANKS`` ranks, so it stays readable for any run.

A trace of more than ``WHOLE_MAX_BYTES`` is drawn from what the window needs (``read_window``):
a first pass reads the comm lanes and the main threads' first ``SCAN_STEPS`` profiler steps
and chooses the window; a second keeps only the slices of that window and stops reading each
track once it is past it (every track's slices are written in time order). The picture is the
one the whole read gives.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from commviz.errors import CommvizError, SourceError
from commviz.merge.core import MERGED_NAME
from commviz.merge.keep import STEP_PREFIX, parse_window
from commviz.merge.piece import (CROSS_FLOW_BIT, LANE_KEY, ORDER_OTHER, ORDER_STREAM,
                                 ORDER_THREAD, PID_BASE)
from commviz.merge.select import format_ranks
from commviz.kernels import COMM, GPU_WORK_CATS, classify
from commviz.write.read import (BEGIN, END, INSTANT, Decoder, Event, Track, iter_packet_batches,
                                pair)

TIMELINE_PNG = "timeline.png"
MAX_RANKS = 16              # ranks drawn by default: beyond, rows get too thin to read
DEFAULT_INSTANCES = 40      # without profiler steps: the window holding the first N instances
WIDTH_IN, ROW_IN, DPI = 12.0, 0.38, 110    # legible at a README's width (~900 px)
# Traces up to this size are read whole (the reader takes about 30 s for 25 MB of every track);
# past it, only what the window needs (``read_window``).
WHOLE_MAX_BYTES = 16 << 20
SCAN_STEPS = 3              # profiler steps per main thread the window is chosen among
LABEL_PX = 7.1              # pixels per character of a box label (font size 8)
COMPUTE_COLOUR = "#c9ccd1"
# Ops in a fixed order, so an op keeps its colour from one picture to the next.
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#17becf", "#bcbd22", "#7f7f7f", "#393b79", "#ad494a", "#637939", "#843c39")


@dataclass
class Lane:
    """One row of the picture."""

    rank: int
    title: str                  # "PG tp · ranks [0, 1]", "GPU kernels", "CPU ops (main thread)"
    comm: bool
    order: int
    boxes: list[tuple[int, int, str, tuple[int, ...]]] = field(default_factory=list)


@dataclass
class Timeline:
    """What a merged trace holds for the picture, per rank (times in trace ns)."""

    ranks: dict[int, str]                       # rank -> process name
    lanes: list[Lane]
    steps: dict[int, dict[int, tuple[int, int]]]    # step number -> rank -> (start, end)
    origin_ns: int | None                       # the first collective's start

    def comm_boxes(self) -> list[tuple[int, int, str, tuple[int, ...]]]:
        return [b for lane in self.lanes if lane.comm for b in lane.boxes]


@dataclass(frozen=True)
class Window:
    """What is drawn: slices starting in ``[lo, hi)`` (trace ns), or for a profiler step, in
    each rank's own range of it (``per_rank``), as ``commviz merge --steps`` keeps them."""

    lo: int
    hi: int
    what: str
    per_rank: dict[int, tuple[int, int]] | None = None

    def holds(self, rank: int, ns: int) -> bool:
        lo, hi = (self.lo, self.hi) if self.per_rank is None else self.per_rank.get(rank, (0, 0))
        return lo <= ns < hi


def step_window(tl: Timeline, step: int) -> Window:
    ranges = tl.steps[step]
    return Window(min(lo for lo, _ in ranges.values()), max(hi for _, hi in ranges.values()),
                  f"{STEP_PREFIX}{step}", dict(ranges))


@dataclass
class PreviewResult:
    """What was drawn: the file, the ranks and window shown, and counts of what is in it."""

    out: Path
    ranks: list[int]
    window_ms: tuple[float, float]
    window_ns: tuple[int, int]                  # the same window in trace time
    collectives: int                            # comm-lane boxes drawn
    compute: int                                # compute boxes drawn
    flows: int                                  # cross-rank lines drawn
    what: str                                   # "ProfilerStep#2", "window 1:5 ms", ...
    hidden_ranks: int = 0


_LANE, _GPU, _MAIN = "lane", "gpu", "main"     # the kinds of track the picture draws
_DRAWN = frozenset({_LANE, _GPU, _MAIN})


def _kinds(tracks: dict[int, Track]) -> tuple[dict[int, int], dict[int, tuple[int, str]]]:
    """The rank of each rank process track, and (rank, kind) of each track the picture draws:
    a comm lane, a GPU stream, or the rank's main thread (its first CPU thread)."""
    ranks = {u: t.pid - PID_BASE for u, t in tracks.items()
             if t.pid is not None and t.pid >= PID_BASE}
    kind: dict[int, tuple[int, str]] = {}
    main: dict[int, tuple[int, int]] = {}           # rank -> (order, track) of its first thread
    for u, t in tracks.items():
        rank = ranks.get(t.parent) if t.parent is not None else None
        if rank is None or t.counter:
            continue
        order = t.order_rank if t.order_rank is not None else ORDER_OTHER
        if t.merge_key and t.merge_key.startswith(LANE_KEY):
            kind[u] = (rank, _LANE)
        elif ORDER_STREAM <= order < ORDER_THREAD:
            kind[u] = (rank, _GPU)
        elif ORDER_THREAD <= order < ORDER_OTHER:
            main[rank] = min(main.get(rank, (order, u)), (order, u))
    for rank, (_, u) in main.items():
        kind[u] = (rank, _MAIN)
    return ranks, kind


@dataclass
class _Read:
    """One pass over a trace: the events kept, the tracks, and what was passed over."""

    decoder: Decoder
    events: list[Event]
    problems: list[str]
    read: int = 0                  # packets decoded
    passed: int = 0                # packets of tracks not needed, passed over unread
    stale: bool = False            # a track was passed over as a kind it turned out not to be


def _read(path: Path, want: frozenset[str], window: Window | None = None,
          steps: int | None = None, pass_over: bool = True) -> _Read:
    """The events of the tracks of the kinds in ``want``, in one pass.

    A packet sequence (one track each, in commviz's writer) is decided on its first packet,
    whose track the descriptors before it declare: a track not drawn is passed over unread
    (``pass_over``). With ``window``, only the slices beginning in it (and those nested in them)
    are kept, and a track is left once a slice begins past it. ``steps``: of a main thread only
    its profiler steps are kept, and it is left after that many. ``stale`` says a track was
    decided on descriptors that later ones changed (a rank's first thread declared after)."""
    problems: list[str] = []
    decoder = Decoder(lambda p, warn: None if warn else problems.append(str(p)), args=False)
    out = _Read(decoder, [], problems)
    decided: dict[int, bool] = {}                   # sequence -> read it
    chosen: dict[int, bool] = {}                    # track -> drawn, when its sequence was decided
    kind: dict[int, tuple[int, str]] = {}
    known = 0                                       # descriptors ``kind`` was made from
    open_kept: dict[int, int] = defaultdict(int)    # track -> slices kept and still open
    depth: dict[int, int] = defaultdict(int)        # main thread -> slices open (``steps``)
    done_steps: dict[int, int] = defaultdict(int)
    for offs, packets in iter_packet_batches(path):
        for off, packet in zip(offs, packets):
            seq = packet.trusted_packet_sequence_id
            if decided.get(seq) is False:
                out.passed += 1
                continue
            out.read += 1
            record = decoder.packet(packet, off)
            if len(decoder.tracks) != known:
                known, kind = len(decoder.tracks), _kinds(decoder.tracks)[1]
            if seq not in decided and pass_over:
                st = decoder.seqs.get(seq)
                uuid = record.track if isinstance(record, Event) else (
                    st.default_track if st is not None else None)
                if uuid is not None and uuid in decoder.tracks:
                    k = kind.get(uuid)
                    decided[seq] = chosen[uuid] = k is not None and k[1] in want
            if not isinstance(record, Event) or record.type not in (BEGIN, END, INSTANT):
                continue
            track, ts, typ = record.track, record.ts, record.type
            k = kind.get(track)
            if k is None or k[1] not in want:
                continue
            if steps is not None and k[1] == _MAIN:
                if typ == BEGIN:
                    depth[track] += 1
                    if depth[track] == 1 and (record.name or "").startswith(STEP_PREFIX):
                        open_kept[track] += 1
                        out.events.append(record)
                elif typ == END:
                    depth[track] -= 1
                    if depth[track] == 0 and open_kept[track]:
                        open_kept[track] -= 1
                        out.events.append(record)
                        done_steps[track] += 1
                        if done_steps[track] >= steps and pass_over:
                            decided[seq] = False    # enough steps to choose the window from
            elif window is None:
                out.events.append(record)
            elif typ == BEGIN:
                if open_kept[track] or window.lo <= ts < window.hi:
                    open_kept[track] += 1
                    out.events.append(record)
                elif ts >= window.hi and pass_over and chosen.get(track):
                    decided[seq] = False            # past the window: the rest is not needed
            elif typ == END:
                if open_kept[track]:
                    open_kept[track] -= 1
                    out.events.append(record)
            elif window.lo <= ts < window.hi:
                out.events.append(record)
    final = _kinds(decoder.tracks)[1]
    out.stale = any(drawn != (final.get(u) is not None and final[u][1] in want)
                    for u, drawn in chosen.items())
    return out


def read_timeline(path: str | Path) -> Timeline:
    """The rank processes, comm lanes, compute and profiler steps of a merged trace."""
    path = Path(path)
    got = _read(path, _DRAWN)
    return _timeline(path, got if not got.stale else _read(path, _DRAWN, pass_over=False))


def read_window(path: str | Path, window_ms: tuple[float, float] | None = None
                ) -> tuple[Timeline, Window, _Read]:
    """What the picture of one window needs, read in two passes (the module docstring): the
    window ``window_ms`` (ms since the trace's first collective), else ``default_window`` of
    the comm lanes and the first ``SCAN_STEPS`` profiler steps."""
    path = Path(path)
    first = _read(path, frozenset({_LANE, _MAIN}), steps=SCAN_STEPS)
    if first.stale:
        first = _read(path, frozenset({_LANE, _MAIN}), steps=SCAN_STEPS, pass_over=False)
    scan = _timeline(path, first)
    origin = scan.origin_ns
    if window_ms is not None:
        base = origin if origin is not None else min(
            (b[0] for ln in scan.lanes for b in ln.boxes), default=0)
        window = Window(base + round(window_ms[0] * 1e6), base + round(window_ms[1] * 1e6),
                        f"window {window_ms[0]:g}:{window_ms[1]:g} ms")
    else:
        window = default_window(scan)
    second = _read(path, _DRAWN, window=window)
    if second.stale:
        second = _read(path, _DRAWN, window=window, pass_over=False)
    second.read += first.read
    second.passed += first.passed
    tl = _timeline(path, second)
    tl.origin_ns = origin if origin is not None else tl.origin_ns
    return tl, window, second


def _timeline(path: Path, got: _Read) -> Timeline:
    """The picture's lanes and steps from one pass's events."""
    events, problems = got.events, got.problems
    tracks: dict[int, Track] = got.decoder.tracks
    ranks, kinds = _kinds(tracks)
    if not ranks:
        raise SourceError(str(path), "no rank processes: not a trace `commviz merge` wrote"
                          + (f" ({problems[0]})" if problems else ""))
    kind = {u: (rank, "thread" if what == _MAIN else what) for u, (rank, what) in kinds.items()}
    main = {rank: tracks[u].order_rank for u, (rank, what) in kinds.items() if what == _MAIN}
    names: dict[str | None, int] = {None: -1}
    track_ix: dict[int, int] = {}
    p = pair([track_ix.setdefault(e.track, len(track_ix)) for e in events], [e.ts for e in events],
             [e.type for e in events], [names.setdefault(e.name, len(names) - 1) for e in events])
    lanes: dict[tuple[int, str], Lane] = {}
    cpu: dict[int, list[tuple[int, int, str, int]]] = defaultdict(list)   # rank -> (s, e, n, d)
    steps: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)
    gpu_ranks: set[int] = set()
    for i, ev in enumerate(events):
        if ev.type != BEGIN or p.partner[i] < 0 or ev.track not in kind:
            continue
        rank, what = kind[ev.track]
        end, name = events[int(p.partner[i])].ts, ev.name or "?"
        t = tracks[ev.track]
        if what == "lane":
            lane = lanes.setdefault((rank, t.merge_key or ""), Lane(
                rank, t.title, True, t.order_rank or 0))
            lane.boxes.append((ev.ts, end, name, ev.flow_ids))
        elif what == "gpu":
            gpu_ranks.add(rank)
            if ev.category in GPU_WORK_CATS and classify(name, ev.category) != COMM:
                lanes.setdefault((rank, "gpu"), Lane(rank, "GPU kernels (compute)", False,
                                                     ORDER_STREAM)).boxes.append(
                    (ev.ts, end, name, ()))
        elif t.order_rank == main.get(rank):
            if name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX):].isdigit():
                steps[int(name[len(STEP_PREFIX):])][rank] = (ev.ts, end)
            else:
                cpu[rank].append((ev.ts, end, name, int(p.depth[i])))
    for rank, ops in cpu.items():
        if rank in gpu_ranks:
            continue
        # top-level ops: outside a profiler step at depth 0, inside one at depth 1
        spans = [r[rank] for r in steps.values() if rank in r]
        lane = Lane(rank, "CPU ops (main thread)", False, ORDER_THREAD)
        for s, e, name, depth in ops:
            inside = any(lo <= s < hi for lo, hi in spans)
            if depth == (1 if inside else 0):
                lane.boxes.append((s, e, name, ()))
        if lane.boxes:
            lanes[(rank, "cpu")] = lane
    starts = [b[0] for lane in lanes.values() if lane.comm for b in lane.boxes]
    procs = {rank: tracks[u].title for u, rank in ranks.items()}
    return Timeline(ranks=procs, lanes=sorted(lanes.values(), key=lambda ln: (ln.rank, ln.order,
                                                                              ln.title)),
                    steps=dict(steps),
                    origin_ns=min(starts) if starts else None)


def default_window(tl: Timeline) -> Window:
    """The first profiler step with a collective in it (on any rank, in that rank's range of
    the step); else the first ``DEFAULT_INSTANCES`` instances of the profiled part (where the
    compute lanes have slices: a record also holds the collectives made before the profiler
    ran); else everything."""
    comm = [(lane.rank, b[0]) for lane in tl.lanes if lane.comm for b in lane.boxes]
    for n in sorted(tl.steps):
        window = step_window(tl, n)
        if any(window.holds(rank, ns) for rank, ns in comm):
            return window
    boxes = sorted(tl.comm_boxes())
    compute = [b for lane in tl.lanes if not lane.comm for b in lane.boxes]
    profiled = False
    if compute:
        lo, hi = min(b[0] for b in compute), max(b[1] for b in compute)
        inside = [b for b in boxes if lo <= b[0] < hi]
        boxes, profiled = (inside, True) if inside else (boxes, False)
    if boxes:
        instances: dict[tuple, int] = {}
        for s, _, _, flows in boxes:
            instances.setdefault(flows or (s,), s)
        firsts = sorted(instances.values())
        last = firsts[min(len(firsts), DEFAULT_INSTANCES) - 1]
        end = max(e for s, e, _, _ in boxes if s <= last)
        what = (f"the first {DEFAULT_INSTANCES} collectives" if len(firsts) > DEFAULT_INSTANCES
                else "the profiled collectives" if profiled else "every collective")
        return Window(boxes[0][0], max(end, last + 1), what)
    if not compute:
        raise CommvizError("the trace holds no collective and no compute to draw")
    return Window(min(b[0] for b in compute), max(b[1] for b in compute) + 1, "the whole trace")


def _colours(ops: set[str]) -> dict[str, str]:
    return {op: _PALETTE[i % len(_PALETTE)] for i, op in enumerate(sorted(ops))}


def _short(title: str) -> str:
    """A lane's row label: "PG tp · ranks [0, 1]" -> "PG tp [0, 1]"; long rank lists cut."""
    text = title.replace(" · ranks ", " ")
    return text if len(text) <= 30 else text[:28] + "…]"


def draw(tl: Timeline, out: str | Path, *, window: Window | None = None,
         ranks: list[int] | None = None) -> PreviewResult:
    """Draw ``tl`` into the PNG ``out``: ``window`` (default ``default_window``) and ``ranks``
    (default the first ``MAX_RANKS``)."""
    from matplotlib.collections import LineCollection, PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.transforms import blended_transform_factory

    window = window if window is not None else default_window(tl)
    lo, hi, what = window.lo, window.hi, window.what
    every = sorted(tl.ranks)
    if ranks is None:
        shown = every[:MAX_RANKS]
    else:
        missing = sorted(set(ranks) - set(every))
        if missing:
            raise CommvizError(f"--ranks: rank(s) {format_ranks(missing)} not in this trace "
                               f"(it holds {format_ranks(every)})")
        shown = sorted(ranks)
    origin = tl.origin_ns if tl.origin_ns is not None else lo
    pad = max((hi - lo) // 60, 1)
    x0, x1 = -pad / 1e6, (hi - lo + pad) / 1e6

    def ms(ns: int) -> float:                   # x: ms since the window's start
        return (ns - lo) / 1e6

    rows: list[tuple[float, Lane]] = []          # (y of the row's centre, lane); y grows down
    headers: list[tuple[float, int]] = []
    y = 0.0
    for rank in shown:
        headers.append((y, rank))
        y += 0.9
        for lane in (ln for ln in tl.lanes if ln.rank == rank):
            rows.append((y, lane))
            y += 1.0
        y += 0.2
    height = y - 0.2
    ops = {b[2] for _, lane in rows if lane.comm for b in lane.boxes
           if window.holds(lane.rank, b[0])}
    colour = _colours(ops)
    n_legend = len(ops) + 2
    legend_rows = -(-n_legend // 5)
    top_in, bottom_in, plot_in = 0.5 + 0.24 * legend_rows, 0.6, ROW_IN * (height + 0.5)
    fig_h = top_in + bottom_in + plot_in
    fig = Figure(figsize=(WIDTH_IN, fig_h))
    left, width = 0.14, 0.84
    ax = fig.add_axes((left, bottom_in / fig_h, width, plot_in / fig_h))
    ax.set_xlim(x0, x1)
    ax.set_ylim(height, -0.5)
    px_per_ms = WIDTH_IN * width * DPI / (x1 - x0)
    polys: list = []
    faces: list[str] = []
    comm_n = compute_n = 0
    where: dict[int, list[tuple[int, float, float]]] = defaultdict(list)   # flow -> (rank, x, y)
    for yc, lane in rows:
        h = 0.72 if lane.comm else 0.5
        for s, e, name, flows in lane.boxes:
            if not window.holds(lane.rank, s):
                continue
            a, b = ms(s), ms(e)
            polys.append([(a, yc - h / 2), (b, yc - h / 2), (b, yc + h / 2), (a, yc + h / 2)])
            faces.append(colour[name] if lane.comm else COMPUTE_COLOUR)
            if lane.comm:
                comm_n += 1
                for f in flows:
                    if f & CROSS_FLOW_BIT:
                        where[f].append((lane.rank, a, yc))
            else:
                compute_n += 1
            b = min(b, x1)
            text = name if len(name) <= 26 else name[:25] + "…"
            if (b - a) * px_per_ms > LABEL_PX * len(text) + 6:
                ax.text((a + b) / 2, yc, text, ha="center", va="center", fontsize=8,
                        clip_on=True, color="white" if lane.comm else "#333333")
    # a box narrower than a pixel still shows: every box gets an edge in its own colour
    ax.add_collection(PolyCollection(polys, facecolors=faces, edgecolors=faces, linewidths=0.6))
    segments = []
    for ends in where.values():
        ends.sort()
        for (_, xa, ya), (_, xb, yb) in zip(ends, ends[1:]):
            segments.append([(xa, ya + 0.36), (xb, yb - 0.36)])
    alpha = 0.6 if len(segments) <= 100 else 0.35      # many links: keep the boxes readable
    ax.add_collection(LineCollection(segments, colors="#222222", linewidths=0.8, alpha=alpha))
    top = blended_transform_factory(ax.transData, ax.transAxes)
    for n in sorted(tl.steps):
        step = step_window(tl, n)
        s, e = step.lo, step.hi
        if s < hi + pad and e > lo - pad:
            for t in (s, e):
                if lo - pad <= t <= hi + pad:
                    ax.axvline(ms(t), color="#888888", linestyle=":", linewidth=0.8)
            if s < hi:
                ax.text(max(ms(s), x0), 1.0, f" {STEP_PREFIX}{n}", transform=top, fontsize=8,
                        color="#555555", va="bottom")
    for yh, rank in headers:
        ax.axhspan(yh - 0.42, yh + 0.42, color="#e8ebef", zorder=0)
        ax.text(x0, yh, "  " + tl.ranks[rank], fontsize=9.5, fontweight="bold", va="center")
    ax.set_yticks([yc for yc, _ in rows], [_short(lane.title) for _, lane in rows], fontsize=8.5)
    ax.tick_params(axis="y", length=0)
    for label, (_, lane) in zip(ax.get_yticklabels(), rows):
        label.set_color("#111111" if lane.comm else "#777777")
    ax.set_xlabel(f"ms since the window's start ({(lo - origin) / 1e6:.3f} ms after the "
                  "trace's first collective)", fontsize=9)
    ax.tick_params(axis="x", labelsize=9)
    ax.grid(axis="x", alpha=0.25)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    handles = [Patch(color=colour[op], label=op) for op in sorted(ops)]
    handles += [Patch(color=COMPUTE_COLOUR, label="compute (GPU kernels, or CPU ops)"),
                Line2D([], [], color="#222222", alpha=alpha,
                       label="same collective, next rank")]
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(left, 1 - 0.38 / fig_h),
               ncol=5, fontsize=8.5, frameon=False, borderaxespad=0, columnspacing=1.5)
    hidden = len(every) - len(shown)
    ranks_text = (f"ranks {format_ranks(shown)} of {len(every)}"
                  + (f" ({hidden} not shown: --ranks)" if hidden else ""))
    fig.text(left, 1 - 0.12 / fig_h, f"commviz timeline: {ranks_text}; {what or 'window'}, "
             f"{(hi - lo) / 1e6:.3g} ms; {comm_n} collectives, {len(segments)} cross-rank "
             "links", fontsize=11, va="top")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    return PreviewResult(out=out, ranks=shown, window_ms=((lo - origin) / 1e6,
                                                          (hi - origin) / 1e6),
                         window_ns=(lo, hi), collectives=comm_n, compute=compute_n,
                         flows=len(segments), what=what, hidden_ranks=hidden)


def write_preview(trace: str | Path, out: str | Path, *, window: str | None = None,
                  ranks: list[int] | None = None,
                  whole_max_bytes: int = WHOLE_MAX_BYTES) -> PreviewResult:
    """Read the merged ``trace`` and draw it into ``out``; ``window``: ``"T0:T1"``, ms since
    the trace's first collective (as ``commviz merge --window``). A trace of more than
    ``whole_max_bytes`` is read for its window only (``read_window``)."""
    window_ms = (parse_window(window).window_ms or (0.0, 0.0)) if window is not None else None
    if Path(trace).stat().st_size > whole_max_bytes:
        tl, chosen, _ = read_window(trace, window_ms)
        return draw(tl, out, window=chosen, ranks=ranks)
    tl = read_timeline(trace)
    if window_ms is None:
        return draw(tl, out, ranks=ranks)
    t0, t1 = window_ms
    origin = tl.origin_ns or min((b[0] for ln in tl.lanes for b in ln.boxes), default=0)
    return draw(tl, out, window=Window(origin + round(t0 * 1e6), origin + round(t1 * 1e6),
                                       f"window {t0:g}:{t1:g} ms"), ranks=ranks)


def report_timeline(run_dir: Path, plots_dir: Path, whole_max_bytes: int = WHOLE_MAX_BYTES
                    ) -> tuple[list[Path], list[str]]:
    """For ``commviz report``: RUN_DIR/merged.pftrace, whatever its size, drawn into
    ``plots_dir``; (the PNG written, or none; the problem that stopped it)."""
    trace = Path(run_dir) / MERGED_NAME
    if not trace.is_file():
        return [], []
    try:
        return [write_preview(trace, Path(plots_dir) / TIMELINE_PNG,
                              whole_max_bytes=whole_max_bytes).out], []
    except CommvizError as exc:
        return [], [f"timeline: not drawn: {exc}"]
