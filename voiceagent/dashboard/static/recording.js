// A call's recording on the dashboard: both channels' waveforms (caller above, bot below) with
// each turn's stages marked, and playback from a turn. Everything is drawn here from the WAV
// the server sends (no library, nothing from a CDN); turns are placed by their wall-clock start
// against the recording's (`X-Recording-Started-At`).
"use strict";

const MARKS = [
  // [name, colour, seconds on the recording of a turn t (null: no mark)]
  ["speech end", "#1f77b4", (t, at) => at(t, "breakdown.user_speech_ms")],
  ["hangover", "#9467bd", (t, at) => at(t, "breakdown.user_speech_ms", "breakdown.vad_hangover_ms")],
  ["first audio", "#2ca02c", (t, at) => at(t, "breakdown.user_speech_ms",
    "clocks.turn_end_to_first_audio_ms")],
];
const BARGE_IN = "#d62728";

const recording = { url: null, startedAt: null, turns: [], audio: null };

function recordingSeconds(t, ...paths) {
  // A turn's start plus the named durations (ms), on the recording's clock; null if any is missing.
  if (recording.startedAt == null || !isNum(t.started_at)) return null;
  let s = t.started_at - recording.startedAt;
  for (const p of paths) {
    const v = get(t, p);
    if (!isNum(v)) return null;
    s += v / 1000;
  }
  return s;
}

function turnMarks(turns) {
  const marks = [];
  turns.forEach((t, i) => {
    for (const [name, colour, where] of MARKS) {
      const s = where(t, recordingSeconds);
      if (s != null) marks.push({ turn: t.turn, name, colour, s });
    }
    const next = turns[i + 1];
    if (t.interrupted && next) {
      const s = recordingSeconds(next); // the caller's speech over the bot
      if (s != null) marks.push({ turn: t.turn, name: "barge-in", colour: BARGE_IN, s });
    }
  });
  return marks;
}

function drawWaveform(canvas, buffer, marks) {
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  ctx.clearRect(0, 0, width, height);
  const lanes = [buffer.getChannelData(0),
    buffer.numberOfChannels > 1 ? buffer.getChannelData(1) : new Float32Array(0)];
  const laneH = height / 2;
  lanes.forEach((data, lane) => {
    ctx.fillStyle = lane === 0 ? "#4a6fa5" : "#e08a2c";
    const mid = laneH * lane + laneH / 2;
    const per = Math.max(1, Math.floor(data.length / width));
    for (let x = 0; x < width; x++) {
      let peak = 0;
      for (let i = x * per; i < Math.min(data.length, (x + 1) * per); i++) {
        peak = Math.max(peak, Math.abs(data[i]));
      }
      const h = Math.max(1, peak * laneH * 0.9);
      ctx.fillRect(x, mid - h / 2, 1, h);
    }
  });
  ctx.fillStyle = "#555";
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillText("caller", 4, 12);
  ctx.fillText("bot", 4, laneH + 12);
  for (const m of marks) {
    const x = Math.round((m.s / buffer.duration) * width);
    ctx.fillStyle = m.colour;
    ctx.fillRect(x, 0, 2, height);
  }
  canvas.dataset.marks = String(marks.length);
  canvas.dataset.drawn = "1";
}

async function showRecording(callId, turns) {
  const box = $("recording");
  const canvas = $("waveform");
  const audio = $("call-audio");
  if (recording.url) URL.revokeObjectURL(recording.url);
  Object.assign(recording, { url: null, startedAt: null, turns: [] });
  canvas.dataset.drawn = "";
  audio.removeAttribute("src");
  const res = await fetch(`/api/calls/${encodeURIComponent(callId)}/audio`);
  if (res.status === 404) {
    box.hidden = true;
    $("recording-none").hidden = false;
    return;
  }
  if (!res.ok) throw new Error(`recording of ${callId}: HTTP ${res.status}`);
  const bytes = await res.arrayBuffer();
  if ($("call-detail").dataset.callId !== callId) return; // another call was opened meanwhile
  const started = parseFloat(res.headers.get("X-Recording-Started-At"));
  Object.assign(recording, { startedAt: isNum(started) ? started : null, turns });
  recording.url = URL.createObjectURL(new Blob([bytes], { type: "audio/wav" }));
  audio.src = recording.url;
  box.hidden = false;
  $("recording-none").hidden = true;
  const decoded = await new OfflineAudioContext(1, 1, 8000).decodeAudioData(bytes.slice(0));
  const marks = turnMarks(turns);
  drawWaveform(canvas, decoded, marks);
  const legend = [...MARKS.map(([name, colour]) => [name, colour]), ["barge-in", BARGE_IN]];
  $("recording-legend").replaceChildren(...legend.map(([name, colour]) =>
    el("span", { class: "mark", style: `border-color: ${colour}` }, name)));
}

function playTurn(turnNumber) {
  // From a second before the caller stopped speaking, so the wait is heard from its start.
  const t = recording.turns.find((x) => x.turn === turnNumber);
  const end = t && recordingSeconds(t, "breakdown.user_speech_ms");
  if (end == null || !recording.url) return;
  const audio = $("call-audio");
  audio.currentTime = Math.max(0, end - 1);
  audio.play().catch(() => {}); // a browser may refuse sound before a gesture: the seek stands
  $("waveform").dataset.playingTurn = String(turnNumber);
}
