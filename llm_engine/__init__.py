"""llm_engine: an in-process draft-target speculative decoding engine.

Import what you use from its modules (`llm_engine.engine.SpeculativeEngine`, `llm_engine.serving.
EngineWorker`, ...): the package itself imports nothing, so its light parts (config, errors) load
without torch."""
