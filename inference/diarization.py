"""Speaker diarization arithmetic: windows over speech, clustering of their embeddings, speaker turns.

Pure functions (numpy and scipy, no Django, no Redis): ``inference.services``
runs the models (``silero_vad`` for speech regions, ``speaker_embedding`` for
one embedding per window) and calls these in between.

Method:

1. :func:`speech_windows` cuts every speech region into windows of
   ``window_s`` every ``hop_s`` (a region shorter than a window is one window;
   the last window of a region ends at the region's end); :func:`bounded_windows`
   widens the hop until the windows fit the embedding step's limits (its
   family's ``segments`` count and total duration), so one diarization embeds
   and clusters a bounded number of windows whatever the audio and ``hop_s``;
2. :func:`cluster` groups the windows' unit embeddings by average-linkage
   agglomerative clustering on cosine distance (``scipy.cluster.hierarchy``):
   into ``num_speakers`` clusters when given, else by cutting the tree at
   ``distance_threshold`` (at most ``max_speakers``);
3. :func:`speaker_turns` gives every 10 ms frame of speech the label of the
   window whose centre is nearest (windows of the same region only), merges
   runs of one label into turns, and names speakers ``SPEAKER_00``,
   ``SPEAKER_01``, … in order of first appearance.

:func:`cluster_and_turn` runs steps 2 and 3 on ``CLUSTER_THREADS`` threads of
their own, off the web event loop: with at most ``n`` windows (the embedding
step's 2,000) the clustering's condensed distance matrix is ``n(n-1)/2``
float64 (16 MB) and the turns need ``O(frames)`` memory.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np

FRAME_S = 0.01  # resolution of the speaker turns, seconds

HOP_GROWTH = 1.25
"""Factor by which :func:`bounded_windows` widens the hop per try (about 30 tries from 0.1 s to 1 h)."""

CLUSTER_THREADS = 2
"""Threads of the web process that cluster and build turns (:func:`cluster_and_turn`): at most this
many run at once, whatever the pipelines' slots (the machine has 2 cores); more wait their turn."""

_CLUSTER_POOL = ThreadPoolExecutor(max_workers=CLUSTER_THREADS, thread_name_prefix="diarize")


class TooManyRegions(ValueError):
    """Even the widest hop leaves more windows than the embedding step takes: too many speech regions
    (each region is at least one window). ``windows`` and ``seconds`` say what the widest hop left."""

    def __init__(self, windows: int, seconds: float):
        super().__init__(f"{windows} windows ({seconds:.0f} s)")
        self.windows = windows
        self.seconds = seconds


def speech_windows(regions: list[tuple[float, float]], window_s: float, hop_s: float) -> list[tuple[float, float, int]]:
    """Embedding windows over speech.

    Args:
        regions: ``(start_s, end_s)`` speech regions, sorted, not overlapping.
        window_s, hop_s: window length and hop in seconds (hop ≤ window).

    Returns:
        ``(start_s, end_s, region index)`` per window, in time order.
    """
    out = []
    for index, (start, end) in enumerate(regions):
        if end - start <= window_s:
            out.append((start, end, index))
            continue
        at = start
        while at + window_s < end:
            out.append((round(at, 4), round(at + window_s, 4), index))
            at += hop_s
        out.append((round(end - window_s, 4), end, index))
    return out


def _span_s(windows: list[tuple[float, float, int]]) -> float:
    return sum(end - start for start, end, _ in windows)


def bounded_windows(regions: list[tuple[float, float]], window_s: float, hop_s: float, *,
                    max_windows: int, max_total_s: float) -> tuple[list[tuple[float, float, int]], float]:
    """:func:`speech_windows` with the hop widened (by ``HOP_GROWTH`` per try) until there are at most
    ``max_windows`` windows lasting at most ``max_total_s`` seconds together.

    Returns:
        ``(windows, hop_s used)``; the hop is ``hop_s`` when the windows fit as asked.

    Raises:
        TooManyRegions: at a hop as long as the longest region (each region is then one or two
            windows, the fewest this method makes) the windows still do not fit.
    """
    longest_s = max((end - start for start, end in regions), default=0.0)
    while True:
        windows = speech_windows(regions, window_s, hop_s)
        if len(windows) <= max_windows and _span_s(windows) <= max_total_s:
            return windows, hop_s
        if hop_s >= longest_s:
            raise TooManyRegions(len(windows), _span_s(windows))
        hop_s = min(hop_s * HOP_GROWTH, max(longest_s, hop_s))


async def cluster_and_turn(windows: list[tuple[float, float, int]], embeddings: np.ndarray,
                           regions: list[tuple[float, float]], *, num_speakers: int | None,
                           distance_threshold: float, max_speakers: int) -> list[dict]:
    """:func:`cluster` then :func:`speaker_turns`, on one of ``CLUSTER_THREADS`` threads (never on the
    calling event loop). Arguments as those functions'; returns the speaker turns."""
    def work() -> list[dict]:
        labels = cluster(embeddings, num_speakers=num_speakers, distance_threshold=distance_threshold,
                         max_speakers=max_speakers)
        return speaker_turns(windows, labels, regions)
    return await asyncio.get_running_loop().run_in_executor(_CLUSTER_POOL, work)


def _nearest(sorted_centres: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Index of the nearest of ``sorted_centres`` (ascending, ``(k,)``) to each of ``points`` (``(m,)``):
    the first index of the nearest value on a tie, as ``np.abs(points[:, None] - centres).argmin(1)``
    gives, in ``O(m log k)`` time and ``O(m)`` memory instead of an ``(m, k)`` matrix."""
    right = np.searchsorted(sorted_centres, points, side="left").clip(0, len(sorted_centres) - 1)
    left = (right - 1).clip(0)
    right_d = np.abs(points - sorted_centres[right])
    left_d = np.abs(points - sorted_centres[left])
    chosen = np.where(left_d <= right_d, left, right)
    # The first index holding the chosen value (equal centres: argmin's first).
    return np.searchsorted(sorted_centres, sorted_centres[chosen], side="left")


def cluster(embeddings: np.ndarray, *, num_speakers: int | None, distance_threshold: float,
            max_speakers: int) -> np.ndarray:
    """Cluster labels (0-based ints, ``(n,)``) of unit embeddings ``(n, d)`` (step 2 of the module docstring)."""
    n = len(embeddings)
    if n == 0:
        return np.zeros(0, dtype=int)
    if n == 1 or num_speakers == 1:
        return np.zeros(n, dtype=int)
    # Imported on the first clustering, not with the module: scipy.cluster costs 0.5 s of import
    # (numbers in docs/benchmarks.md, "Stopping and starting"), which every process importing
    # inference.services (serve, web, worker, each manage.py command) paid at start-up.
    from scipy.cluster.hierarchy import fcluster, linkage

    tree = linkage(embeddings.astype(np.float64), method="average", metric="cosine")
    if num_speakers is not None:
        labels = fcluster(tree, t=min(num_speakers, n), criterion="maxclust")
    else:
        labels = fcluster(tree, t=distance_threshold, criterion="distance")
        if labels.max() > max_speakers:
            labels = fcluster(tree, t=max_speakers, criterion="maxclust")
    return labels.astype(int) - 1


def speaker_turns(windows: list[tuple[float, float, int]], labels: np.ndarray,
                  regions: list[tuple[float, float]]) -> list[dict]:
    """Speaker turns ``[{"speaker", "start_s", "end_s"}]`` in time order (step 3 of the module docstring)."""
    names: dict[int, str] = {}
    turns: list[dict] = []
    by_region: dict[int, list[tuple[float, int]]] = {}
    for (start, end, region), label in zip(windows, labels, strict=True):
        by_region.setdefault(region, []).append(((start + end) / 2, int(label)))
    for index, (start, end) in enumerate(regions):
        centres = by_region.get(index)
        if not centres:
            continue
        centre_s = np.array([c for c, _ in centres])
        centre_labels = np.array([lab for _, lab in centres])
        frame_starts = np.arange(start, end, FRAME_S)
        nearest = _nearest(centre_s, frame_starts + FRAME_S / 2)  # centres ascend: windows are in time order
        frame_labels = centre_labels[nearest]
        run_start = 0
        for i in range(1, len(frame_labels) + 1):
            if i == len(frame_labels) or frame_labels[i] != frame_labels[run_start]:
                label = int(frame_labels[run_start])
                name = names.setdefault(label, f"SPEAKER_{len(names):02d}")
                turn_end = end if i == len(frame_labels) else float(frame_starts[i])
                turns.append({"speaker": name, "start_s": round(float(frame_starts[run_start]), 3),
                              "end_s": round(float(turn_end), 3)})
                run_start = i
    return turns


def speaker_of(start_s: float, end_s: float, turns: list[dict]) -> str | None:
    """The speaker whose turns overlap ``[start_s, end_s]`` the most (the nearest turn when none overlaps;
    None without turns)."""
    if not turns:
        return None
    overlap: dict[str, float] = {}
    for turn in turns:
        shared = min(end_s, turn["end_s"]) - max(start_s, turn["start_s"])
        if shared > 0:
            overlap[turn["speaker"]] = overlap.get(turn["speaker"], 0.0) + shared
    if overlap:
        return max(overlap, key=lambda name: overlap[name])
    middle = (start_s + end_s) / 2
    return min(turns, key=lambda t: min(abs(middle - t["start_s"]), abs(middle - t["end_s"])))["speaker"]


def label_words(asr: dict, turns: list[dict], sample_rate_hz: int) -> dict:
    """Join a transcription (``asr``: the whisper adapter's result with ``words``) and speaker turns.

    Returns:
        ``{"text", "language", "duration", "sample_rate", "segments": [{id, start, end, text,
        start_sample, end_sample, speaker}], "words": [{word, start, end, start_sample,
        end_sample, speaker}], "speaker_turns": turns}``; times in seconds, offsets in samples
        at ``sample_rate_hz`` (end exclusive); ``speaker`` is the speaker whose turns overlap the
        item most (:func:`speaker_of`; None without turns).
    """
    def placed(item: dict) -> dict:
        return {**item, "start_sample": int(round(item["start"] * sample_rate_hz)),
                "end_sample": int(round(item["end"] * sample_rate_hz)),
                "speaker": speaker_of(item["start"], item["end"], turns)}
    return {"text": asr["text"], "language": asr["language"], "duration": asr["duration"],
            "sample_rate": sample_rate_hz, "segments": [placed(seg) for seg in asr["segments"]],
            "words": [placed(word) for word in asr.get("words", [])], "speaker_turns": turns}
