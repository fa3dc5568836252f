"""Agent features exercised through the public API with a scripted model."""
