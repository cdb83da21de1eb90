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
  ws: { state: "closed", bytesReceived: 0, framesReceived: 0, samplesPlayed: 0, samplesDropped: 0 },
};
window.__rt = rt;

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
    this.speakSentAt = 0;
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
      headers: { "content-type": "application/json" },
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

  async speak(text, voice) {
    await this.connect();
    this.speakSentAt = performance.now();
    this.channel.send(JSON.stringify({ type: "speak", text, voice }));
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
        setState(event.cancelled ? "cancelled" : "connected", "live");
        setSpeaking(false);
        log(event.cancelled ? "cancelled" : "done");
        break;
      case "error":
        setState("error", "error");
        setSpeaking(false);
        log(`error ${event.code}: ${event.message}`);
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
        showReceived(`${report.packetsReceived} pkts`);
      }
    }
  }

  close() {
    clearInterval(this.statsTimer);
    const sessionId = rt.webrtc.sessionId;
    if (sessionId) fetch(`/v1/webrtc/${sessionId}`, { method: "DELETE" }).catch(() => {});
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
