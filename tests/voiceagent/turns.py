"""Hand-built turn records for store, API and report tests: the shape the clocks observer emits."""

from __future__ import annotations

from voiceagent.pipeline.turn_record import Breakdown, Clocks, Percentiles, TurnRecord, TurnStats


def make_turn(call_id: str = "c1", turn: int = 1, started_at: float = 1_000.0,
              method: str = "ngram", clock3_ms: float = 900.0, interrupted: bool = False,
              user_text: str = "what is the capital of france") -> TurnRecord:
    steps = [
        {"k": 4, "drafted": 4, "accepted": 2, "rejection_pos": 2, "committed": 3,
         "draft_ms": 0.5, "verify_ms": 60.0},
        {"k": 4, "drafted": 4, "accepted": 4, "rejection_pos": None, "committed": 5,
         "draft_ms": 0.4, "verify_ms": 62.0},
    ] if method != "off" else []
    return TurnRecord(
        call_id=call_id, turn=turn, started_at=started_at, user_text=user_text,
        bot_text="Paris.", llm_text="Paris.", interrupted=interrupted,
        clocks=Clocks(request_to_first_token_ms=100.0 + turn,
                      itl_ms=Percentiles(40.0, 60.0, 70.0), turn_end_to_first_audio_ms=clock3_ms),
        breakdown=Breakdown(user_speech_ms=1500.0, vad_hangover_ms=300.0, asr_final_ms=150.0,
                            transcript_to_request_ms=1.0, prefill_ms=90.0, first_token_ms=100.0,
                            first_clause_ms=250.0, tts_first_chunk_ms=120.0,
                            chunk_to_audio_ms=2.0),
        engine=TurnStats.from_dict({
            "method": method, "itl_ms": [40.0, 42.0, 38.0], "steps": steps,
            "k_history": [4, 4] if steps else [], "accept_len_hist": [0, 0, 1, 0, 1]
            if steps else [], "drafted_by_pos": [2, 2, 2, 2] if steps else [],
            "accepted_by_pos": [2, 2, 1, 1] if steps else []}),
        barge_in_to_silence_ms=210.0 if interrupted else None,
    )
