"""The package version (its own module so that modules inside the package can read it without a cycle)."""
__version__ = "0.1.0"
