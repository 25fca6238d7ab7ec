"""Moved to bench/support/tiny_encoders.py: bench/ uses it, and bench/ never imports
tests/. This name stays only while tests/engine/ imports it from here; import it from
bench.support.tiny_encoders instead."""

from bench.support.tiny_encoders import *  # noqa: F401,F403
