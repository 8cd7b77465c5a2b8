"""The benchmarks behind `voiceagent bench`: engine (tokens/s, side by side with HF and an
OpenAI-compatible anchor), call (scripted calls under several variants), serve (simultaneous calls,
the capacity knee, memory), formats (weight formats); results.py writes their reports."""
