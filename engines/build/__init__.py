"""What `scripts/build_engines.py` runs to put a complete models directory in place.

- `synthetic`: random-weight checkpoints of our modules in the released layout, with `tokenizer`
  (a small Qwen2-format BPE) and `onnx_models` (front-end stand-ins with the real contracts);
- `download`: the released checkpoints from Hugging Face or ModelScope;
- `verify`: which files a directory needs and the checks that each one is usable;
- `manifest`: `realtime-manifest.json`, written last, the mark of a complete directory;
- `tensorrt`: conversions and engine builds for the accelerated paths.
"""
