"""The cache of probed profiles: one Hardware JSON (the machine's figures and its UnitProfile, profile.py) per
profile key under $MEGATRAIN_CACHE/profiles (MEGATRAIN_PROFILES overrides the folder). A file that does not
parse or validate, or whose key does not match its fields, reads as None, so a probe measures it again."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import ValidationError

from megatrain.files import cache_root, check_cache_writable, read_json, write_atomic

from .hardware import Hardware
from .profile import PROFILE_VERSION, key_of

MAX_PROFILE_BYTES = 4 << 20


def cache_dir() -> Path:
    """Where profiles are cached: $MEGATRAIN_PROFILES, else $MEGATRAIN_CACHE/profiles, else
    ~/.cache/megatrain/profiles."""
    if os.environ.get("MEGATRAIN_PROFILES"):
        return Path(os.environ["MEGATRAIN_PROFILES"])
    return cache_root() / "profiles"


def cache_path(key: str) -> Path:
    return cache_dir() / f"hardware-{key}.json"


def read_cached(key: str):
    """The cached Hardware profile (with its UnitProfile) of `key`, or None when there is none or it is
    corrupt (not JSON, not a valid profile, or a key that does not match its fields): a probe then measures it
    again, and a run plans without it."""
    path = cache_path(key)
    if not path.is_file():
        return None
    try:
        hw = Hardware.model_validate(read_json(path, MAX_PROFILE_BYTES, "a cached hardware profile"))
    except (ValueError, ValidationError):
        return None
    u = hw.units
    return hw if u is not None and u.key == key and key_of(u) == key and u.version == PROFILE_VERSION else None


def write_cached(hw) -> Path:
    """Cache a Hardware profile carrying a UnitProfile under its key."""
    path = cache_path(hw.units.key)
    check_cache_writable(path.parent, "a probed profile")
    return write_atomic(path, hw.to_json(indent=1) + "\n", "the profile cache")
