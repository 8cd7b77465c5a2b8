"""A caller who goes on with their sentence as the reply begins: one message, one answer
(voiceagent/pipeline/continuation.py)."""

from voiceagent.pipeline.continuation import Continuations, continues_last, joined


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _user(text):
    return {"role": "user", "content": text}


def _bot(text):
    return {"role": "assistant", "content": text}


def test_a_continued_message_is_joined_to_the_next_without_the_withdrawn_reply():
    messages = [{"role": "system", "content": "Be brief."}, _user("What is the capital?"),
                _bot(""), _user("of Spain?"), _bot("Madrid."), _user("Thanks.")]
    assert joined(messages, {1}) == [messages[0], _user("What is the capital of Spain?"),
                                     _bot("Madrid."), _user("Thanks.")]
    assert not continues_last(messages, {1}) and continues_last(messages[:4], {1})


def test_a_caller_who_goes_on_twice_makes_one_message():
    messages = [_user("What is the capital"), _user("of Spain,"), _bot(""),
                _user("and why is it there?")]
    assert joined(messages, {0, 1}) == [_user("What is the capital of Spain, and why is it there?")]
    assert continues_last(messages, {0, 1})


def test_a_heard_clause_or_a_tool_call_between_keeps_the_messages_apart():
    heard = [_user("Can I return it after 30 days?"), _bot("No."), _user("Why not?")]
    assert joined(heard, {0}) == heard and not continues_last(heard, {0})
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}
    result = {"role": "tool", "content": "12:00", "tool_call_id": "1"}
    with_tool = [_user("What time is it?"), call, result, _user("in Paris")]
    assert joined(with_tool, {0}) == with_tool
    assert joined([_user("Hello"), _bot("")], {0}) == [_user("Hello"), _bot("")]


def test_speech_before_the_reply_is_heard_or_soon_after_continues_and_later_speech_does_not():
    clock = Clock()
    messages = [_user("Hello"), _bot("Hi!"), _user("What is the capital?")]
    unheard = Continuations(1.0, clock)
    unheard.committed()
    clock.now += 0.6  # nothing sent yet
    unheard.interrupted(messages)
    assert unheard.joins == {2}

    held = Continuations(1.0, clock)
    held.committed()
    clock.now += 2.5  # nothing heard yet, however long: its audio waited, or is slow to come
    held.interrupted(messages)
    assert held.joins == {2}

    slow = Continuations(1.0, clock)
    slow.committed()
    clock.now += 2.0  # a slow first clause: the window runs from the first audio
    slow.heard()
    clock.now += 0.5
    slow.interrupted(messages)
    assert slow.joins == {2}

    late = Continuations(1.0, clock)
    late.committed()
    clock.now += 0.3
    late.heard()
    clock.now += 1.5  # 1.5 s of the reply sent: a barge-in
    late.interrupted(messages)
    assert not late.joins


def test_speech_after_the_reply_ended_or_after_its_tools_ran_is_a_new_turn():
    clock = Clock()
    messages = [_user("What time is it?")]
    spoken, tools, off = (Continuations(1.0, clock), Continuations(1.0, clock),
                          Continuations(0.0, clock))
    for turns in (spoken, tools, off):
        turns.committed()
    spoken.heard()
    spoken.finished()
    tools.ran_tools()  # its side effects happened: the reply cannot be taken back
    for turns in (spoken, tools, off):
        turns.interrupted(messages)
        assert not turns.joins
