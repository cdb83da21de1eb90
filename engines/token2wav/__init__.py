"""Speech tokens to 24 kHz waveform: flow matching (DiT or UNet) plus the HiFT vocoder."""
