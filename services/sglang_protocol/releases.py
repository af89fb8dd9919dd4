"""SGLang release numbers as servers report them (the `version` of /server_info), compared against the first
release that has a feature."""

from __future__ import annotations

import re

FLATTENED_BUCKET_SINCE = (0, 5, 6)  # the first SGLang release whose distributed update takes flattened_bucket
_PRE_RELEASE = re.compile(r"[.\-_]?(a|b|c|rc|alpha|beta|pre|preview|dev)\d*", re.IGNORECASE)


def release_at_least(version: str | None, minimum: tuple[int, ...]) -> bool:
    """Whether a reported SGLang version (PEP 440: "0.5.6", "0.5.6.post2", "0.5.7.dev12+g1a2b") is `minimum` or
    later; a pre-release of `minimum` itself ("0.5.6rc0", "0.5.6.dev3") is not, nor is anything unparsable
    (the built-in engine's "sluice-..." or a missing version)."""
    match = re.match(r"v?(\d+(?:\.\d+)*)(.*)", version or "")
    if match is None:
        return False
    release = tuple(int(p) for p in match.group(1).split("."))
    width = max(len(release), len(minimum))
    release, minimum = release + (0,) * (width - len(release)), minimum + (0,) * (width - len(minimum))
    return release > minimum or (release == minimum and not _PRE_RELEASE.match(match.group(2)))
