"""llm_engine: an in-process draft-target speculative decoding engine."""
