"""`PlaybackLead`: how long a reply's next phrase may wait and keep `lead_s` of audio ahead."""

import pytest

from audio.config import TTSConfig
from voiceagent.pipeline.playback_lead import PlaybackLead


def test_nothing_waits_before_the_first_chunk():
    assert PlaybackLead(2.0, max_wait_s=10.0).wait_s(now=100.0) == 0.0


def test_the_wait_leaves_lead_s_of_audio_ahead_of_real_time_playback():
    lead = PlaybackLead(2.0, max_wait_s=10.0)
    lead.synthesised(1.5, now=10.0)  # first chunk: playback starts
    lead.synthesised(3.0, now=10.2)  # 4.5 s out, 0.2 s played
    assert lead.wait_s(now=10.2) == pytest.approx(4.5 - 0.2 - 2.0)
    assert lead.wait_s(now=12.5) == pytest.approx(0.0)  # 2.0 s ahead: synthesise now
    assert lead.wait_s(now=13.0) == 0.0  # behind the lead: at once, never negative


def test_zero_lead_never_waits():
    lead = PlaybackLead(0.0, max_wait_s=10.0)
    lead.synthesised(5.0, now=0.0)
    assert lead.wait_s(now=0.1) == 0.0


def test_a_new_reply_starts_from_nothing():
    lead = PlaybackLead(1.0, max_wait_s=10.0)
    lead.synthesised(5.0, now=0.0)
    lead.start()
    assert lead.wait_s(now=0.1) == 0.0
    lead.synthesised(1.5, now=0.2)
    assert lead.wait_s(now=0.2) == pytest.approx(0.5)


def test_one_wait_is_at_most_max_wait_s():
    lead = PlaybackLead(1.0, max_wait_s=1.5)
    lead.synthesised(6.0, now=0.0)  # one long clause: 5 s beyond the lead
    assert lead.wait_s(now=0.0) == 1.5


@pytest.mark.parametrize("bad", [-0.5, float("nan")])
def test_a_negative_or_nan_lead_is_refused(bad):
    with pytest.raises(ValueError, match="tts.lead_s must be 0"):
        TTSConfig(lead_s=bad)
