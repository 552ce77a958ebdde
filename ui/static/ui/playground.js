// The playground: one panel per family, each calling the public API as any client would.
// Transcribe (file or sample, words highlighted while the audio plays; the microphone live through
// /v1/realtime), voice activity over the waveform, speech, same speaker? (two embeddings, cosine
// similarity), music to notes (piano roll, MIDI download), who spoke when (turns over the waveform).
import {connectStatus} from "./live.js";
import {errorText} from "./forms.js";
import {color, fitCanvas} from "./theme.js";

const $ = (id) => document.getElementById(id);
const SAMPLES = ["/ui/sample.wav", "/ui/sample-other.wav"];

function say(id, text, kind = "") {
  const out = $(id);
  out.textContent = text;
  out.className = `msg ${kind}`;
}

async function answer(response) {
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new Error(errorText(body, response.status));
  return body;
}

async function sampleFile(n = 0) {
  const response = await fetch(SAMPLES[n]);
  if (!response.ok) throw new Error(`sample: ${response.status}`);
  return new File([await response.blob()], `sample-${n + 1}.wav`, {type: "audio/wav"});
}

// 16-bit PCM mono WAV of float samples.
function wavOf(samples, rateHz) {
  const buffer = new ArrayBuffer(44 + samples.length * 2);
  const view = new DataView(buffer);
  const text = (offset, s) => { for (let i = 0; i < s.length; i++) view.setUint8(offset + i, s.charCodeAt(i)); };
  text(0, "RIFF"); view.setUint32(4, 36 + samples.length * 2, true); text(8, "WAVE");
  text(12, "fmt "); view.setUint32(16, 16, true); view.setUint16(20, 1, true); view.setUint16(22, 1, true);
  view.setUint32(24, rateHz, true); view.setUint32(28, rateHz * 2, true); view.setUint16(32, 2, true);
  view.setUint16(34, 16, true); text(36, "data"); view.setUint32(40, samples.length * 2, true);
  for (let i = 0; i < samples.length; i++) {
    const s = Math.max(-1, Math.min(1, samples[i]));
    view.setInt16(44 + i * 2, s < 0 ? s * 0x8000 : s * 0x7fff, true);
  }
  return new Blob([buffer], {type: "audio/wav"});
}

function base64Of(bytes) {
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(text);
}

async function decode(file) {
  const context = new AudioContext();
  try {
    return await context.decodeAudioData(await file.arrayBuffer());
  } finally {
    context.close();
  }
}

async function runTask(model, file, options = {}) {
  const bytes = new Uint8Array(await file.arrayBuffer());
  return answer(await fetch("/v1/tasks/run", {
    method: "POST", headers: {"Content-Type": "application/json"},
    body: JSON.stringify({model, request: {audio_base64: base64Of(bytes), options}}),
  }));
}

// Waveform (min/max per pixel column) with shaded spans [{start_s, end_s, fill, label}].
function drawWave(canvas, samples, rateHz, spans) {
  const [ctx, w, h] = fitCanvas(canvas);
  ctx.clearRect(0, 0, w, h);
  const seconds = samples.length / rateHz;
  for (const s of spans) {
    ctx.fillStyle = s.fill;
    ctx.fillRect((s.start_s / seconds) * w, 0, ((s.end_s - s.start_s) / seconds) * w, h);
    if (s.label) {
      ctx.fillStyle = color("fg");
      ctx.font = "12px system-ui, sans-serif";
      ctx.fillText(s.label, (s.start_s / seconds) * w + 3, 13);
    }
  }
  ctx.strokeStyle = color("fg");
  ctx.beginPath();
  const step = Math.max(1, Math.floor(samples.length / w));
  for (let x = 0; x < w; x++) {
    let lo = 0, hi = 0;
    for (let i = x * step; i < Math.min(samples.length, (x + 1) * step); i++) {
      lo = Math.min(lo, samples[i]); hi = Math.max(hi, samples[i]);
    }
    ctx.moveTo(x + 0.5, h / 2 - hi * (h / 2 - 16));
    ctx.lineTo(x + 0.5, h / 2 - lo * (h / 2 - 16));
  }
  ctx.stroke();
}

// --- transcription: the words highlighted while the audio plays ---
let highlight = null;

function showWords(words, file) {
  const box = $("asr-words");
  box.replaceChildren();
  const spans = words.map((w) => {
    const span = document.createElement("span");
    span.textContent = w.word;
    span.dataset.start = w.start;
    span.dataset.end = w.end;
    box.append(span, " ");
    return span;
  });
  const audio = $("asr-audio");
  if (audio.src) URL.revokeObjectURL(audio.src);
  audio.src = URL.createObjectURL(file);
  audio.hidden = false;
  if (highlight) cancelAnimationFrame(highlight);
  const follow = () => {
    const t = audio.currentTime;
    for (const span of spans) span.classList.toggle("now", t >= +span.dataset.start && t < +span.dataset.end);
    highlight = requestAnimationFrame(follow);
  };
  follow();
}

async function transcribe(file) {
  say("asr-status", "transcribing…", "busy");
  $("asr-text").textContent = "";
  const form = new FormData();
  form.append("model", $("asr-model").value);
  form.append("file", file);
  form.append("response_format", "verbose_json");
  form.append("timestamp_granularities[]", "word");
  try {
    const started = performance.now();
    const body = await answer(await fetch("/v1/audio/transcriptions", {method: "POST", body: form}));
    $("asr-text").textContent = body.text;
    showWords(body.words || [], file);
    say("asr-status", `done in ${Math.round(performance.now() - started)} ms; play the audio to follow the words`, "ok");
  } catch (err) {
    say("asr-status", err.message, "error");
  }
}

if ($("asr-form")) {
  $("asr-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const file = $("asr-file").files[0];
    if (!file) { say("asr-status", "choose a file first", "error"); return; }
    transcribe(file);
  });
  $("asr-sample").addEventListener("click", async () => transcribe(await sampleFile()));
  $("asr-live").addEventListener("click", () => (live ? live.stop() : startLive()));
}

// --- the microphone through /v1/realtime: PCM s16le 24 kHz appended, deltas shown as they arrive ---
let live = null;
const LIVE_RATE_HZ = 24000;

async function startLive() {
  const button = $("asr-live");
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({audio: {channelCount: 1}});
  } catch (err) {
    say("live-status", `no microphone: ${err.message}`, "error");
    return;
  }
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const model = encodeURIComponent($("asr-model").value);
  const socket = new WebSocket(`${scheme}//${location.host}/v1/realtime?intent=transcription&model=${model}`);
  const context = new AudioContext({sampleRate: LIVE_RATE_HZ});
  const source = context.createMediaStreamSource(stream);
  const tap = context.createScriptProcessor(4096, 1, 1);
  const text = $("live-text");
  let current = null;  // the <span> of the turn being transcribed
  const turnSpan = () => {
    if (!current) { current = document.createElement("span"); text.append(current, " "); }
    return current;
  };
  tap.onaudioprocess = (e) => {
    if (socket.readyState !== WebSocket.OPEN) return;
    const input = e.inputBuffer.getChannelData(0);
    const pcm = new Int16Array(input.length);
    for (let i = 0; i < input.length; i++) pcm[i] = Math.max(-1, Math.min(1, input[i])) * 0x7fff;
    socket.send(JSON.stringify({type: "input_audio_buffer.append", audio: base64Of(new Uint8Array(pcm.buffer))}));
  };
  socket.addEventListener("open", () => {
    source.connect(tap);
    tap.connect(context.destination);
    say("live-status", "listening… speak, then press the button again to stop", "busy");
  });
  socket.addEventListener("message", (e) => {
    const event = JSON.parse(e.data);
    if (event.type === "conversation.item.input_audio_transcription.delta") {
      turnSpan().textContent += (turnSpan().textContent ? " " : "") + event.delta.trim();
      window.dispatchEvent(new CustomEvent("live-delta", {detail: event.delta}));
    } else if (event.type === "conversation.item.input_audio_transcription.completed") {
      turnSpan().textContent = event.transcript.trim();
      current = null;
    } else if (event.type === "input_audio_buffer.speech_started") {
      say("live-status", "hearing speech…", "busy");
    } else if (event.type === "error" || event.type.endsWith(".failed")) {
      say("live-status", (event.error && event.error.message) || event.type, "error");
    }
  });
  socket.addEventListener("close", () => { if (live) live.stop(); });
  live = {
    stop() {
      live = null;
      tap.disconnect();
      source.disconnect();
      stream.getTracks().forEach((t) => t.stop());
      context.close();
      if (socket.readyState === WebSocket.OPEN) socket.close(1000);
      button.textContent = "Start live transcription";
      button.setAttribute("aria-pressed", "false");
      say("live-status", "stopped", "ok");
    },
  };
  button.textContent = "Stop live transcription";
  button.setAttribute("aria-pressed", "true");
}

// --- voice activity ---
async function findSpeech(file) {
  say("vad-status", "running…", "busy");
  $("vad-segments").replaceChildren();
  try {
    const decoded = await decode(file);
    const body = await runTask($("vad-model").value, file);
    drawWave($("vad-wave"), decoded.getChannelData(0), decoded.sampleRate,
             body.segments.map((s) => ({...s, fill: color("plot-speech")})));
    for (const s of body.segments) {
      const item = document.createElement("li");
      item.textContent = `${s.start_s.toFixed(2)} s – ${s.end_s.toFixed(2)} s`;
      $("vad-segments").append(item);
    }
    say("vad-status", `${body.segments.length} segment(s) of speech`, "ok");
  } catch (err) {
    say("vad-status", err.message, "error");
  }
}

if ($("vad-form")) {
  $("vad-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const file = $("vad-file").files[0];
    if (!file) { say("vad-status", "choose a file first", "error"); return; }
    findSpeech(file);
  });
  $("vad-sample").addEventListener("click", async () => findSpeech(await sampleFile()));
}

// --- speech ---
async function loadVoices() {
  const select = $("tts-voice");
  try {
    const body = await answer(await fetch(`/v1/audio/voices?model=${encodeURIComponent($("tts-model").value)}`));
    select.replaceChildren(...body.voices.map((v) => new Option(v.name || v.id, v.id)));
  } catch (err) {
    say("tts-status", err.message, "error");
  }
}

if ($("tts-form")) {
  $("tts-model").addEventListener("change", loadVoices);
  loadVoices();
  $("tts-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    say("tts-status", "synthesising…", "busy");
    try {
      const response = await fetch("/v1/audio/speech", {
        method: "POST", headers: {"Content-Type": "application/json"},
        body: JSON.stringify({model: $("tts-model").value, voice: $("tts-voice").value, input: $("tts-text").value,
                              response_format: "wav"}),
      });
      if (!response.ok) await answer(response);
      const audio = $("tts-audio");
      audio.src = URL.createObjectURL(await response.blob());
      say("tts-status", "ready", "ok");
      audio.play().catch(() => {});
    } catch (err) {
      say("tts-status", err.message, "error");
    }
  });
}

// --- same speaker? two embeddings, their cosine similarity ---
export function cosine(a, b) {
  let dot = 0, na = 0, nb = 0;
  for (let i = 0; i < a.length; i++) { dot += a[i] * b[i]; na += a[i] * a[i]; nb += b[i] * b[i]; }
  return dot / Math.sqrt(na * nb);
}

async function compare(first, second) {
  say("emb-status", "computing both embeddings…", "busy");
  $("emb-score").textContent = "–";
  try {
    const model = $("emb-model").value;
    const [a, b] = await Promise.all([runTask(model, first), runTask(model, second)]);
    $("emb-score").textContent = cosine(a.embedding, b.embedding).toFixed(3);
    say("emb-status", `${a.embedding.length}-dimensional embeddings of ${first.name} and ${second.name}`, "ok");
  } catch (err) {
    say("emb-status", err.message, "error");
  }
}

if ($("emb-form")) {
  $("emb-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const [a, b] = [$("emb-file-a").files[0], $("emb-file-b").files[0]];
    if (!a || !b) { say("emb-status", "choose two files first", "error"); return; }
    compare(a, b);
  });
  $("emb-samples").addEventListener("click", async () => compare(await sampleFile(0), await sampleFile(1)));
}

// --- music to notes: a piano roll and the MIDI file ---
const NOTE_NAMES = ["C", "C♯", "D", "D♯", "E", "F", "F♯", "G", "G♯", "A", "A♯", "B"];

function drawRoll(canvas, notes) {
  const [ctx, w, h] = fitCanvas(canvas);
  ctx.clearRect(0, 0, w, h);
  if (!notes.length) return;
  const low = Math.min(...notes.map((n) => n.pitch_midi)) - 1, high = Math.max(...notes.map((n) => n.pitch_midi)) + 1;
  const end = Math.max(...notes.map((n) => n.end_s));
  const left = 34, rowH = (h - 4) / (high - low + 1);
  const y = (p) => h - 2 - (p - low + 1) * rowH;
  ctx.font = "10px system-ui, sans-serif";
  for (let p = low; p <= high; p++) {
    if (p % 12 === 0 || high - low < 16) {
      ctx.fillStyle = color("muted");
      ctx.fillText(`${NOTE_NAMES[p % 12]}${Math.floor(p / 12) - 1}`, 2, y(p) + rowH - 1);
    }
    ctx.fillStyle = color("line");
    ctx.fillRect(left, y(p), w - left, 0.5);
  }
  ctx.fillStyle = color("plot-active");
  for (const n of notes) {
    const x0 = left + (n.start_s / end) * (w - left - 2), x1 = left + (n.end_s / end) * (w - left - 2);
    ctx.globalAlpha = 0.4 + 0.6 * (n.velocity / 127);
    ctx.fillRect(x0, y(n.pitch_midi) + 1, Math.max(2, x1 - x0), Math.max(2, rowH - 2));
  }
  ctx.globalAlpha = 1;
}

// A short melody (C major arpeggio and back) of plucked tones, rendered offline at 22.05 kHz.
async function melodyFile() {
  const rate = 22050, pitches = [60, 64, 67, 72, 67, 64, 60], step = 0.45;
  const context = new OfflineAudioContext(1, Math.ceil(rate * (pitches.length * step + 0.6)), rate);
  pitches.forEach((pitch, i) => {
    const start = 0.2 + i * step;
    for (const [harmonic, level] of [[1, 0.5], [2, 0.2], [3, 0.1]]) {
      const osc = context.createOscillator(), gain = context.createGain();
      osc.frequency.value = 440 * 2 ** ((pitch - 69) / 12) * harmonic;
      gain.gain.setValueAtTime(0, start);
      gain.gain.linearRampToValueAtTime(level, start + 0.005);
      gain.gain.exponentialRampToValueAtTime(0.001, start + step * 0.95);
      osc.connect(gain).connect(context.destination);
      osc.start(start);
      osc.stop(start + step);
    }
  });
  const rendered = await context.startRendering();
  return new File([wavOf(rendered.getChannelData(0), rate)], "melody.wav", {type: "audio/wav"});
}

async function transcribeMusic(file) {
  say("music-status", "listening for notes…", "busy");
  const link = $("music-midi");
  link.hidden = true;
  try {
    const body = await runTask($("music-model").value, file, {midi: true});
    drawRoll($("music-roll"), body.notes);
    const midi = (body.artifacts || []).find((a) => a.media_type === "audio/midi");
    if (midi) {
      const bytes = Uint8Array.from(atob(midi.data), (c) => c.charCodeAt(0));
      if (link.href) URL.revokeObjectURL(link.href);
      link.href = URL.createObjectURL(new Blob([bytes], {type: "audio/midi"}));
      link.hidden = false;
    }
    const names = body.notes.slice(0, 12).map((n) => `${NOTE_NAMES[n.pitch_midi % 12]}${Math.floor(n.pitch_midi / 12) - 1}`);
    say("music-status", `${body.notes.length} note(s): ${names.join(" ")}${body.notes.length > 12 ? " …" : ""}`, "ok");
  } catch (err) {
    say("music-status", err.message, "error");
  }
}

if ($("music-form")) {
  $("music-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const file = $("music-file").files[0];
    if (!file) { say("music-status", "choose a file first", "error"); return; }
    transcribeMusic(file);
  });
  $("music-melody").addEventListener("click", async () => transcribeMusic(await melodyFile()));
}

// --- who spoke when: speaker turns over the waveform ---
const SPEAKER_FILLS = ["plot-active-fill", "plot-queued-fill", "plot-speech"];

async function diarize(file) {
  say("diar-status", "finding the speakers…", "busy");
  $("diar-turns").replaceChildren();
  try {
    const decoded = await decode(file);
    const body = await runTask($("diar-model").value, file);
    const speakers = [...new Set(body.speaker_turns.map((t) => t.speaker))];
    drawWave($("diar-wave"), decoded.getChannelData(0), decoded.sampleRate, body.speaker_turns.map((t) => ({
      ...t, fill: color(SPEAKER_FILLS[speakers.indexOf(t.speaker) % SPEAKER_FILLS.length]), label: t.speaker,
    })));
    for (const t of body.speaker_turns) {
      const item = document.createElement("li");
      item.textContent = `${t.speaker}: ${t.start_s.toFixed(2)} s – ${t.end_s.toFixed(2)} s`;
      $("diar-turns").append(item);
    }
    say("diar-status", `${speakers.length} speaker(s), ${body.speaker_turns.length} turn(s)`, "ok");
  } catch (err) {
    say("diar-status", err.message, "error");
  }
}

// The two shipped samples (two readers) one after the other, at 16 kHz, as one WAV.
async function conversationFile() {
  const parts = await Promise.all([sampleFile(0), sampleFile(1)].map(async (f) => decode(await f)));
  const rate = 16000;
  const resampled = await Promise.all(parts.map(async (buffer) => {
    const context = new OfflineAudioContext(1, Math.ceil(buffer.duration * rate), rate);
    const source = context.createBufferSource();
    source.buffer = buffer;
    source.connect(context.destination);
    source.start();
    return (await context.startRendering()).getChannelData(0);
  }));
  const joined = new Float32Array(resampled[0].length + resampled[1].length);
  joined.set(resampled[0]);
  joined.set(resampled[1], resampled[0].length);
  return new File([wavOf(joined, rate)], "two-readers.wav", {type: "audio/wav"});
}

if ($("diar-form")) {
  $("diar-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const file = $("diar-file").files[0];
    if (!file) { say("diar-status", "choose a file first", "error"); return; }
    diarize(file);
  });
  $("diar-samples").addEventListener("click", async () => diarize(await conversationFile()));
}

connectStatus(() => {});
