// Browser client: speak typed text through WebRTC (Opus track + "control" data channel) or through the
// websocket protocol (PCM frames into an AudioWorklet player). No build step, no dependencies.
//
// window.__rt exposes the page's live state as plain data, for people debugging and for the browser test.

const $ = (id) => document.getElementById(id);

const rt = {
  transport: "webrtc",
  state: "idle",
  lastLatencyMs: null,
  level: 0,
  events: [],
  webrtc: { connectionState: "new", sessionId: null, packetsReceived: 0, bytesReceived: 0 },
  // samplesPosted: sent to the player; samplesPlayed/Dropped/Cleared: what became of them. serverDone: the
  // server has sent all of the current utterance, which still plays until buffered reaches 0.
  ws: {
    state: "closed", bytesReceived: 0, framesReceived: 0, samplesPosted: 0, samplesPlayed: 0, samplesDropped: 0,
    samplesCleared: 0, buffered: 0, serverDone: false,
  },
};
window.__rt = rt;

// A server started with API keys needs one: open the page as /?api_key=KEY. It goes to the API as a
// Bearer header, and to the websocket (where browsers cannot set headers) as the api_key parameter.
const API_KEY = new URLSearchParams(location.search).get("api_key");
const authHeaders = (headers = {}) => (API_KEY ? { ...headers, authorization: `Bearer ${API_KEY}` } : headers);

const MAX_LOG_LINES = 50;
const ICE_GATHERING_TIMEOUT_MS = 3000;
const STATS_INTERVAL_MS = 500;

// ---------------------------------------------------------------------------------------------- UI

function setState(text, kind = "") {
  rt.state = text;
  const pill = $("state");
  pill.textContent = text;
  pill.className = `pill ${kind}`;
}

function log(line) {
  rt.events.push(line);
  const item = document.createElement("li");
  item.textContent = `${new Date().toLocaleTimeString()}  ${line}`;
  const list = $("log");
  list.append(item);
  while (list.childElementCount > MAX_LOG_LINES) list.firstElementChild.remove();
  list.scrollTop = list.scrollHeight;
}

function showLatency(ms) {
  rt.lastLatencyMs = ms;
  $("latency").textContent = `${Math.round(ms)} ms`;
}

function showReceived(text) {
  $("received").textContent = text;
}

function setSpeaking(speaking) {
  $("speak").disabled = false;
  $("stop").disabled = !speaking;
}

function showDone(cancelled) {
  setState(cancelled ? "cancelled" : "connected", "live");
  setSpeaking(false);
  log(cancelled ? "cancelled" : "done");
}

// `line` goes to the log: it says what failed.
function showError(line) {
  setState("error", "error");
  setSpeaking(false);
  log(line);
}

function formatBytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} kB`;
  return `${(n / 1024 / 1024).toFixed(2)} MB`;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body.error?.message) return `${body.error.code}: ${body.error.message}`;
  } catch {
    // not JSON: fall through to the status line
  }
  return `${response.status} ${response.statusText}`;
}

// ------------------------------------------------------------------------------------- level meter

// Reads whichever analyser is attached (one per transport) and draws an RMS level in dBFS.
const meter = {
  analyser: null,
  buffer: null,
  attach(analyser) {
    analyser.fftSize = 1024;
    this.analyser = analyser;
    this.buffer = new Float32Array(analyser.fftSize);
  },
  tick() {
    if (this.analyser) {
      this.analyser.getFloatTimeDomainData(this.buffer);
      let sum = 0;
      for (const x of this.buffer) sum += x * x;
      const rms = Math.sqrt(sum / this.buffer.length);
      const db = 20 * Math.log10(rms + 1e-9);
      rt.level = Math.max(0, Math.min(1, (db + 60) / 60));
      $("meter-fill").style.width = `${(rt.level * 100).toFixed(1)}%`;
    }
    requestAnimationFrame(() => this.tick());
  },
};

// ----------------------------------------------------------------------------------------- WebRTC

// One peer connection, kept open across utterances: connecting costs a round trip and ICE/DTLS.
class WebRTCClient {
  constructor() {
    this.pc = null;
    this.channel = null;
    this.ready = null;
    this.statsTimer = null;
    this.context = null;
  }

  connect() {
    if (!this.ready) {
      this.ready = this.open().catch((error) => {
        this.close();
        throw error;
      });
    }
    return this.ready;
  }

  async open() {
    setState("connecting");
    const pc = new RTCPeerConnection({ iceServers: [] });
    this.pc = pc;
    pc.addTransceiver("audio", { direction: "recvonly" });
    const channel = pc.createDataChannel("control");
    this.channel = channel;
    channel.onmessage = (event) => this.onEvent(JSON.parse(event.data));
    pc.ontrack = (event) => this.onTrack(event.streams[0] ?? new MediaStream([event.track]));
    pc.onconnectionstatechange = () => {
      rt.webrtc.connectionState = pc.connectionState;
      log(`webrtc ${pc.connectionState}`);
      if (pc.connectionState === "failed" || pc.connectionState === "closed") {
        setState(pc.connectionState, "error");
        this.close();
      }
    };

    await pc.setLocalDescription(await pc.createOffer());
    await iceGatheringComplete(pc);
    const response = await fetch("/v1/webrtc/offer", {
      method: "POST",
      headers: authHeaders({ "content-type": "application/json" }),
      body: JSON.stringify({ sdp: pc.localDescription.sdp, type: "offer" }),
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    const answer = await response.json();
    rt.webrtc.sessionId = answer.session_id;
    await pc.setRemoteDescription({ sdp: answer.sdp, type: answer.type });
    await channelOpen(channel);
    this.statsTimer = setInterval(() => this.pollStats(), STATS_INTERVAL_MS);
    setState("connected", "live");
  }

  onTrack(stream) {
    // Chrome only feeds a remote stream into Web Audio while a media element plays it.
    $("player").srcObject = stream;
    const context = new AudioContext();
    const analyser = context.createAnalyser();
    context.createMediaStreamSource(stream).connect(analyser);
    meter.attach(analyser);
    this.context = context;
  }

  async speak(text, voice, instructions) {
    await this.connect();
    this.channel.send(JSON.stringify({ type: "speak", text, voice, ...styleOf(instructions) }));
  }

  cancel() {
    if (this.channel?.readyState === "open") this.channel.send(JSON.stringify({ type: "cancel" }));
  }

  onEvent(event) {
    switch (event.type) {
      case "started":
        setState("speaking", "live");
        setSpeaking(true);
        break;
      case "first_audio":
        showLatency(event.latency_ms);
        log(`first audio after ${event.latency_ms} ms (server)`);
        break;
      case "done":
        showDone(event.cancelled);
        break;
      case "error":
        showError(`error ${event.code}: ${event.message}`);
        break;
    }
  }

  async pollStats() {
    if (!this.pc) return;
    const stats = await this.pc.getStats();
    for (const report of stats.values()) {
      if (report.type === "inbound-rtp" && report.kind === "audio") {
        rt.webrtc.packetsReceived = report.packetsReceived;
        rt.webrtc.bytesReceived = report.bytesReceived;
        if (rt.transport === "webrtc") showReceived(`${report.packetsReceived} pkts`);
      }
    }
  }

  close() {
    clearInterval(this.statsTimer);
    const sessionId = rt.webrtc.sessionId;
    // keepalive lets the request outlive the page when this runs on pagehide.
    if (sessionId) {
      fetch(`/v1/webrtc/${sessionId}`, { method: "DELETE", keepalive: true, headers: authHeaders() }).catch(() => {});
    }
    this.pc?.close();
    this.context?.close();
    this.pc = null;
    this.channel = null;
    this.ready = null;
    rt.webrtc.sessionId = null;
  }
}

function iceGatheringComplete(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    // No trickle ICE in this signalling: send what was gathered after a short wait at most.
    const timer = setTimeout(resolve, ICE_GATHERING_TIMEOUT_MS);
    pc.addEventListener("icegatheringstatechange", () => {
      if (pc.iceGatheringState === "complete") {
        clearTimeout(timer);
        resolve();
      }
    });
  });
}

function channelOpen(channel) {
  if (channel.readyState === "open") return Promise.resolve();
  return new Promise((resolve, reject) => {
    channel.addEventListener("open", resolve, { once: true });
    channel.addEventListener("close", () => reject(new Error("data channel closed")), { once: true });
  });
}

// -------------------------------------------------------------------------------------- websocket

const WS_SAMPLE_RATE = 24000;
const AUDIO_FRAME_KIND = 0x01;

// The native websocket protocol (/v1/ws): one context per utterance, 16-bit PCM at 24 kHz, played by
// an AudioWorklet whose context runs at the same rate (the browser resamples to the device).
class WebSocketClient {
  constructor() {
    this.socket = null;
    this.ready = null;
    this.context = null;
    this.player = null;
    this.analyser = null;
    this.contextCount = 0;
    this.current = null;
  }

  connect() {
    if (!this.ready) {
      this.ready = this.open().catch((error) => {
        this.ready = null;
        throw error;
      });
    }
    return this.ready;
  }

  async open() {
    setState("connecting");
    await this.openAudio();
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const query = API_KEY ? `?api_key=${encodeURIComponent(API_KEY)}` : "";
    const socket = new WebSocket(`${scheme}://${location.host}/v1/ws${query}`);
    socket.binaryType = "arraybuffer";
    socket.onmessage = (event) =>
      typeof event.data === "string" ? this.onEvent(JSON.parse(event.data)) : this.onAudio(event.data);
    socket.onclose = () => {
      rt.ws.state = "closed";
      this.socket = null;
      this.ready = null;
      log("websocket closed");
    };
    await new Promise((resolve, reject) => {
      socket.onopen = resolve;
      socket.onerror = () => reject(new Error("websocket connection failed"));
    });
    this.socket = socket;
    rt.ws.state = "open";
    log("websocket open");
    setState("connected", "live");
  }

  async openAudio() {
    if (this.context) return;
    const context = new AudioContext({ sampleRate: WS_SAMPLE_RATE });
    await context.audioWorklet.addModule("pcm-player.js");
    const player = new AudioWorkletNode(context, "pcm-player", { outputChannelCount: [1] });
    player.port.onmessage = (event) => {
      rt.ws.samplesPlayed = event.data.played;
      rt.ws.samplesDropped = event.data.dropped;
      rt.ws.samplesCleared = event.data.cleared;
      rt.ws.buffered = event.data.buffered;
      this.onPlayout();
    };
    const analyser = context.createAnalyser();
    player.connect(analyser).connect(context.destination);
    this.context = context;
    this.player = player;
    this.analyser = analyser;
  }

  async speak(text, voice, instructions) {
    await this.connect();
    await this.context.resume();
    meter.attach(this.analyser);
    this.cancel();
    const contextId = `u${++this.contextCount}`;
    this.current = { id: contextId, sentAt: performance.now(), firstAudio: false };
    const send = (message) => this.socket.send(JSON.stringify({ ...message, context_id: contextId }));
    send({ type: "start", voice, sample_rate: WS_SAMPLE_RATE, encoding: "pcm_s16le", ...styleOf(instructions) });
    send({ type: "text", text });
    send({ type: "end" });
    setState("speaking", "live");
    setSpeaking(true);
  }

  // Stop: cancel the context if the server is still on it (its late events are ignored: the page no
  // longer follows that context), drop whatever the player holds, and say so at once.
  cancel() {
    const stopped = this.current;
    if (stopped && !stopped.serverDone && this.socket) {
      this.socket.send(JSON.stringify({ type: "cancel", context_id: stopped.id }));
    }
    this.current = null;
    rt.ws.serverDone = false;
    this.player?.port.postMessage({ type: "clear" });
    if (stopped) showDone(true);
  }

  // The utterance is over once the server is done and the player has used up every sample posted.
  onPlayout() {
    const ws = rt.ws;
    if (!this.current?.serverDone) return;
    if (ws.samplesPlayed + ws.samplesDropped + ws.samplesCleared < ws.samplesPosted) return;
    this.current = null;
    ws.serverDone = false;
    showDone(false);
  }

  onAudio(buffer) {
    const bytes = new Uint8Array(buffer);
    if (bytes[0] !== AUDIO_FRAME_KIND) return;
    const idLength = bytes[1];
    const contextId = new TextDecoder().decode(bytes.subarray(2, 2 + idLength));
    const payload = new DataView(buffer, 2 + idLength + 4);
    rt.ws.framesReceived += 1;
    rt.ws.bytesReceived += payload.byteLength;
    showReceived(formatBytes(rt.ws.bytesReceived));
    if (contextId !== this.current?.id) return; // audio of a cancelled context still in flight
    if (!this.current.firstAudio) {
      this.current.firstAudio = true;
      const ms = performance.now() - this.current.sentAt;
      showLatency(ms);
      log(`first audio after ${Math.round(ms)} ms (client)`);
    }
    const samples = new Float32Array(payload.byteLength >> 1);
    for (let i = 0; i < samples.length; i++) samples[i] = payload.getInt16(2 * i, true) / 32768;
    rt.ws.samplesPosted += samples.length;
    this.player.port.postMessage({ type: "pcm", samples }, [samples.buffer]);
  }

  onEvent(event) {
    switch (event.type) {
      case "done":
        if (event.context_id !== this.current?.id) return;
        if (event.cancelled) {
          this.current = null;
          showDone(true);
          break;
        }
        // The server has closed this context; Stop stays live while its buffered audio plays.
        this.current.serverDone = true;
        rt.ws.serverDone = true;
        log("all audio received; playing the rest");
        this.onPlayout();
        break;
      case "error":
        if (event.context_id && event.context_id !== this.current?.id) return;
        showError(`error ${event.code}: ${event.message}`);
        break;
    }
  }
}

// ----------------------------------------------------------------------------------------- voices

async function loadVoices(select) {
  const response = await fetch("/v1/voices", { headers: authHeaders() });
  if (!response.ok) throw new Error(await errorMessage(response));
  const { data } = await response.json();
  const list = $("voice");
  list.replaceChildren(
    ...data.map((voice) => {
      const option = new Option(voice.builtin ? `${voice.voice_id} (built in)` : voice.voice_id, voice.voice_id);
      option.selected = voice.voice_id === select;
      return option;
    }),
  );
}

async function uploadVoice(event) {
  event.preventDefault();
  const status = $("upload-status");
  const voiceId = $("upload-name").value.trim();
  const form = new FormData();
  form.append("voice_id", voiceId);
  form.append("transcript", $("upload-text").value);
  form.append("audio", $("upload-file").files[0]);
  status.textContent = "uploading…";
  const response = await fetch("/v1/voices", { method: "POST", body: form, headers: authHeaders() });
  if (!response.ok) {
    status.textContent = await errorMessage(response);
    return;
  }
  status.textContent = `added ${voiceId}`;
  log(`voice ${voiceId} added`);
  await loadVoices(voiceId);
}

// ------------------------------------------------------------------------------------------ wiring

const clients = { webrtc: new WebRTCClient(), ws: new WebSocketClient() };

// The instruction box's text as request fields: none when it is blank (zero-shot cloning).
function styleOf(instructions) {
  return instructions ? { instructions } : {};
}

async function speak() {
  const text = $("text").value.trim();
  if (!text) return;
  $("speak").disabled = true;
  rt.lastLatencyMs = null;
  $("latency").textContent = "…";
  try {
    await clients[rt.transport].speak(text, $("voice").value, $("instructions").value.trim());
  } catch (error) {
    showError(String(error.message ?? error));
  }
}

function chooseTransport(transport) {
  clients[rt.transport].cancel();
  rt.transport = transport;
  setSpeaking(false);
  showReceived("–");
}

function main() {
  $("speak").addEventListener("click", speak);
  $("stop").addEventListener("click", () => clients[rt.transport].cancel());
  $("upload-form").addEventListener("submit", (event) => uploadVoice(event).catch((e) => log(String(e))));
  for (const input of document.querySelectorAll('input[name="transport"]')) {
    input.addEventListener("change", () => chooseTransport(input.value));
  }
  window.addEventListener("pagehide", () => clients.webrtc.close());
  loadVoices("default").catch((error) => log(`could not list voices: ${error.message}`));
  meter.tick();
}

main();
