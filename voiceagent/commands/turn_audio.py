"""`voiceagent report --turn CALL:N`: a turn as it sounded, drawn from its call's recording (caller
above, bot below) with its stages marked where the dashboard marks them
(`voiceagent.dashboard.stats.recording_marks`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile

from voiceagent.config import Config
from voiceagent.dashboard.stats import recording_marks
from voiceagent.pipeline.recording import recording_path, recordings_dir, started_at

COLOURS = {"speech end": "#1f77b4", "hangover": "#9467bd", "first audio": "#2ca02c",
           "barge-in": "#d62728"}
BEFORE_S, AFTER_S = 1.0, 2.5  # around the turn: before the caller's speech, after its last mark


def parse_turn(text: str) -> tuple[str, int]:
    call_id, _, turn = text.rpartition(":")
    if not call_id or not turn.isdigit():
        raise ValueError(f"--turn {text!r}: write it CALL_ID:N, e.g. 3f2a9c1b7d4e:2")
    return call_id, int(turn)


def draw_turn_audio(cfg: Config, call_id: str, turn: int, path: Path, dpi: int) -> str:
    """Draw the turn into `path` (PNG); returns its caption. ValueError: no such call, turn or
    recording."""
    from matplotlib.figure import Figure

    from voiceagent.dashboard.store import open_store

    store = open_store(cfg, retain=False)
    try:
        found = store.call(call_id)
    finally:
        store.close()
    if found is None:
        raise ValueError(f"--turn {call_id}:{turn}: no call {call_id!r} in the store")
    wav = recording_path(recordings_dir(cfg), call_id)
    start = started_at(wav) if wav is not None and wav.is_file() else None
    if start is None:
        raise ValueError(f"--turn {call_id}:{turn}: the call has no recording "
                         f"(store.audio records calls, into {recordings_dir(cfg)})")
    [record] = [t for t in found["turns"] if t["turn"] == turn] or [None]
    if record is None:
        raise ValueError(f"--turn {call_id}:{turn}: the call has turns "
                         f"{', '.join(str(t['turn']) for t in found['turns']) or 'none'}")
    marks = [m for m in recording_marks(found["turns"], start) if m["turn"] == turn]
    stereo, rate = soundfile.read(wav, dtype="float32", always_2d=True)
    lo = max(0.0, record["started_at"] - start - BEFORE_S)
    hi = min(len(stereo) / rate, max([m["s"] for m in marks], default=lo) + AFTER_S)
    part = stereo[int(lo * rate):int(hi * rate)]
    t = lo + np.arange(len(part)) / rate
    fig = Figure(figsize=(10, 3.4), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    for ax, channel, name, colour in ((axes[0], 0, "caller", "#4a6fa5"),
                                      (axes[1], 1, "bot", "#e08a2c")):
        ax.plot(t, part[:, min(channel, part.shape[1] - 1)], color=colour, linewidth=0.5)
        ax.set_ylabel(name)
        ax.set_ylim(-1, 1)
        ax.set_yticks([])
        for m in marks:
            ax.axvline(m["s"], color=COLOURS[m["mark"]], linewidth=1.5,
                       label=m["mark"] if channel == 0 else None)
    axes[0].legend(loc="upper right", fontsize=8, ncols=len(marks) or 1)
    axes[1].set_xlabel("seconds into the call's recording")
    fig.savefig(path, dpi=dpi)
    clock3 = (record.get("clocks") or {}).get("turn_end_to_first_audio_ms")
    heard = f"{clock3:.0f} ms" if clock3 is not None else "no audio"
    return (f"Turn {turn} of call {call_id}: \"{record.get('user_text', '')}\" → "
            f"\"{record.get('bot_text', '')}\"; the caller stopped speaking, the VAD's hangover "
            f"ended, and the bot's first audio came {heard} after the speech end.")
