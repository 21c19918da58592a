"""The package version, in a module of its own so that anything may import it without importing
the package's API (the writer records it in every manifest)."""

__version__ = "0.1.0"
