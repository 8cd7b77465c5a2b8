// Browser call page: one WebRTC call to the voiceagent server over pipecat's SmallWebRTC
// signalling (POST /api/offer), with RTVI messages on a client-created data channel.
// Plain script, no build step and no network resources beyond this server.
"use strict";

const ICE_GATHER_CAP_MS = 2000;
const PING_MS = 1000; // SmallWebRTC counts the peer as gone 3 s after its last "ping"

const $ = (id) => document.getElementById(id);
const ui = {
  call: $("call"),
  hangup: $("hangup"),
  status: $("status"),
  state: $("state"),
  transcript: $("transcript"),
  clocks: document.querySelector("#clocks tbody"),
  audio: $("bot-audio"),
  keys: document.querySelectorAll("#keypad button"),
};
const KEYS = "0123456789*#"; // the DTMF keypad

let call = null; // {pc, mic, ping, channel} while a call is up; channel once it is open
let attempt = 0; // bumped by every call and hang-up, so a stale setup step stops

function setStatus(text, isError = false) {
  ui.status.textContent = text;
  ui.status.classList.toggle("error", isError);
}

function setState(text) {
  ui.state.textContent = text;
}

// ---- transcript -------------------------------------------------------------------------------

let interim = null; // the live (not yet final) user line
let reply = null; // the bot's reply now: {el, spoken, source, llm, recorded}; el comes with text
let lastReply = null; // the reply before, until its turn record comes
let botSpeaking = false;

function addLine(cls, text) {
  const el = document.createElement("div");
  el.className = cls;
  el.textContent = text;
  // Keep a live interim line last, under whatever is committed.
  ui.transcript.insertBefore(el, interim && cls !== "user interim" ? interim : null);
  ui.transcript.scrollTop = ui.transcript.scrollHeight;
  return el;
}

// Text pieces arrive as words or sentences, with or without their leading space.
function joinText(a, b) {
  if (!a || !b || /\s$/.test(a) || /^[\s.,!?;:')\]]/.test(b)) return a + b;
  return a + " " + b;
}

function onUserTranscription({ text = "", final = false }) {
  endReply(); // the caller spoke: the next reply gets a new line
  if (!final) {
    if (!interim) interim = addLine("user interim", "");
    interim.textContent = text;
    return;
  }
  if (interim) {
    interim.className = "user";
    interim.textContent = text;
    interim = null;
  } else {
    addLine("user", text);
  }
}

function newReply() {
  return { el: null, spoken: "", source: null, llm: "", recorded: false };
}

function currentReply() {
  reply = reply || newReply();
  return reply;
}

function showReply(r, text) {
  if (!r.el) r.el = addLine("bot", "");
  r.el.textContent = text;
}

// The spoken words come both as bot-output (spoken) and as bot-tts-text; show one of the two.
function onBotSpoken(source, text) {
  if (!text) return;
  const r = currentReply();
  r.source = r.source || source;
  if (r.source !== source) return;
  r.spoken = joinText(r.spoken, text);
  showReply(r, r.spoken);
}

function onBotLLMText(text) {
  if (text) currentReply().llm += text;
}

// Without any spoken text (no TTS messages), fall back to what the LLM wrote.
function settleReply(r) {
  if (r && !r.spoken && r.llm) showReply(r, r.llm);
}

function markInterrupted(r) {
  if (r && r.el) r.el.classList.add("interrupted");
}

function endReply() {
  settleReply(reply);
  if (reply) lastReply = reply;
  reply = null;
}

// ---- per-turn clocks --------------------------------------------------------------------------

function ms(v) {
  return typeof v === "number" && isFinite(v) ? v.toFixed(v < 10 ? 1 : 0) : "–";
}

function onTurn(turn) {
  const c = turn.clocks || {};
  const itl = c.itl_ms || {};
  const tr = document.createElement("tr");
  tr.className = "turn";
  const cells = [
    turn.turn, ms(c.request_to_first_token_ms), ms(itl.p50), ms(itl.p95),
    ms(c.turn_end_to_first_audio_ms),
  ];
  for (const v of cells) {
    const td = document.createElement("td");
    td.textContent = String(v ?? "–");
    tr.appendChild(td);
  }
  ui.clocks.appendChild(tr);

  // The record says what the caller heard (cut at a barge-in); it can come after their next words.
  const r = lastReply && !lastReply.recorded ? lastReply : currentReply();
  r.recorded = true;
  if (turn.bot_text) showReply(r, turn.bot_text);
  else settleReply(r);
  if (turn.interrupted) markInterrupted(r);
  if (r === reply) endReply();
}

// ---- data-channel messages --------------------------------------------------------------------

const RTVI_HANDLERS = {
  "bot-ready": () => setState("listening"),
  "user-transcription": onUserTranscription,
  "bot-output": (d) => {
    if (d.spoken !== false) onBotSpoken("bot-output", d.text); // spoken=false: not said yet
  },
  "bot-tts-text": (d) => onBotSpoken("bot-tts-text", d.text),
  "bot-llm-text": (d) => onBotLLMText(d.text),
  "user-started-speaking": () => setState("you are speaking"),
  "user-stopped-speaking": () => setState("thinking"),
  "bot-started-speaking": () => {
    botSpeaking = true;
    setState("bot speaking");
  },
  "bot-stopped-speaking": () => {
    botSpeaking = false;
    settleReply(reply);
    setState("listening");
  },
  // Sent on every caller speech start (state already says so); it cuts a reply being spoken.
  "bot-interrupted": () => {
    if (botSpeaking) markInterrupted(reply);
    botSpeaking = false;
  },
  "server-message": (d) => {
    if (d && d.type === "turn") onTurn(d);
  },
  error: (d) => console.warn("server error:", d),
};

function onMessage(event) {
  if (typeof event.data !== "string") return;
  let msg;
  try {
    msg = JSON.parse(event.data);
  } catch {
    return; // not JSON (e.g. a ping echo): nothing for us
  }
  if (msg.type === "signalling") {
    if (msg.message && msg.message.type === "peerLeft") hangup("ended");
    return;
  }
  if (msg.label !== "rtvi-ai") return;
  const handle = RTVI_HANDLERS[msg.type];
  if (handle) handle(msg.data || {});
}

function sendRTVI(channel, type, data) {
  channel.send(JSON.stringify({
    label: "rtvi-ai",
    type,
    id: crypto.randomUUID ? crypto.randomUUID() : String(Math.random()).slice(2),
    data,
  }));
}

function onChannelOpen(c, channel) {
  if (call !== c) return; // hung up before it opened
  sendRTVI(channel, "client-ready", { version: "1.0.0", about: { library: "voiceagent-page" } });
  c.ping = setInterval(() => {
    if (channel.readyState === "open") channel.send("ping");
  }, PING_MS);
  c.channel = channel;
  setKeypad(true);
}

// ---- keypad -----------------------------------------------------------------------------------

function setKeypad(enabled) {
  ui.keys.forEach((b) => {
    b.disabled = !enabled;
  });
}

// pipecat's RTVI `dtmf` message: the server makes each key an InputDTMFFrame, as a phone's.
function pressKey(key) {
  const channel = call && call.channel;
  if (!channel || channel.readyState !== "open") return;
  sendRTVI(channel, "dtmf", { buttons: [key] });
  const button = document.querySelector(`#keypad button[data-key="${key}"]`);
  button.classList.add("pressed");
  setTimeout(() => button.classList.remove("pressed"), 150);
}

ui.keys.forEach((b) => b.addEventListener("click", () => pressKey(b.dataset.key)));
document.addEventListener("keydown", (e) => {
  if (e.ctrlKey || e.metaKey || e.altKey || e.key.length !== 1 || !KEYS.includes(e.key)) return;
  if (e.target.closest("input, textarea, select, [contenteditable]")) return; // typing there
  if (!call || !call.channel) return;
  e.preventDefault();
  pressKey(e.key);
});

// ---- call setup -------------------------------------------------------------------------------

// One POST with all candidates is simpler than trickle; host candidates come in milliseconds.
function iceGathered(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      if (pc.iceGatheringState !== "complete") return;
      pc.removeEventListener("icegatheringstatechange", done);
      resolve();
    };
    pc.addEventListener("icegatheringstatechange", done);
    setTimeout(resolve, ICE_GATHER_CAP_MS);
  });
}

class Unauthorized extends Error {}

async function postOffer(offer) {
  const res = await fetch("/api/offer", {
    method: "POST",
    headers: { "Content-Type": "application/json" }, // the session cookie goes with it
    body: JSON.stringify({ sdp: offer.sdp, type: offer.type, pc_id: null }),
  });
  if (res.ok) return res.json();
  if (res.status === 401) throw new Unauthorized("unauthorized");
  let detail = "";
  try {
    const d = (await res.json()).detail;
    detail = d == null ? "" : typeof d === "string" ? d : JSON.stringify(d);
  } catch {
    // no JSON body: the status code is all we have
  }
  // 503 is the server saying why (busy): its words alone read best.
  if (res.status === 503 && detail) throw new Error(detail);
  throw new Error(detail ? `HTTP ${res.status}: ${detail}` : `HTTP ${res.status}`);
}

async function startCall() {
  const mine = ++attempt;
  ui.call.disabled = true;
  ui.hangup.disabled = false;
  setStatus("connecting");
  setState("–");
  try {
    const mic = await navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
    if (mine !== attempt) {
      mic.getTracks().forEach((t) => t.stop()); // hung up while asked for the mic
      return;
    }
    const pc = new RTCPeerConnection();
    const c = { pc, mic, ping: null, channel: null };
    call = c;

    // Transceiver 0 must be the audio: pipecat reads the caller's audio from index 0.
    pc.addTransceiver(mic.getAudioTracks()[0], { direction: "sendrecv", streams: [mic] });
    pc.ontrack = (e) => {
      ui.audio.srcObject = e.streams[0] || new MediaStream([e.track]);
    };
    pc.onconnectionstatechange = () => {
      if (call !== c) return;
      if (pc.connectionState === "connected") setStatus("connected");
      else if (pc.connectionState === "failed") hangup("error: connection failed", true);
      else if (pc.connectionState === "closed") hangup("ended");
    };

    const channel = pc.createDataChannel("chat", { ordered: true });
    channel.onopen = () => onChannelOpen(c, channel);
    channel.onmessage = onMessage;
    channel.onclose = () => {
      if (call === c) hangup("ended"); // the server closed the call
    };

    await pc.setLocalDescription(await pc.createOffer());
    await iceGathered(pc);
    const answer = await postOffer(pc.localDescription);
    if (mine !== attempt) return; // hung up while we waited
    await pc.setRemoteDescription({ sdp: answer.sdp, type: answer.type });
  } catch (err) {
    if (mine !== attempt) return;
    hangup(`error: ${err.message || err}`, true);
    if (err instanceof Unauthorized) {
      await askForToken(document.getElementById("signin-box"), "This server needs its token.");
      startCall();
    }
  }
}

function hangup(status = "ended", isError = false) {
  attempt++;
  if (call) {
    clearInterval(call.ping);
    call.mic.getTracks().forEach((t) => t.stop());
    call.pc.close();
    call = null;
  }
  setKeypad(false);
  endReply();
  lastReply = null;
  botSpeaking = false;
  if (interim) {
    interim.remove();
    interim = null;
  }
  ui.audio.srcObject = null;
  ui.call.disabled = false;
  ui.hangup.disabled = true;
  setStatus(status, isError);
  setState("–");
}

ui.call.addEventListener("click", startCall);
sessionFromFragment();
ui.hangup.addEventListener("click", () => hangup("ended"));
