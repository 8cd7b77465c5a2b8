"""A caller who goes on with their sentence as the reply begins: one message, one answer
(voiceagent/pipeline/continuation.py)."""

from voiceagent.pipeline.continuation import Continuations, joined


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
                _bot("The"), _user("of Spain?"), _bot("Madrid."), _user("Thanks.")]
    assert joined(messages, {1}) == [messages[0], _user("What is the capital of Spain?"),
                                     _bot("Madrid."), _user("Thanks.")]


def test_a_caller_who_goes_on_twice_makes_one_message():
    messages = [_user("What is the capital"), _user("of Spain,"), _bot("Spain"),
                _user("and why is it there?")]
    assert joined(messages, {0, 1}) == [_user("What is the capital of Spain, and why is it there?")]


def test_no_join_across_a_tool_call_or_without_a_next_message():
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}
    result = {"role": "tool", "content": "12:00", "tool_call_id": "1"}
    with_tool = [_user("What time is it?"), call, result, _user("in Paris")]
    assert joined(with_tool, {0}) == with_tool
    assert joined([_user("Hello"), _bot("Hi")], {0}) == [_user("Hello"), _bot("Hi")]
    assert joined([_user("a"), _bot("b"), _user("c")], set()) == [_user("a"), _bot("b"), _user("c")]


def test_speech_soon_after_the_reply_began_continues_the_turn_and_later_speech_does_not():
    clock = Clock()
    messages = [_user("Hello"), _bot("Hi!"), _user("What is the capital?")]
    turns = Continuations(1.0, clock)
    turns.committed()
    clock.now += 0.6  # nothing heard yet
    assert turns.interrupted(messages) and turns.joins == {2}

    late = Continuations(1.0, clock)
    late.committed()
    clock.now += 0.3
    late.heard()
    clock.now += 1.5  # the caller heard 1.5 s of the reply: a barge-in
    assert not late.interrupted(messages) and not late.joins


def test_speech_after_the_reply_ended_or_after_its_tools_ran_is_a_new_turn():
    clock = Clock()
    messages = [_user("What time is it?")]
    spoken = Continuations(1.0, clock)
    spoken.committed()
    spoken.heard()
    spoken.finished()
    assert not spoken.interrupted(messages)

    tools = Continuations(1.0, clock)
    tools.committed()
    tools.ran_tools()  # its side effects happened: the reply cannot be taken back
    assert not tools.interrupted(messages)

    off = Continuations(0.0, clock)
    off.committed()
    assert not off.interrupted(messages)
