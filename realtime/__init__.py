"""The realtime service: policy, sessions and transports over the engines (see docs/architecture.md)."""
