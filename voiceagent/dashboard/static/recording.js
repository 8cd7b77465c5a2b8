// A call's recording on the dashboard: both channels' waveforms (caller above, bot below) with
// each turn's stages marked where the server placed them (`stats.recording_marks`, via
// /api/calls/{id}), and playback from a turn. Drawn here from the WAV the server sends: no
// library, nothing from a CDN.
"use strict";

const MARK_COLOURS = {
  "speech end": "#1f77b4", hangover: "#9467bd", "first audio": "#2ca02c", "barge-in": "#d62728",
};

const recording = { url: null, marks: [] };

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
    ctx.fillStyle = MARK_COLOURS[m.mark] || "#000";
    ctx.fillRect(Math.round((m.s / buffer.duration) * width), 0, 2, height);
  }
  canvas.dataset.marks = String(marks.length);
  canvas.dataset.drawn = "1";
}

async function showRecording(callId, rec) {
  // `rec`: the call's `recording` from /api/calls/{id} (null: not recorded).
  const canvas = $("waveform");
  const audio = $("call-audio");
  if (recording.url) URL.revokeObjectURL(recording.url);
  Object.assign(recording, { url: null, marks: [] });
  canvas.dataset.drawn = "";
  audio.removeAttribute("src");
  $("recording").hidden = !rec;
  $("recording-none").hidden = Boolean(rec);
  if (!rec) return;
  const res = await fetch(`/api/calls/${encodeURIComponent(callId)}/audio`);
  if (!res.ok) throw new Error(`recording of ${callId}: HTTP ${res.status}`);
  const bytes = await res.arrayBuffer();
  if ($("call-detail").dataset.callId !== callId) return; // another call was opened meanwhile
  recording.marks = rec.marks;
  recording.url = URL.createObjectURL(new Blob([bytes], { type: "audio/wav" }));
  audio.src = recording.url;
  const decoded = await new OfflineAudioContext(1, 1, 8000).decodeAudioData(bytes.slice(0));
  drawWaveform(canvas, decoded, rec.marks);
  $("recording-legend").replaceChildren(...Object.entries(MARK_COLOURS).map(([name, colour]) =>
    el("span", { class: "mark", style: `border-color: ${colour}` }, name)));
}

function playTurn(turnNumber) {
  // From a second before the caller stopped speaking, so the wait is heard from its start.
  const end = recording.marks.find((m) => m.turn === turnNumber && m.mark === "speech end");
  if (!end || !recording.url) return;
  const audio = $("call-audio");
  audio.currentTime = Math.max(0, end.s - 1);
  audio.play().catch(() => {}); // a browser may refuse sound before a gesture: the seek stands
  $("waveform").dataset.playingTurn = String(turnNumber);
}
