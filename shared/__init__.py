"""tensorbus's common package: the wire contract, config, logging, bus helpers."""

VERSION = "0.1.0"
