// The playground: transcribe (file, sample or microphone), voice activity over a waveform, speech.
import {connectStatus} from "./live.js";
import {errorText} from "./forms.js";

const $ = (id) => document.getElementById(id);
const SAMPLE_URL = "/ui/sample.wav";

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

async function sampleBlob() {
  const response = await fetch(SAMPLE_URL);
  if (!response.ok) throw new Error(`sample: ${response.status}`);
  return new File([await response.blob()], "sample.wav", {type: "audio/wav"});
}

// 16-bit PCM mono WAV of float samples (what the server decodes without a container it lacks: webm).
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

// --- transcription ---
async function transcribe(file) {
  say("asr-status", "transcribing…", "busy");
  $("asr-text").textContent = "";
  const form = new FormData();
  form.append("model", $("asr-model").value);
  form.append("file", file);
  try {
    const started = performance.now();
    const body = await answer(await fetch("/v1/audio/transcriptions", {method: "POST", body: form}));
    $("asr-text").textContent = body.text;
    say("asr-status", `done in ${Math.round(performance.now() - started)} ms`, "ok");
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
  $("asr-sample").addEventListener("click", async () => transcribe(await sampleBlob()));
  let recorder = null;
  $("asr-record").addEventListener("click", async () => {
    const button = $("asr-record");
    if (recorder) { recorder.stop(); return; }
    let stream;
    try {
      stream = await navigator.mediaDevices.getUserMedia({audio: true});
    } catch (err) {
      say("asr-status", `no microphone: ${err.message}`, "error");
      return;
    }
    const chunks = [];
    recorder = new MediaRecorder(stream);
    recorder.addEventListener("dataavailable", (e) => chunks.push(e.data));
    recorder.addEventListener("stop", async () => {
      stream.getTracks().forEach((t) => t.stop());
      recorder = null;
      button.textContent = "Record from microphone";
      button.setAttribute("aria-pressed", "false");
      const context = new AudioContext();
      try {
        const decoded = await context.decodeAudioData(await new Blob(chunks).arrayBuffer());
        await transcribe(new File([wavOf(decoded.getChannelData(0), decoded.sampleRate)], "recording.wav",
                                  {type: "audio/wav"}));
      } catch (err) {
        say("asr-status", `could not read the recording: ${err.message}`, "error");
      } finally {
        context.close();
      }
    });
    recorder.start();
    button.textContent = "Stop and transcribe";
    button.setAttribute("aria-pressed", "true");
    say("asr-status", "recording… press the button again to stop", "busy");
  });
}

// --- voice activity ---
function drawWave(canvas, samples, rateHz, segments) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  const seconds = samples.length / rateHz;
  ctx.fillStyle = "rgba(16, 185, 129, 0.25)";
  for (const s of segments) {
    ctx.fillRect((s.start_s / seconds) * w, 0, ((s.end_s - s.start_s) / seconds) * w, h);
  }
  ctx.strokeStyle = "#1f2328";
  ctx.beginPath();
  const step = Math.max(1, Math.floor(samples.length / w));
  for (let x = 0; x < w; x++) {
    let lo = 0, hi = 0;
    for (let i = x * step; i < Math.min(samples.length, (x + 1) * step); i++) {
      lo = Math.min(lo, samples[i]); hi = Math.max(hi, samples[i]);
    }
    ctx.moveTo(x + 0.5, h / 2 - hi * (h / 2));
    ctx.lineTo(x + 0.5, h / 2 - lo * (h / 2));
  }
  ctx.stroke();
}

function base64Of(bytes) {
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(text);
}

async function findSpeech(file) {
  say("vad-status", "running…", "busy");
  $("vad-segments").replaceChildren();
  try {
    const bytes = new Uint8Array(await file.arrayBuffer());
    const context = new AudioContext();
    const decoded = await context.decodeAudioData(bytes.slice().buffer);
    context.close();
    const body = await answer(await fetch("/v1/tasks/run", {
      method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({model: $("vad-model").value, request: {audio_base64: base64Of(bytes)}}),
    }));
    drawWave($("vad-wave"), decoded.getChannelData(0), decoded.sampleRate, body.segments);
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
  $("vad-sample").addEventListener("click", async () => findSpeech(await sampleBlob()));
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

connectStatus(() => {});
