"""Command line verbs. Nothing in the library imports this package."""
