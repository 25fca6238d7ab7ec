"""What the registry refuses, as exceptions the CLI prints and services can catch."""

from __future__ import annotations


class RegistryError(Exception):
    """Any refusal or failure of a registry operation; the message is for a user."""


class VersionNotFound(RegistryError, LookupError):
    """The model or version is not in the registry (or still uploading)."""


class VersionExists(RegistryError):
    """A push named a version that is already taken."""


class ChecksumError(RegistryError):
    """A fetched file's bytes differ from its metadata (or its object is missing)."""


class IncompatibleVersion(RegistryError, ValueError):
    """An alias would point at a version of another kind than the model's."""


class InvalidWeight(RegistryError, ValueError):
    """A canary weight outside [0, 1]."""


class NothingToRollBack(RegistryError):
    """Rollback asked for, but prod has no earlier version."""
