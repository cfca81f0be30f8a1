"""The built-in model and data sources."""
