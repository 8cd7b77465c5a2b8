"""A hub cache entry laid out as huggingface_hub writes one, for offline resolution tests."""

from pathlib import Path


def cached_snapshot(cache: Path, repo_id: str, commit: str = "0123abcd") -> Path:
    """refs/main -> snapshots/<commit>/ under `cache`; returns the (empty) snapshot folder."""
    entry = cache / f"models--{repo_id.replace('/', '--')}"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(commit)
    snapshot = entry / "snapshots" / commit
    snapshot.mkdir(parents=True)
    return snapshot
