"""The agents' websocket protocol: a sans-I/O core (core.py) and wire dialects."""
