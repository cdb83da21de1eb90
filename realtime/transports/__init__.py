"""Thin adapters between the wire and sessions: websockets (ws.py), HTTP (http.py), WebRTC (webrtc.py)."""
