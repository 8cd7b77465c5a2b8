"""The call server: `voiceagent serve` (browser WebRTC, Twilio Media Streams, health)."""
