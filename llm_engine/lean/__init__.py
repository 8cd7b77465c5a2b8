"""The lean decode path: the target's own quantised weights through a small forward of our own
(`llama`), one torch kernel per projection (`linear`), the GGUF's 4-bit codes read unchanged
(`gguf`), behind the engine's target-runner seam (`runner`)."""
