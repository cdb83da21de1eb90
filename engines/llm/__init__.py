"""Speech-token language model: the CosyVoice2 Qwen2 LM and the engines that serve it."""
