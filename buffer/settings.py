"""Kept importable: the layered YAML + `OFFPOLICY_*` loader moved to `config/loader.py` (one loader for
every process); these names are the same objects."""

from __future__ import annotations

from config.loader import ENV_NESTING, ENV_PREFIX, env_overrides, load_layered, merge

__all__ = ["ENV_NESTING", "ENV_PREFIX", "env_overrides", "load_layered", "merge"]
