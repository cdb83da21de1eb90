"""Model engines: CosyVoice2 LLM, token2wav flows and HiFT. Imports nothing from `realtime`."""
