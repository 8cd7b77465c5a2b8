"""The voice pipeline on pipecat: VAD, streaming ASR, the speculative LLM service, streaming TTS."""
