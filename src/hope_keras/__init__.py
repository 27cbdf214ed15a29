"""hope_keras."""
