"""Simulated peers: a caller from a WAV file through the real pipeline (`voiceagent call`), and a
Twilio Media Streams client for tests and `bench serve`."""
