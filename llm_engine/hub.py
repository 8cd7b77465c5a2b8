"""Hub ids on a machine that may have no network: an answer in seconds, naming the fix.

Given a hub id with no network, huggingface_hub retries each request five times with back-off
(about 50 s) before transformers or faster-whisper give up, with "ConnectError" as the only
reason. Here the hub is probed once with a short timeout; offline, a model already in the hub
cache is loaded from its snapshot folder, and any other is refused at once.
"""

from __future__ import annotations

import os
import time

PROBE_TIMEOUT_S = 3.0
PROBE_TTL_S = 60.0  # one probe serves every model resolved within this time

_probed: dict[str, tuple[float, str | None]] = {}  # endpoint -> (when, why unreachable or None)


class HubUnavailable(RuntimeError):
    """A hub id that cannot be loaded here now; the message names the model and the fix."""


def hub_location(repo_id: str, setting: str | None = None) -> str:
    """`repo_id` itself when the hub answers (the loader downloads or updates it); its cached
    snapshot folder when the hub is off (HF_HUB_OFFLINE) or unreachable; else HubUnavailable.
    `setting` is the config field that names the model, for the message."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    offline = f"this process is offline (HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '1')})"
    why = offline if constants.HF_HUB_OFFLINE else _unreachable()
    if why is None:
        return repo_id
    try:
        return snapshot_download(repo_id, local_files_only=True, cache_dir=constants.HF_HUB_CACHE)
    except HFValidationError:
        raise HubUnavailable(
            f"'{repo_id}' is neither a local path nor a valid hub id") from None
    except LocalEntryNotFoundError:
        field = setting or "the config field that names it"
        raise HubUnavailable(
            f"'{repo_id}' is a hub id, but {why} and it is not in the hub cache "
            f"({constants.HF_HUB_CACHE}): download it on a networked machine "
            f"(`hf download {repo_id} --local-dir DIR`), copy DIR here and set {field} to DIR"
        ) from None


def _unreachable() -> str | None:
    """Why the hub cannot be reached now, or None when it answers (any HTTP status)."""
    from huggingface_hub import constants

    endpoint, now = constants.ENDPOINT, time.monotonic()
    when, why = _probed.get(endpoint, (None, None))
    if when is None or now - when > PROBE_TTL_S:
        why = _probe(endpoint)
        _probed[endpoint] = (now, why)
    return why


def _probe(endpoint: str) -> str | None:
    from huggingface_hub.utils import get_session

    try:  # huggingface_hub's own session: its proxies and certificates, but no retries
        get_session().head(endpoint, timeout=PROBE_TIMEOUT_S)
    except Exception as exc:  # its HTTP library's errors (httpx2 today): any means unreachable
        return f"the hub ({endpoint}) cannot be reached ({exc})"
    return None
