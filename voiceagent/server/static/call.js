// Browser call page: one WebRTC call to the voiceagent server over pipecat's SmallWebRTC
// signalling (POST /api/offer), with RTVI messages on a client-created data channel; the STUN/TURN
// servers come from GET /api/ice (server.ice_servers). A level meter and a mute button for the
// microphone; every failure is shown on the page (#notice) with its fix.
// Plain script, no build step and no network resources beyond this server.
"use strict";

const ICE_GATHER_CAP_MS = 2000;
const PING_MS = 1000; // SmallWebRTC counts the peer as gone 3 s after its last "ping"
const METER_MS = 50; // the level meter's refresh
const METER_FLOOR_DB = -60; // the meter's empty end (dBFS); full at 0 dBFS

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
  mute: $("mute"),
  muted: $("muted-badge"),
  meter: $("meter"),
  meterBar: $("meter-bar"),
  notice: $("notice"),
  noticeWhat: $("notice-what"),
  noticeFix: $("notice-fix"),
};
const KEYS = "0123456789*#"; // the DTMF keypad

let call = null; // {pc, mic, ping, channel, endReason} while a call is up; channel once open
let attempt = 0; // bumped by every call and hang-up, so a stale setup step stops
let muted = false; // the caller's choice; it holds across calls

function setStatus(text, isError = false) {
  ui.status.textContent = text;
  ui.status.classList.toggle("error", isError);
}

function setState(text) {
  ui.state.textContent = text;
}

// ---- notices: what went wrong, and what fixes it ----------------------------------------------

// A failure the page explains: `message` says what happened, `fix` what to do, `short` goes in
// the status line.
class CallError extends Error {
  constructor(message, fix, short) {
    super(message);
    this.fix = fix;
    this.short = short || message;
  }
}

class Unauthorized extends Error {}

// kind: "error" (the call failed) or "info" (it ended, or the page needs something).
function showNotice(what, fix = "", kind = "error") {
  ui.noticeWhat.textContent = what;
  ui.noticeFix.textContent = fix ? `Fix: ${fix}` : "";
  ui.noticeFix.hidden = !fix;
  ui.notice.className = kind;
  ui.notice.hidden = false;
}

function clearNotice() {
  ui.notice.hidden = true;
  ui.noticeWhat.textContent = "";
  ui.noticeFix.textContent = "";
}

// The microphone's failures (getUserMedia's DOMException names) in words, with the fix.
function micError(err) {
  const name = (err && err.name) || "";
  if (name === "NotAllowedError" || name === "SecurityError") {
    return new CallError("The microphone was refused: the browser (or its user) did not allow " +
      "this page to use it.", "allow the microphone for this site (the icon at the left of the " +
      "address bar, or the browser's site settings; on macOS also System Settings → Privacy → " +
      "Microphone), then call again.", "microphone refused");
  }
  if (name === "NotFoundError" || name === "OverconstrainedError") {
    return new CallError("No microphone was found.", "connect a microphone or headset, check " +
      "that the system sees it, then call again.", "no microphone");
  }
  if (name === "NotReadableError" || name === "AbortError") {
    return new CallError("The microphone could not be opened: another application may hold it, " +
      "or the system refused it.", "close other applications that use the microphone, check " +
      "the system's privacy settings for this browser, then call again.",
    "microphone unavailable");
  }
  return new CallError(`The microphone could not be opened (${name || "error"}: ` +
    `${(err && err.message) || err}).`, "check the browser's microphone settings, then call " +
    "again.", "microphone failed");
}

// Browsers give pages a microphone only in a secure context: HTTPS, or localhost / 127.0.0.1.
function checkMicAvailable() {
  const devices = navigator.mediaDevices;
  if (devices && typeof devices.getUserMedia === "function") return;
  if (!window.isSecureContext) {
    const port = location.port ? `:${location.port}` : "";
    throw new CallError("The microphone needs HTTPS or localhost: this page came over plain " +
      `HTTP from ${location.hostname}, and browsers give such a page no microphone.`,
    `on the server's own machine open ${location.protocol}//localhost${port}/ instead; from ` +
      "another machine, serve the page over HTTPS (a reverse proxy with a certificate, e.g. " +
      "deploy/nginx in the voiceagent repository, with server.token and server.public_url set).",
    "the microphone needs HTTPS or localhost");
  }
  throw new CallError("This browser gives the page no microphone (no navigator.mediaDevices).",
    "use a current Chrome, Edge, Firefox or Safari.", "no microphone in this browser");
}

async function responseDetail(res) {
  try {
    const d = (await res.json()).detail;
    return d == null ? "" : typeof d === "string" ? d : JSON.stringify(d);
  } catch {
    return ""; // no JSON body: the status code is all we have
  }
}

// A refused request (`what`: "the offer", "the ICE servers") as an error with the fix.
async function refusal(res, what) {
  if (res.status === 401) return new Unauthorized("unauthorized");
  const detail = await responseDetail(res);
  const said = detail ? `: ${detail}` : "";
  const retry = res.headers.get("Retry-After");
  if (res.status === 503) {
    const when = retry ? `in about ${retry} s` : "shortly";
    const fix = /loading/i.test(detail)
      ? `wait until the server has loaded its models, then call again (${when}).`
      : /busy/i.test(detail)
        ? `call again ${when}, when a call has ended (server.max_calls sets how many run at ` +
          "once)."
        : `call again ${when}.`;
    return new CallError(`The server can't take a call now${said}.`, fix,
      detail || "server unavailable (HTTP 503)");
  }
  if (res.status === 403) {
    const fix = /proxy/i.test(detail)
      ? "set server.token and server.public_url on the server for a deployment behind a proxy."
      : /origin/i.test(detail)
        ? "open the call page from the server's own address, or add this page's origin to " +
          "server.allowed_origins."
        : "check the server's server.allowed_origins and server.token settings.";
    return new CallError(`The server refused ${what} (HTTP 403)${said}.`, fix,
      `refused (HTTP 403)${said}`);
  }
  if (res.status === 400 && /^host /.test(detail)) {
    return new CallError(`The server refused ${what}${said}.`, "open the page by a name the " +
      "server accepts, or add this one to server.allowed_hosts.", `refused${said}`);
  }
  return new CallError(`The server refused ${what} (HTTP ${res.status})${said}.`,
    "reload the page and call again; if it happens again, the server's log says why.",
    `HTTP ${res.status}${said}`);
}

function unreachable(err) {
  return new CallError(`The server could not be reached (${err.message || err}).`,
    "check that `voiceagent serve` is running and that this page's address reaches it, then " +
    "call again.", "server unreachable");
}

// Why the server ended a call (its RTVI `call-ended` message), with what to do.
function endedByServer(reason) {
  const why = reason ? `: ${reason}` : " (the bot hung up, or the server stopped).";
  let fix = "call again to go on.";
  if (/idle/i.test(reason || "")) {
    fix = "the server heard no audio for too long (server.idle_timeout_s): check the " +
      "microphone, then call again.";
  } else if (/length/i.test(reason || "")) {
    fix = "call again; server.max_call_s sets how long a call may last.";
  }
  showNotice(`The server ended the call${why}`, fix, "info");
}

// ---- microphone: level meter and mute ---------------------------------------------------------

let meter = null; // {ctx, timer} while a microphone is open

// The level of the local microphone, as the caller's own ears can't judge what the mic hears;
// with mute on the track is silent, and the meter shows it.
function startMeter(mic) {
  stopMeter();
  ui.meter.dataset.peak = "0";
  const Ctx = window.AudioContext || window.webkitAudioContext;
  if (!Ctx) return;
  const ctx = new Ctx();
  const analyser = ctx.createAnalyser();
  analyser.fftSize = 1024;
  ctx.createMediaStreamSource(mic).connect(analyser);
  const sink = ctx.createGain(); // pulls the graph along; silent, so the caller never hears it
  sink.gain.value = 0;
  analyser.connect(sink).connect(ctx.destination);
  const samples = new Float32Array(analyser.fftSize);
  const timer = setInterval(() => {
    analyser.getFloatTimeDomainData(samples);
    let sum = 0;
    for (const x of samples) sum += x * x;
    const rms = Math.sqrt(sum / samples.length);
    const db = rms > 0 ? 20 * Math.log10(rms) : -Infinity;
    showLevel(Math.max(0, Math.min(1, 1 - db / METER_FLOOR_DB)));
  }, METER_MS);
  ctx.resume().catch(() => {});
  meter = { ctx, timer };
}

function showLevel(level) {
  ui.meterBar.style.width = `${(level * 100).toFixed(1)}%`;
  ui.meter.setAttribute("aria-valuenow", level.toFixed(3));
  if (level > Number(ui.meter.dataset.peak)) ui.meter.dataset.peak = level.toFixed(3);
}

function stopMeter() {
  if (meter) {
    clearInterval(meter.timer);
    meter.ctx.close().catch(() => {});
    meter = null;
  }
  showLevel(0);
}

// Mute disables the outgoing track: WebRTC sends silence, and the server's VAD hears none.
function applyMute() {
  if (call) call.mic.getAudioTracks().forEach((t) => {
    t.enabled = !muted;
  });
  ui.mute.textContent = muted ? "Unmute" : "Mute";
  ui.mute.setAttribute("aria-pressed", String(muted));
  ui.mute.classList.toggle("on", muted);
  ui.muted.hidden = !muted;
  ui.meter.classList.toggle("muted", muted);
}

function toggleMute() {
  muted = !muted;
  applyMute();
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

function isNum(v) {
  return typeof v === "number" && isFinite(v);
}

function ms(v) {
  return isNum(v) ? v.toFixed(v < 10 ? 1 : 0) : "–";
}

// Accepted tokens per speculative step; without it (e.g. a remote LLM) the acceptance rate.
function accepted(spec) {
  if (isNum(spec.accepted_per_step)) return spec.accepted_per_step.toFixed(2);
  if (isNum(spec.acceptance_rate)) return `${Math.round(spec.acceptance_rate * 100)}%`;
  return "–";
}

function toolsCell(calls) {
  const td = document.createElement("td");
  td.className = "tools";
  if (!calls || !calls.length) {
    td.textContent = "–";
    return td;
  }
  for (const c of calls) {
    const div = document.createElement("div");
    div.className = c.ok ? "tool" : "tool failed";
    div.dataset.tool = c.name;
    const how = c.ok ? "" : ` (${c.outcome || "error"})`;
    const took = isNum(c.duration_ms) ? Math.round(c.duration_ms) : "–";
    div.textContent = `${c.name} ${took} ms${how}`;
    td.appendChild(div);
  }
  return td;
}

function onTurn(turn) {
  const c = turn.clocks || {};
  const itl = c.itl_ms || {};
  const spec = turn.speculation || {};
  const tr = document.createElement("tr");
  tr.className = "turn";
  tr.dataset.turn = turn.turn;
  const cells = [
    turn.turn, ms(c.request_to_first_token_ms), ms(itl.mean), ms(itl.p95),
    ms(c.turn_end_to_first_audio_ms), spec.method || "–", accepted(spec),
    isNum(spec.tokens_per_s) ? Math.round(spec.tokens_per_s) : "–",
  ];
  for (const v of cells) {
    const td = document.createElement("td");
    td.textContent = String(v ?? "–");
    tr.appendChild(td);
  }
  if (isNum(spec.acceptance_rate)) {
    tr.cells[6].title = `${Math.round(spec.acceptance_rate * 100)}% of drafted tokens accepted`;
  }
  tr.appendChild(toolsCell(turn.tool_calls));
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
    else if (d && d.type === "call-ended" && call) call.endReason = d.reason || "";
  },
  error: (d) => {
    console.warn("server error:", d);
    showNotice(`The server reported an error: ${d.error || d.message || JSON.stringify(d)}`,
      "if the call stops working, hang up and call again; the server's log says more.");
  },
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
    if (msg.message && msg.message.type === "peerLeft") serverHungUp();
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

async function fetchIceServers() {
  let res;
  try {
    res = await fetch("/api/ice"); // the session cookie goes with it
  } catch (err) {
    throw unreachable(err);
  }
  if (!res.ok) throw await refusal(res, "the ICE servers' request");
  return (await res.json()).ice_servers || [];
}

async function postOffer(offer) {
  let res;
  try {
    res = await fetch("/api/offer", {
      method: "POST",
      headers: { "Content-Type": "application/json" }, // the session cookie goes with it
      body: JSON.stringify({ sdp: offer.sdp, type: offer.type, pc_id: null }),
    });
  } catch (err) {
    throw unreachable(err);
  }
  if (res.ok) return res.json();
  throw await refusal(res, "the call");
}

function newPeerConnection(iceServers) {
  try {
    return new RTCPeerConnection({ iceServers });
  } catch (err) {
    throw new CallError(`The server's ICE servers are not valid (${err.message || err}).`,
      "correct server.ice_servers on the server: each entry needs urls (stun:, turn: or " +
      "turns:), and a TURN server a username and credential.", "bad ICE servers");
  }
}

const CONNECTION_FAILED = new CallError("The connection to the server failed: no network path " +
  "was found between this browser and the server (ICE).", "on another network than the " +
  "server, a TURN server is needed: set server.ice_servers (a turn: URL with its username and " +
  "credential); a firewall must let UDP through.", "connection failed");

async function startCall() {
  const mine = ++attempt;
  ui.call.disabled = true;
  ui.hangup.disabled = false;
  clearNotice();
  setStatus("connecting");
  setState("–");
  let mic = null;
  try {
    checkMicAvailable();
    const iceServers = await fetchIceServers();
    if (mine !== attempt) return;
    try {
      mic = await navigator.mediaDevices.getUserMedia({
        audio: { echoCancellation: true, noiseSuppression: true, autoGainControl: true },
      });
    } catch (err) {
      throw micError(err);
    }
    if (mine !== attempt) return; // hung up while asked for the mic (finally stops it)
    const pc = newPeerConnection(iceServers);
    const c = { pc, mic, ping: null, channel: null, endReason: null };
    call = c;
    mic = null; // the call's now: hangup stops it
    applyMute();
    startMeter(c.mic);

    // Transceiver 0 must be the audio: pipecat reads the caller's audio from index 0.
    pc.addTransceiver(c.mic.getAudioTracks()[0], { direction: "sendrecv", streams: [c.mic] });
    pc.ontrack = (e) => {
      ui.audio.srcObject = e.streams[0] || new MediaStream([e.track]);
    };
    pc.onconnectionstatechange = () => {
      if (call !== c) return;
      if (pc.connectionState === "connected") setStatus("connected");
      else if (pc.connectionState === "failed") failCall(CONNECTION_FAILED);
      else if (pc.connectionState === "closed") serverHungUp();
    };

    const channel = pc.createDataChannel("chat", { ordered: true });
    channel.onopen = () => onChannelOpen(c, channel);
    channel.onmessage = onMessage;
    channel.onclose = () => {
      if (call === c) serverHungUp(); // the server closed the call
    };

    await pc.setLocalDescription(await pc.createOffer());
    await iceGathered(pc);
    const answer = await postOffer(pc.localDescription);
    if (mine !== attempt) return; // hung up while we waited
    await pc.setRemoteDescription({ sdp: answer.sdp, type: answer.type });
  } catch (err) {
    if (mine !== attempt) return;
    if (err instanceof Unauthorized) {
      hangup("waiting for the token", true);
      showNotice("This server needs its token.", "enter it below (the server's server.token, " +
        "or VOICEAGENT_TOKEN where it runs); the call starts once it is accepted.", "info");
      await askForToken(document.getElementById("signin-box"), "This server needs its token.");
      startCall();
      return;
    }
    failCall(err);
  } finally {
    if (mic) mic.getTracks().forEach((t) => t.stop()); // opened, but no call took it
  }
}

// The call failed: the status line says so in short, the notice in full with the fix.
function failCall(err) {
  console.error(err);
  if (err instanceof CallError) {
    hangup(`error: ${err.short}`, true);
    showNotice(err.message, err.fix);
    return;
  }
  hangup(`error: ${err.message || err}`, true);
  showNotice(`The call failed: ${err.message || err}.`, "reload the page and call again; the " +
    "browser's console and the server's log say more.");
}

// The server ended the call (its peer left, or closed the channel or the connection).
function serverHungUp() {
  if (!call) return;
  const reason = call.endReason;
  hangup("ended by the server");
  endedByServer(reason);
}

function hangup(status = "ended", isError = false) {
  attempt++;
  if (call) {
    clearInterval(call.ping);
    call.mic.getTracks().forEach((t) => t.stop());
    call.pc.close();
    call = null;
  }
  stopMeter();
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
ui.mute.addEventListener("click", toggleMute);
applyMute();
sessionFromFragment();
ui.hangup.addEventListener("click", () => hangup("ended"));
