"""The pages' session cookies (voiceagent.server.sessions): expiry, revocation, forgery."""

from voiceagent.server.sessions import Sessions


class Clock:
    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_session_expires_after_its_ttl():
    clock = Clock()
    sessions = Sessions(ttl_s=3600, attempts_per_min=10, clock=clock)
    cookie = sessions.issue("s3cret")
    clock.now += 3599
    assert sessions.valid("s3cret", cookie)
    clock.now += 2
    assert not sessions.valid("s3cret", cookie)


def test_a_cookie_is_not_the_token_and_a_new_token_ends_it():
    sessions = Sessions(ttl_s=3600, attempts_per_min=10)
    cookie = sessions.issue("s3cret")
    assert "s3cret" not in cookie
    assert not sessions.valid("rotated", cookie)


def test_a_forged_or_stretched_cookie_is_refused():
    sessions = Sessions(ttl_s=3600, attempts_per_min=10)
    expires, nonce, mac = sessions.issue("s3cret").split(".")
    assert not sessions.valid("s3cret", f"{int(expires) + 86400}.{nonce}.{mac}")
    assert not sessions.valid("s3cret", f"{expires}.other.{mac}")
    for junk in (None, "", "a.b", "x.y.z", "\ud800.a.b", f"{expires}.{nonce}.{mac}.x"):
        assert not sessions.valid("s3cret", junk)


def test_revoking_one_session_leaves_the_others():
    sessions = Sessions(ttl_s=3600, attempts_per_min=10)
    signed_out, other = sessions.issue("s3cret"), sessions.issue("s3cret")
    sessions.revoke("s3cret", signed_out)
    assert not sessions.valid("s3cret", signed_out) and sessions.valid("s3cret", other)


def test_the_attempt_limit_frees_up_a_minute_after_the_first_try():
    clock = Clock()
    sessions = Sessions(ttl_s=3600, attempts_per_min=2, clock=clock)
    assert sessions.retry_after("a") == 0
    clock.now += 20
    assert sessions.retry_after("a") == 0
    clock.now += 10
    assert sessions.retry_after("a") == 30
    assert sessions.retry_after("b") == 0
    clock.now += 30
    assert sessions.retry_after("a") == 0
