// AudioWorklet processor: plays mono float32 PCM posted from the main thread, silence on underrun.
//
// Messages in:  {type: "pcm", samples: Float32Array} (at the AudioContext's rate), {type: "clear"}.
// Messages out: {type: "progress", played, buffered, dropped, cleared} about every 50 ms, counted in
// samples (cleared: buffered samples a "clear" dropped).
// The buffer is a fixed ring; samples that do not fit are dropped and counted, never reallocated.

const REPORT_EVERY_BLOCKS = 10;

class PcmPlayer extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const seconds = options.processorOptions?.bufferSeconds ?? 120;
    this.ring = new Float32Array(Math.ceil(seconds * sampleRate));
    this.readAt = 0;
    this.buffered = 0;
    this.played = 0;
    this.dropped = 0;
    this.cleared = 0;
    this.blocks = 0;
    this.port.onmessage = (event) => this.receive(event.data);
  }

  receive(message) {
    if (message.type === "clear") {
      this.cleared += this.buffered;
      this.readAt = 0;
      this.buffered = 0;
    } else if (message.type === "pcm") {
      this.write(message.samples);
    }
  }

  write(samples) {
    const capacity = this.ring.length;
    const count = Math.min(samples.length, capacity - this.buffered);
    this.dropped += samples.length - count;
    let writeAt = (this.readAt + this.buffered) % capacity;
    for (let i = 0; i < count; i++) {
      this.ring[writeAt] = samples[i];
      writeAt = writeAt + 1 === capacity ? 0 : writeAt + 1;
    }
    this.buffered += count;
  }

  process(_inputs, outputs) {
    const out = outputs[0][0];
    const count = Math.min(out.length, this.buffered);
    const capacity = this.ring.length;
    for (let i = 0; i < count; i++) {
      out[i] = this.ring[this.readAt];
      this.readAt = this.readAt + 1 === capacity ? 0 : this.readAt + 1;
    }
    out.fill(0, count);
    this.buffered -= count;
    this.played += count;
    if (++this.blocks % REPORT_EVERY_BLOCKS === 0) {
      this.port.postMessage({
        type: "progress", played: this.played, buffered: this.buffered, dropped: this.dropped, cleared: this.cleared,
      });
    }
    return true;
  }
}

registerProcessor("pcm-player", PcmPlayer);
