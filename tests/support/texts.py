"""Moved to bench/support/texts.py: bench/ uses it, and bench/ never imports
tests/. This name stays only while tests/engine/ imports it from here; import it from
bench.support.texts instead."""

from bench.support.texts import *  # noqa: F401,F403
